"""The worker side of `elastic_launch` with a function: load it, call it, keep its result.

Run as ``python -m distcomm.launch._entrypoint PAYLOAD RESULTS_DIR``. PAYLOAD holds two
pickles: multiprocessing's preparation data of the launching process (so that a function
defined in its ``__main__`` is found, as with the spawn start method), then the function
and its arguments. The return value is pickled to ``RESULTS_DIR/<RANK>.pkl``. Failures
(loading, calling, pickling the result) go to the error file through `record`.
"""

from __future__ import annotations

import multiprocessing.spawn
import os
import pickle
import string
import sys
from typing import Any

from .errors import record

__all__ = ["main"]


def _local_rank() -> int:
    """The real local rank (LOCAL_RANK is 0 for all with --virtual-local-rank)."""
    rank, group = int(os.environ["RANK"]), int(os.environ.get("GROUP_RANK", "0"))
    return rank - group * int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def _run(payload: str, results: str) -> None:
    with open(payload, "rb") as fp:
        preparation = pickle.load(fp)
        if preparation:
            multiprocessing.spawn.prepare(preparation)
        fn, args = pickle.load(fp)
    local = str(_local_rank())
    args = [  # torch's ${local_rank} macro
        string.Template(arg).safe_substitute(local_rank=local) if isinstance(arg, str) else arg
        for arg in args
    ]
    value: Any = fn(*args)
    path = os.path.join(results, f"{os.environ['RANK']}.pkl")
    try:
        data = pickle.dumps(value)
    except Exception as exc:
        raise TypeError(
            f"the entrypoint {getattr(fn, '__qualname__', fn)!r} returned a "
            f"{type(value).__name__}, which cannot be pickled back to the launcher: {exc}"
        ) from exc
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "wb") as fp:
        fp.write(data)
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> None:
    """Run the pickled function of PAYLOAD; its result goes to RESULTS_DIR."""
    payload, results = (sys.argv[1:] if argv is None else argv)[:2]
    record(_run)(payload, results)


if __name__ == "__main__":
    main()
