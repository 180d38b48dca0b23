"""The tcp backend between two hosts against a raw Python socket stream between the same.

The hosts are network namespaces joined by a bridge (`tests/netns.py`: addresses that
exist only inside them; everything is removed afterwards), so the run needs root and
`ip netns`. For each size, one process on each host (rank 0 on host 0, rank 1 on host 1)
times, in turns within every repeat, so that a slow moment of the machine hits all alike:

- raw: rank 1 streams `--iters` messages of the size over one plain TCP connection
  (`TCP_NODELAY`, as the tcp backend's) with `socket.sendall`; rank 0 receives them
  with `recv_into` into one preallocated buffer.
- send/recv: rank 1 `dist.send`s the same messages to rank 0, which `dist.recv`s them
  into one array (`tcp` backend).
- broadcast: rank 1 broadcasts them to rank 0 (at two ranks, one message from rank 1
  to rank 0 and the signature check the other way).

Each figure is rank 0's bytes received over its time from the first to the last message
(after `--warmup` messages that are not counted), in GB/s, best of `--repeat`; the last
columns are distcomm's share of the raw stream.

Examples::

    sudo python benchmarks/hosts.py                       # 1 MiB and 16 MiB
    sudo python benchmarks/hosts.py --sizes 64K,16M --iters 20 --repeat 5
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PORT_DIST, PORT_RAW = 29611, 29612
#: seconds a worker may take (start-up included) before the run is called failed
WORKER_TIMEOUT = 300


def _size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper()
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def _report(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


# -- the worker (one per host, inside its namespace) --------------------------------------------


def _connect_raw(args: argparse.Namespace) -> socket.socket:
    """The raw stream's connection: host 1 connects to host 0 (`TCP_NODELAY`, as the tcp
    backend's connections)."""
    if args.rank == 0:
        with socket.create_server((args.address, PORT_RAW)) as server:
            server.settimeout(WORKER_TIMEOUT)
            conn, _ = server.accept()
    else:
        deadline = time.monotonic() + WORKER_TIMEOUT
        while True:
            try:
                conn = socket.create_connection((args.address, PORT_RAW), timeout=5)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    conn.settimeout(WORKER_TIMEOUT)
    return conn


def _raw_stream(conn: socket.socket, view: memoryview, rank: int, messages: int) -> None:
    size = len(view)
    if rank == 1:
        for _ in range(messages):
            conn.sendall(view)
        return
    for _ in range(messages):
        got = 0
        while got < size:
            n = conn.recv_into(view[got:], size - got)
            if not n:
                raise ConnectionError("the sender closed the stream early")
            got += n


def _worker(args: argparse.Namespace) -> None:
    import numpy as np

    import distcomm as dist

    dist.init_process_group(
        "tcp",
        init_method=f"tcp://{args.address}:{PORT_DIST}",
        rank=args.rank,
        world_size=2,
    )
    conn = _connect_raw(args)
    array = np.ones(args.size // 4, np.float32)
    view = memoryview(array).cast("B")
    size = array.nbytes

    def run(what: str, messages: int) -> None:
        if what == "raw":
            _raw_stream(conn, view, args.rank, messages)
            return
        for _ in range(messages):
            if what == "broadcast":
                dist.broadcast(array, src=1)
            elif args.rank == 1:
                dist.send(array, dst=0)
            else:
                dist.recv(array, src=1)

    # the kinds take turns in every repeat, so a slower moment of the machine hits
    # each of them alike
    for _ in range(args.repeat):
        for what in ("raw", "send/recv", "broadcast"):
            dist.barrier()
            run(what, args.warmup)
            started = time.perf_counter()
            run(what, args.iters)
            seconds = time.perf_counter() - started
            if args.rank == 0:
                _report(what=what, size=size, gbps=size * args.iters / seconds / 1e9)
    dist.barrier()
    conn.close()
    dist.destroy_process_group()


# -- the driver ---------------------------------------------------------------------------------


def _run_pair(cluster: object, args: argparse.Namespace, size: int) -> list[dict]:
    hosts = cluster.hosts  # type: ignore[attr-defined]
    # the bridge's addresses are reachable from the other namespace: a key, as a real job sets
    env = {
        **os.environ,
        "DISTCOMM_SOCKET_IFNAME": "eth0",
        "DISTCOMM_AUTH_KEY": "hosts-benchmark",
        "PYTHONPATH": str(ROOT),
    }
    procs = []
    for rank in (0, 1):
        command = [
            sys.executable,
            __file__,
            "--worker",
            "--rank",
            str(rank),
            "--address",
            hosts[0].address,
            "--size",
            str(size),
            "--iters",
            str(args.iters),
            "--warmup",
            str(args.warmup),
            "--repeat",
            str(args.repeat),
        ]
        procs.append(hosts[rank].popen(command, env=env, stdout=subprocess.PIPE, text=True))
    outputs = [proc.communicate(timeout=WORKER_TIMEOUT)[0] for proc in procs]
    for rank, proc in enumerate(procs):
        if proc.returncode != 0:
            raise RuntimeError(f"rank {rank} exited with {proc.returncode}")
    return [json.loads(line) for line in outputs[0].splitlines() if line.startswith("{")]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1M,16M", help="message sizes (default 1M,16M)")
    parser.add_argument("--iters", type=int, default=10, help="timed messages per repeat")
    parser.add_argument("--warmup", type=int, default=2, help="messages before the timing")
    parser.add_argument("--repeat", type=int, default=3, help="repeats; the best is kept")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--address", help=argparse.SUPPRESS)
    parser.add_argument("--size", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args)
        return 0

    sys.path.insert(0, str(ROOT))
    from tests import netns

    why = netns.unavailable()
    if why:
        print(f"hosts.py needs network namespaces: {why}", file=sys.stderr)
        return 2
    sizes = [_size(s) for s in args.sizes.split(",")]
    rows = []
    with netns.Cluster(2) as cluster:
        for size in sizes:
            best: dict[str, float] = {}
            for record in _run_pair(cluster, args, size):
                best[record["what"]] = max(best.get(record["what"], 0.0), record["gbps"])
            rows.append((size, best))
    print(
        f"# tcp between two namespace hosts (veth + bridge), best of {args.repeat} x "
        f"{args.iters} messages, GB/s at the receiver"
    )
    print("| size | raw socket | send/recv | broadcast | send/recv / raw | broadcast / raw |")
    print("|---|---|---|---|---|---|")
    for size, best in rows:
        raw = best["raw"]
        print(
            f"| {size >> 10} KiB | {raw:.2f} | {best['send/recv']:.2f} | "
            f"{best['broadcast']:.2f} | {best['send/recv'] / raw:.2f} | "
            f"{best['broadcast'] / raw:.2f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
