"""The init-method bootstrap under its historical name: re-exports `distcomm.bootstrap`.

`from distcomm.rendezvous import rendezvous, detect_environment, ...` keeps working, and
`register_rendezvous_handler` stands where torch keeps it
(``torch.distributed.rendezvous``). The code lives in `distcomm.bootstrap`.
"""

from .bootstrap import *  # noqa: F403  (every name of distcomm.bootstrap.__all__)
from .bootstrap import __all__  # noqa: F401
