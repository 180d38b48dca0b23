"""The ``file_system`` sharing strategy's shared-memory manager: daemon, client, protocol.

A named segment (``/dev/shm/distcomm_*``) outlives a process that crashes before unlinking
it, so each process tree gets one manager daemon that counts references and unlinks what
nobody holds. The family:

- `protocol`: the line protocol, limits and name checks both sides share;
- `table`: the daemon's reference table (no I/O);
- `manager`: the daemon (its event loop and command line), run as
  ``python -m distcomm.multiprocessing.shm_manager`` (that module is the public path);
- `channel`: one client connection to the daemon (line I/O under a deadline);
- `client`: `ManagerClient`, what a process uses, and `start_manager`.

It re-exports nothing: import the module you need, so that `import
distcomm.multiprocessing` loads only what it uses (`segments` imports the client and the
protocol when the ``file_system`` strategy is first used).
"""

__all__: list[str] = []
