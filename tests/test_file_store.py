"""Tests of FileStore's log: checksums, truncation, file mode, compaction and large logs.

Every test works on real files under `tmp_path`; the multi-process ones run their ranks
through the harness (`run_ranks`, no process group). The shared Store contract tests
that FileStore also passes are in tests/test_store.py.
"""

from __future__ import annotations

import logging
import os
import stat
import struct
import threading
import zlib

import pytest

from distcomm.errors import DistStoreError
from distcomm.store import FileStore
from distcomm.store.file import records as file_module
from tests.harness import run_ranks

MIB = 1 << 20
HEADER = file_module.RECORD.size
MAGIC = file_module.MAGIC


def _record(op: int, key: bytes, value: bytes) -> bytes:
    """A well-formed record, checksums included."""
    header = file_module.RECORD.pack(op, len(key), len(value), zlib.crc32(key + value))
    return header + key + value


def _store_file(path) -> int:
    """Make a closed store file holding key=value then other=2; the offset of the first SET."""
    store = FileStore(str(path), timeout=5)
    store.set("key", b"value")
    store.set("other", b"2")
    store.close()
    return len(MAGIC) + HEADER  # after the OPEN record


def _flip(path, where: int, bit: int = 0) -> None:
    data = bytearray(path.read_bytes())
    data[where] ^= 1 << bit
    path.write_bytes(bytes(data))


def _inode(path) -> int:
    return os.stat(path).st_ino


# -- truncation, foreign files, corruption -------------------------------------------------


@pytest.mark.parametrize("length", [0, len(MAGIC) + 3], ids=["empty", "partial"])
def test_a_truncated_file_is_an_error_for_an_existing_user(tmp_path, length):
    path = tmp_path / "store"
    store = FileStore(str(path), timeout=5)
    store.set("key", b"value")
    replayed = path.stat().st_size
    os.truncate(path, length)
    message = rf"{path.name}.* is {length} bytes long.*already read {replayed} bytes"
    with pytest.raises(DistStoreError, match=message) as info:
        store.get("key")
    assert "truncated" in str(info.value) and "contents are lost" in str(info.value)
    assert "new file" in str(info.value)
    with pytest.raises(DistStoreError, match="truncated"):
        store.set("key", b"again")
    with pytest.raises(DistStoreError, match="truncated"):
        store.close()
    store.close()  # closed anyway: a second close does nothing


def test_foreign_files_are_refused_untouched(tmp_path):
    junk = tmp_path / "junk"
    junk.write_bytes(b"not a store at all, just some text\n")
    with pytest.raises(DistStoreError, match=r"junk.*not a distcomm FileStore file \(v2\)"):
        FileStore(str(junk), timeout=5)
    assert junk.read_bytes() == b"not a store at all, just some text\n"

    old = tmp_path / "old"
    v1 = b"distcomm FileStore v1\n" + struct.pack("<BII", file_module.OP_OPEN, 0, 0)
    old.write_bytes(v1)
    with pytest.raises(DistStoreError, match=r"old.*FileStore v1 file.*pass a new path"):
        FileStore(str(old), timeout=5)
    assert old.read_bytes() == v1


@pytest.mark.parametrize(
    ("field", "at"),
    [
        ("op", 0),
        ("key length", 1),
        ("value length", 5),
        ("data checksum", 9),
        ("header checksum", 13),
        ("key", HEADER + 1),
        ("value", HEADER + 3 + 4),
    ],
)
def test_a_flipped_bit_names_the_offset(tmp_path, field, at):
    path = tmp_path / "store"
    offset = _store_file(path)
    reader = FileStore(str(path), timeout=5)  # replayed everything before the damage
    reader_pos = path.stat().st_size
    _flip(path, offset + at, bit=3)
    damaged = path.read_bytes()
    with pytest.raises(DistStoreError, match=rf"corrupt at byte {offset}\b"):
        FileStore(str(path), timeout=5)
    assert path.read_bytes() == damaged  # the writer that opened it did not cut anything
    assert reader.get("key") == b"value"  # what was read before stays readable
    assert reader_pos <= path.stat().st_size
    reader.close()


def test_a_flipped_length_is_not_mistaken_for_a_torn_record(tmp_path):
    path = tmp_path / "store"
    offset = _store_file(path)
    _flip(path, offset + 5 + 3, bit=7)  # value length + 2**31: far past the end of the file
    damaged = path.read_bytes()
    for _ in range(2):  # neither a reader nor the next writer cuts it off as torn
        with pytest.raises(DistStoreError, match=rf"byte {offset}\b.*header fails its checksum"):
            FileStore(str(path), timeout=5)
    assert path.read_bytes() == damaged


