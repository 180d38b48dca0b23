"""TCPStore: the store a master process serves over TCP to every process of the job.

- `store`: `TCPStore`, the public class (its constructor and the Store methods);
- `requests`: the request path every TCPStore takes (connect with retries, one exchange,
  the errors it names);
- `connection`: one client socket to the server, under kernel timeouts;
- `master`: how a master gets its server (its own, a shared one, or the launcher's);
- `protocol`: the wire format, commands, statuses and size limits both sides share;
- `server`: the server's event loop and the threat model it stands up to;
- `serving`: the bytes of one server connection (requests in, answers out);
- `state`: the keys, queues and parked requests the server keeps (no I/O);
- `bookkeeping`: the server's record per connection, its timers and its warnings.
"""

from .store import TCPStore

__all__ = ["TCPStore"]
