"""Key-value stores: the Store interface and its TCP, file, etcd, in-memory and prefix stores."""

from ..errors import QueueEmptyError
from .base import Store
from .etcd import EtcdStore
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