def test_a_key_that_is_not_utf8_is_corruption(tmp_path):
    path = tmp_path / "store"
    _store_file(path)
    offset = path.stat().st_size
    with open(path, "ab") as f:
        f.write(_record(file_module.OP_SET, b"\xff\xfekey", b"v"))
    with pytest.raises(DistStoreError, match=rf"corrupt at byte {offset}\b.*not UTF-8"):
        FileStore(str(path), timeout=5)


def test_an_unknown_record_type_is_corruption(tmp_path):
    path = tmp_path / "store"
    _store_file(path)
    offset = path.stat().st_size
    with open(path, "ab") as f:
        f.write(_record(99, b"k", b"v"))
    with pytest.raises(DistStoreError, match=rf"corrupt at byte {offset}\b.*record type 99"):
        FileStore(str(path), timeout=5)


@pytest.mark.parametrize(
    "tail",
    [
        file_module.RECORD.pack(file_module.OP_SET, 3, 5)[: HEADER - 4],  # a partial header
        _record(file_module.OP_SET, b"abc", b"value")[:-2],  # a whole header, part of the rest
    ],
    ids=["header", "body"],
)
def test_a_torn_tail_is_ignored_then_cut_by_the_next_writer(tmp_path, tail):
    path = tmp_path / "store"
    _store_file(path)
    whole = path.stat().st_size
    with open(path, "ab") as f:  # a writer that died halfway through a record
        f.write(tail)
    store = FileStore(str(path), timeout=5)  # registering is a write: it cuts the tail
    assert path.stat().st_size == whole + HEADER  # the torn bytes gone, its OPEN record added
    assert store.multi_get(["key", "other"]) == [b"value", b"2"]
    store.close()


# -- file mode -----------------------------------------------------------------------------


def test_a_new_file_is_private_and_an_existing_file_keeps_its_mode(tmp_path):
    path = tmp_path / "store"
    FileStore(str(path), timeout=5).close()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600

    shared = tmp_path / "shared"
    shared.touch()
    os.chmod(shared, 0o640)  # a file made shareable on purpose
    store = FileStore(str(shared), timeout=5)
    first = _inode(shared)
    for i in range(8):
        store.set("big", bytes([i]) * MIB)
    assert _inode(shared) != first  # compacted, and the new file has the old one's mode
    assert stat.S_IMODE(shared.stat().st_mode) == 0o640
    store.close()


# -- compaction ----------------------------------------------------------------------------


def test_many_large_sets_keep_the_file_bounded(tmp_path):
    path = tmp_path / "store"
    writer = FileStore(str(path), timeout=10)
    before = FileStore(str(path), timeout=10)  # opened before any compaction
    first = _inode(path)
    largest, replaced = 0, False
    for i in range(200):
        writer.set("big", bytes([i]) * MIB)
        writer.set(f"small{i % 5}", str(i))
        largest = max(largest, path.stat().st_size)
        replaced = replaced or _inode(path) != first  # a freed inode number may come back
        if i == 100:
            assert before.get("big") == bytes([100]) * MIB
    assert largest < 6 * MIB  # 200 MiB were written
    assert replaced
    after = FileStore(str(path), timeout=10)
    smalls = [str(i).encode() for i in range(195, 200)]
    for store in (writer, before, after):
        assert store.get("big") == bytes([199]) * MIB
        assert store.multi_get([f"small{k}" for k in range(5)]) == smalls
        assert store.num_keys() == 6
    before.set("late", b"1")
    assert after.get("late") == b"1" and writer.get("late") == b"1"
    assert sorted(os.listdir(tmp_path)) == ["store"]  # no temporary file left behind
    for store in (writer, before, after):
        store.close()


def test_compaction_keeps_user_accounting_and_cleanup(tmp_path):
    path = tmp_path / "store"
    first = FileStore(str(path), world_size=2, timeout=5)
    second = FileStore(str(path), world_size=2, timeout=5)
    start = _inode(path)
    for i in range(8):
        first.set("big", bytes([i]) * MIB)
    assert _inode(path) != start
    assert (first._state.users, first._state.finished) == (2, 0)
    first.close()
    assert path.exists()
    assert second.get("big") == bytes([7]) * MIB  # replays the compacted file
    assert (second._state.users, second._state.finished) == (1, 1)
    second.close()
    assert not path.exists()


