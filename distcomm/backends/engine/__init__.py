"""The CPU engine behind the `tcp` and `gloo` backends: everything below their op set.

The front doors (`backends/tcp.py`, `backends/gloo.py`) hold the op set a user's call
reaches; they validate, build a `protocol.Signature` and hand the collective to this
engine, which does the rest:

- `runner.Runner`: sequence numbers, issue order, `Work`, failure fan-out;
- `paths`: the way a group's collectives travel (`TcpPath`, `HierPath`), chosen once;
- `algorithms`: the message-passing algorithms (rings, trees, halving-doubling) and the
  `tuning` table that picks one by size and world size;
- `protocol`: signatures, headers, failures (the nccl backend borrows its signature check);
- `scratch`: reusable buffers;
- `transport/`: the TCP fabric (one I/O thread and one connection per peer process);
- `shm/`: collectives in shared memory among the ranks of one host.

Nothing here imports a front door; the registry (`distcomm.backends`) never imports this
package until a tcp or gloo group is made. Import the modules themselves: this package
re-exports nothing, so that borrowing `protocol` does not load the transport.
"""

__all__: list[str] = []
