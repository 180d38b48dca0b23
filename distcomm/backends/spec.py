"""Which backend serves which device: backend specs, the groups' backends, availability.

`parse_backend` turns `init_process_group(backend=...)` ("gloo", "cpu:gloo,cuda:nccl" or
None for the defaults) into one backend name per device; `create_backends` makes a
group's backends from it (one instance per backend name, CuPy arrays staged for a CPU
backend that asks for it), once `check_same_backends` has made sure that every rank of
the group asked for the same ones. The `is_*_available` queries and torch's
per-device defaults answer from the registry (`distcomm.backends`).
"""

from __future__ import annotations

from typing import Any

from ..deadline import Deadline
from ..gpu import runtime
from ..store import HashStore, PrefixStore, Store
from ..store.ranks import roll_call
from .base import Backend
from .registry import create_backend, get_backend_record
from .staged import StagedBackend

__all__ = [
    "check_same_backends",
    "create_backends",
    "get_default_backend_for_device",
    "is_backend_available",
    "is_gloo_available",
    "is_mpi_available",
    "is_nccl_available",
    "is_ucc_available",
    "is_xccl_available",
    "parse_backend",
    "spec_text",
]


def _default_spec() -> dict[str, str]:
    """Each device's default backend: nccl for CUDA arrays where CuPy, NCCL and a GPU are
    there, else gloo. Nothing here initialises CUDA (`runtime.device_visible`), so a
    process can still fork workers that use it."""
    spec: dict[str, str] = {}
    for device, preferred in (("cpu", ("gloo", "tcp")), ("cuda", ("nccl", "gloo"))):
        for name in preferred:  # built-ins: a plug-in cannot take their names
            record = get_backend_record(name)
            if device in record.devices and not record.availability():
                if name == "nccl" and not runtime.device_visible():
                    continue
                spec[device] = name
                break
    return spec


def parse_backend(backend: str | None) -> dict[str, str]:
    """Map each device to a backend name: "tcp", "cpu:tcp,cuda:nccl", or None (defaults).

    Raises:
        ValueError: an unknown backend or device, or a backend that does not serve a device.
    """
    if backend is None:
        return _default_spec()
    if not isinstance(backend, str) or not backend.strip():
        raise ValueError(f"backend must be a backend name such as 'tcp', got {backend!r}")
    text = backend.strip().lower()
    if ":" not in text:
        return {device: text for device in get_backend_record(text).devices}
    spec: dict[str, str] = {}
    for part in text.split(","):
        device, sep, name = (p.strip() for p in part.partition(":"))
        if not sep or device not in ("cpu", "cuda") or not name:
            raise ValueError(
                f"backend {backend!r}: {part!r} is not 'device:backend' with device cpu or "
                "cuda (example: 'cpu:tcp,cuda:nccl')"
            )
        if device in spec:
            raise ValueError(f"backend {backend!r} names device {device!r} twice")
        record = get_backend_record(name)
        if device not in record.devices:
            raise ValueError(
                f"backend {backend!r}: backend {name!r} does not serve {device} arrays "
                f"(it serves: {', '.join(record.devices)})"
            )
        spec[device] = name
    return spec


def spec_text(spec: dict[str, str]) -> str:
    names = set(spec.values())
    if len(names) == 1:
        return names.pop()
    return ",".join(f"{device}:{name}" for device, name in spec.items())


def create_backends(
    spec: dict[str, str],
    store: Store,
    rank: int,
    size: int,
    timeout: float,
    name: str,
    members: list[int],
    process_store: Store | None = None,
) -> dict[str, Backend]:
    """A group's backends, one per device of `spec`, once every rank of the group has
    asked for the same ones (`check_same_backends`). `process_store`: the job's store
    (`BackendOptions.process_store`).

    Raises:
        ValueError: the ranks asked for different backends.
        DistError: a backend could not be made.
    """
    setup_round = None
    if _shared(store):
        setup_round = check_same_backends(
            store, rank, size, spec, Deadline(timeout), f"[rank {rank}/{size}] group {name!r}"
        )
    backends: dict[str, Backend] = {}
    shared: dict[str, Backend] = {}
    try:
        for device, backend_name in spec.items():
            if backend_name not in shared:
                shared[backend_name] = create_backend(
                    backend_name,
                    PrefixStore(backend_name, store),
                    rank,
                    size,
                    timeout,
                    name,
                    members,
                    process_store,
                    setup_round,
                )
            backend = shared[backend_name]
            if device == "cuda" and backend.stages_device_arrays:
                backend = StagedBackend(backend)  # CuPy arrays through pinned host memory
            backends[device] = backend
    except BaseException:
        for backend in shared.values():
            backend.shutdown()
        raise
    return backends


