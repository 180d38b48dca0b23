"""Key-value stores: the Store interface and its TCP, file, in-memory and prefix stores."""

from .base import Store
from .file import FileStore
from .hash import HashStore
from .prefix import PrefixStore
from .tcp import TCPStore

__all__ = ["FileStore", "HashStore", "PrefixStore", "Store", "TCPStore"]
