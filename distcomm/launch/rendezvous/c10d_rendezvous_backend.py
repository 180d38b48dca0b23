"""torch's c10d rendezvous backend (`torch.distributed.elastic.rendezvous.c10d_rendezvous_backend`):
`C10dRendezvousBackend` keeps the state under ``torch.rendezvous.<run_id>`` of a TCPStore or
FileStore, and `create_backend(params)` makes both.

`--rdzv_backend=c10d` does not go through here: its handler keeps the state in its store
directly (`backends.create_c10d_handler`). This module is for code written against torch's
API: ``create_handler(store, *create_backend(params)[::-1], params)`` forms the same rounds,
the state going through this backend (one compare_set per write, by the chair alone).
"""

from __future__ import annotations

import os
import tempfile

from ...store import FileStore, Store
from ..wording import given, torch_message
from .api import RendezvousConnectionError, RendezvousError, RendezvousParameters
from .backends import C10D_FAILED, DEFAULT_C10D_PORT, create_c10d_store
from .settings import RendezvousSettings
from .store_backend import StoreStateBackend

__all__ = ["DEFAULT_PORT", "C10dRendezvousBackend", "create_backend"]

#: the port of an endpoint given without one (torch's)
DEFAULT_PORT = DEFAULT_C10D_PORT


class C10dRendezvousBackend(StoreStateBackend):
    """The state of run `run_id` in `store`, under ``torch.rendezvous.<run_id>`` (torch's
    C10dRendezvousBackend; name "c10d").

    Raises:
        ValueError: `run_id` is empty (torch's sentence, then the argument).
        TypeError: `store` is not a distcomm Store.
    """

    def __init__(self, store: Store, run_id: str) -> None:
        if not run_id or not isinstance(run_id, str):
            raise ValueError(
                torch_message(
                    "The run id must be a non-empty string.",
                    given("run_id", run_id),
                    "give every node of the run the same non-empty id",
                )
            )
        super().__init__(store, f"torch.rendezvous.{run_id}", "c10d", "the C10d store")


def _read_timeout(params: RendezvousParameters) -> int:
    value = params.get_as_int("read_timeout", 60)
    if value is None or value <= 0:
        raise ValueError(
            torch_message(
                "The read timeout must be a positive integer.",
                given("read_timeout", params.get("read_timeout"), params.from_flags),
                "give a whole number of seconds > 0 (default 60)",
            )
        )
    return value


def _file_store(params: RendezvousParameters) -> FileStore:
    path = (params.endpoint or "").strip()
    if not path:
        try:
            fd, path = tempfile.mkstemp()
            os.close(fd)
        except OSError as exc:
            raise RendezvousError(
                torch_message(
                    "The file creation for C10d store has failed. See inner exception for details.",
                    given("endpoint", params.endpoint, params.from_flags),
                    f"no temporary file could be made ({exc}): give the path of a file "
                    "every node shares",
                )
            ) from exc
    try:
        return FileStore(path, world_size=-1)
    except Exception as exc:
        raise RendezvousConnectionError(
            torch_message(
                C10D_FAILED,
                given("endpoint", params.endpoint, params.from_flags),
                f"cannot use {path!r} as a FileStore: {exc}",
            )
        ) from exc


def create_backend(params: RendezvousParameters) -> tuple[C10dRendezvousBackend, Store]:
    """A C10dRendezvousBackend and its store for `params` (torch's `create_backend`).

    Options: ``store_type`` (tcp, the default, or file: a FileStore at the endpoint's path,
    a temporary file when it is empty), ``read_timeout`` (seconds, default 60), ``is_host``
    (host the TCPStore here; default: when the endpoint names this machine). Other keys
    are left for the handler.

    Raises:
        ValueError: an invalid store type, read timeout or endpoint.
        RendezvousConnectionError: the store can be neither hosted nor reached, or this
            agent should host it for an endpoint whose host does not resolve.
        RendezvousError: the temporary file cannot be created.

    Each with torch's sentence, then the parameter and what to do.
    """
    store_type = str(params.get("store_type", "tcp")).strip().lower()
    if store_type not in ("tcp", "file"):
        raise ValueError(
            torch_message(
                "Invalid store type given. Currently only supports file and tcp.",
                given("store_type", params.get("store_type"), params.from_flags),
                "give store_type=tcp (the default) or store_type=file",
            )
        )
    read_timeout = _read_timeout(params)
    if store_type == "file":
        store: Store = _file_store(params)
    else:
        settings = RendezvousSettings(
            read_timeout=float(read_timeout), is_host=params.get_as_bool("is_host")
        )
        store, _, _ = create_c10d_store(params, settings)
    try:
        return C10dRendezvousBackend(store, params.run_id), store
    except BaseException:
        store.close()
        raise
