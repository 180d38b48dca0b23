"""FileStore: a store kept in a locked, append-only file on a (possibly shared) filesystem.

- `store`: `FileStore`, the public class (locking, replay, compaction, the Store methods);
- `records`: the file's format (magic line, checksummed records) and its whole-file lock;
- `state`: what the replayed log says (keys, queues, user counts) and the compacted file.
"""

from .store import FileStore

__all__ = ["FileStore"]
