"""Key-value stores: the Store interface and its TCP, file, etcd, in-memory and prefix stores."""

from ..errors import QueueEmptyError
from .base import Store
from .file import FileStore
from .hash import HashStore
from .prefix import PrefixStore
from .tcp import TCPStore

__all__ = [
    "EtcdStore",
    "FileStore",
    "HashStore",
    "PrefixStore",
    "QueueEmptyError",
    "Store",
    "TCPStore",
]


def __getattr__(name: str) -> object:
    if name == "EtcdStore":  # its HTTP client's imports cost ~40 ms: only when used
        from .etcd import EtcdStore

        return EtcdStore
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