def test_a_failed_compaction_leaves_the_store_working(tmp_path, monkeypatch, caplog):
    path = tmp_path / "store"
    store = FileStore(str(path), timeout=5)
    replaced = []

    def refuse(src, dst):
        replaced.append(src)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(file_module.os, "replace", refuse)
    with caplog.at_level(logging.WARNING, logger="distcomm.store"):
        for i in range(8):
            store.set("big", bytes([i]) * MIB)
    assert replaced and "could not compact" in caplog.text
    assert sorted(os.listdir(tmp_path)) == ["store"]  # its temporary file was removed
    assert len(replaced) == 1  # the next attempt waits until the file has doubled
    assert store.get("big") == bytes([7]) * MIB
    monkeypatch.undo()
    other = FileStore(str(path), timeout=5)
    assert other.get("big") == bytes([7]) * MIB
    other.close()
    store.close()


BIG = 256 * 1024
ROUNDS = 200


def _busy_user(path: str) -> tuple[list[int], int, list[bytes], int]:
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = FileStore(path, world_size=size, timeout=60)
    counts = []
    for i in range(ROUNDS):
        counts.append(store.add("count", 1))
        if i % 10 == 0:  # 20 sets of 256 KiB per rank: the log passes 4 MiB again and again
            store.set(f"big{rank}", bytes([rank]) * BIG + i.to_bytes(4, "little"))
    store.set(f"done{rank}", b"1")
    store.wait([f"done{peer}" for peer in range(size)])
    final = int(store.get("count"))
    bigs = store.multi_get([f"big{peer}" for peer in range(size)])
    length = os.stat(path).st_size
    store.set(f"read{rank}", b"1")
    store.wait([f"read{peer}" for peer in range(size)])  # nobody closes while others look
    store.close()
    return counts, final, [value[:1] + value[-4:] for value in bigs], length


@pytest.mark.timeout(120)
def test_processes_writing_through_compactions_agree(tmp_path):
    path = str(tmp_path / "shared")
    size = 4
    results = run_ranks(_busy_user, size, path, timeout=90)
    counts = sorted(count for result in results for count in result[0])
    assert counts == list(range(1, size * ROUNDS + 1))  # every add saw its own exact total
    last = (ROUNDS - 1) // 10 * 10
    for _, final, bigs, length in results:
        assert final == size * ROUNDS
        assert bigs == [bytes([peer]) + last.to_bytes(4, "little") for peer in range(size)]
        assert length < 6 * MIB  # 20 MiB were written: compaction kept it small
    assert not os.path.exists(path)  # the last of world_size users removed it
    assert os.listdir(tmp_path) == []


# -- large logs and waits ------------------------------------------------------------------


def test_many_appends_give_the_whole_value(tmp_path):
    path = tmp_path / "store"
    writer = FileStore(str(path), timeout=10)
    before = FileStore(str(path), timeout=10)
    chunks = [bytes([i % 251]) * 1024 for i in range(20_000)]
    for chunk in chunks:
        writer.append("log", chunk)
    expected = b"".join(chunks)
    after = FileStore(str(path), timeout=10)
    for store in (writer, before, after):
        assert store.get("log") == expected
        store.close()


def test_wait_on_many_keys_set_in_batches(tmp_path):
    path = str(tmp_path / "store")
    writer = FileStore(path, timeout=10)
    waiter = FileStore(path, timeout=10)
    keys = [f"key{i}" for i in range(5_000)]
    result: list = []
    thread = threading.Thread(target=lambda: result.append(waiter.multi_get(keys)))
    thread.start()
    for start in range(0, len(keys), 1_000):
        batch = keys[start : start + 1_000]
        writer.multi_set(batch, [key.encode() for key in batch])
    thread.join(20)
    assert not thread.is_alive()
    assert result == [[key.encode() for key in keys]]
    writer.close()
    waiter.close()


def test_wait_rechecks_a_key_deleted_after_it_was_seen(tmp_path):
    path = str(tmp_path / "store")
    writer = FileStore(path, timeout=10)
    waiter = FileStore(path, timeout=10)
    result: list = []
    errors: list = []

    def wait() -> None:
        try:
            result.append(waiter.multi_get(["a", "b"]))
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=wait)
    thread.start()
    writer.set("a", b"1")
    thread.join(0.3)  # the waiter sees "a" and goes on waiting for "b"
    writer.delete_key("a")
    writer.set("b", b"2")
    thread.join(0.3)  # it must not return while "a" is missing again
    assert thread.is_alive() and not errors
    writer.set("a", b"3")
    thread.join(10)
    assert not thread.is_alive()
    assert not errors and result == [[b"3", b"2"]]
    writer.close()
    waiter.close()
