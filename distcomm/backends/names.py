"""Backend names as torch has them: `distcomm.Backend`, a string type, and `BackendConfig`.

`Backend("GLOO") == "gloo"`, `Backend.NCCL`, `Backend.backend_list`,
`Backend.register_backend(...)`, as `torch.distributed.Backend`. The class a backend
implementation subclasses is another one: `distcomm.backends.Backend` (in base.py).
Both public names stay as torch has them; inside the package `Backend` means the
plug-in base class, and this name type is spelled `BackendName`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar

__all__ = ["Backend", "BackendConfig"]


class Backend(str):
    """A backend's name, lower case (torch.distributed.Backend).

    `Backend(name)` returns the name in lower case; the built-in ones are also attributes
    (`Backend.GLOO == "gloo"`). UCC and XCCL are torch's names, kept so that comparisons
    in ported code work; distcomm has no such backends.
    """

    UNDEFINED = "undefined"
    TCP = "tcp"
    GLOO = "gloo"
    NCCL = "nccl"
    MPI = "mpi"
    UCC = "ucc"
    XCCL = "xccl"

    #: every backend name init_process_group accepts, and "undefined"
    backend_list: ClassVar[list[str]] = [UNDEFINED, TCP, GLOO, NCCL, MPI]
    #: the backend a device type uses when init_process_group is given none
    default_device_backend_map: ClassVar[dict[str, str]] = {"cpu": GLOO, "cuda": NCCL}
    #: the device types each backend serves
    backend_capability: ClassVar[dict[str, list[str]]] = {
        TCP: ["cpu"],
        GLOO: ["cpu", "cuda"],
        NCCL: ["cuda"],
        MPI: ["cpu", "cuda"],
    }

    def __new__(cls, name: str) -> Backend:  # type: ignore[misc] - torch returns a str
        if not isinstance(name, str):
            raise ValueError(f"Backend: a backend name is a string such as 'gloo', got {name!r}")
        value = getattr(Backend, name.upper(), None)
        return value if isinstance(value, str) else name.lower()  # type: ignore[return-value]

    @classmethod
    def register_backend(
        cls,
        name: str,
        func: Callable[..., Any],
        extended_api: bool = False,
        devices: str | Sequence[str] | None = None,
    ) -> None:
        """Register a third-party backend under `name` (see
        `distcomm.backends.register_backend`): `func(store, rank, size, timeout)` returns a
        `distcomm.backends.Backend` subclass instance; `devices` "cpu", "cuda" or both."""
        from .registry import register_backend

        register_backend(name, func, extended_api, devices)
        lower = name.lower()
        if not hasattr(Backend, name.upper()):
            setattr(Backend, name.upper(), lower)
        if lower not in Backend.backend_list:
            Backend.backend_list.append(lower)
        served = [devices] if isinstance(devices, str) else list(devices or ("cpu", "cuda"))
        Backend.backend_capability[lower] = served
        for device in served:
            Backend.default_device_backend_map.setdefault(device, lower)


#: the name type under the name the package uses for it, so that it is never mistaken
#: for the plug-in base class `distcomm.backends.Backend`
BackendName = Backend


class BackendConfig:
    """The backend of each device type (torch.distributed.distributed_c10d.BackendConfig):
    `BackendConfig("gloo")`, `BackendConfig("cpu:gloo,cuda:nccl")`; `str()` gives the
    "device:backend,..." form `get_backend_config` returns."""

    def __init__(self, backend: str) -> None:
        from .spec import parse_backend

        text = str(backend)
        spec = parse_backend(None if text == Backend.UNDEFINED else text)
        self.device_backend_map = {device: BackendName(name) for device, name in spec.items()}

    def get_device_backend_map(self) -> dict[str, BackendName]:
        """{device type: backend name}."""
        return dict(self.device_backend_map)

    def __repr__(self) -> str:
        return ",".join(f"{device}:{name}" for device, name in self.device_backend_map.items())