def _shared(store: Store) -> bool:
    """Whether other processes can see `store`: not a HashStore (MPI.COMM_WORLD's
    rendezvous gives each process one of its own), under any number of prefixes."""
    while isinstance(store, PrefixStore):
        store = store.underlying_store
    return not isinstance(store, HashStore)


def check_same_backends(
    store: Store, rank: int, size: int, spec: dict[str, str], deadline: Deadline, where: str
) -> int:
    """Check that every rank asked for the same backends, before any backend waits for
    its peers: a roll call (`distcomm.store.ranks.roll_call`) of the spec, compared with
    rank 0's device by device (a device one of the two does not serve, CuPy missing on one
    host say, is left out). Each rank numbers its checks on `store`, so a later one (the
    group made again) gets keys of its own; returns the number (the backends key their
    own set-up with it, `BackendOptions.setup_round`).

    Raises:
        ValueError: a device's backend differs between this rank or another and rank 0;
            the message names both.
        DistTimeoutError: some ranks did not come in time; the message names them.
    """

    def differs(host: dict[str, Any]) -> str | None:
        theirs = host.get("backends", {})
        for device, backend in spec.items():
            if theirs.get(device, backend) != backend:
                return (
                    f"rank {rank} asked for backend {spec_text(spec)!r} ({backend!r} for "
                    f"{device} arrays), but rank 0 for {spec_text(theirs)!r} "
                    f"({theirs[device]!r}): pass the same backend to init_process_group "
                    f"(or new_group) on every rank"
                )
        return None

    number = store.add(f"backends/round/{rank}", 1) - 1  # its n-th check here
    base = f"backends/{number}"
    roll_call(
        store,
        base,
        rank,
        size,
        deadline,
        where,
        record={"backends": spec},
        differs=differs,
        arrived="reached the backends' set-up",
        hint="did every rank of the group call init_process_group (or new_group)? "
        "Look at the missing ranks' output for an error",
    )
    return number


def is_backend_available(backend: str) -> bool:
    """Whether backend `backend` is registered and can run here."""
    try:
        return not get_backend_record(backend).availability()
    except ValueError:
        return False


def is_gloo_available() -> bool:
    """Whether the gloo backend can run here."""
    return is_backend_available("gloo")


def is_mpi_available() -> bool:
    """Whether the mpi backend can run here."""
    return is_backend_available("mpi")


def is_nccl_available() -> bool:
    """Whether CuPy and its NCCL library (2.7 or later) are installed, as torch's says
    whether NCCL was built in. It does not look for a GPU, so it does not initialise CUDA
    (a process forked after that cannot use it); `init_process_group("nccl")` reports a
    missing GPU."""
    return is_backend_available("nccl")


#: the backend torch picks by default for each device type
_DEVICE_DEFAULTS = {"cpu": "gloo", "cuda": "nccl"}


def get_default_backend_for_device(device: Any) -> str:
    """The backend torch uses by default for `device` ("cpu", "cuda", "cuda:1", or an
    object with a `type` such as a torch.device): "gloo" or "nccl".

    Raises:
        ValueError: not a device type distcomm knows.
    """
    kind = getattr(device, "type", device)
    name = _DEVICE_DEFAULTS.get(str(kind).split(":")[0])
    if name is None:
        raise ValueError(
            f"get_default_backend_for_device: {device!r} is not a device distcomm serves; "
            f"use one of {', '.join(_DEVICE_DEFAULTS)}"
        )
    return name


def is_ucc_available() -> bool:
    """Whether the UCC backend is available: never (distcomm has no UCC backend)."""
    return False


def is_xccl_available() -> bool:
    """Whether the XCCL backend (Intel GPUs) is available: never (distcomm has none)."""
    return False
