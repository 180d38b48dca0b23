"""torch's ``torch.distributed.rendezvous``: the init-method bootstrap under that name.

`from distcomm.rendezvous import rendezvous, register_rendezvous_handler, ...` works as
it does from torch's module, and the module itself can be called as torch's function
is reached (``dist.rendezvous(url, rank, world_size, **kwargs)``, whose result gives
``(store, rank, world_size)`` to ``next``): in torch, ``torch.distributed.rendezvous``
names the function and the module both, so here the module is callable. The code lives
in `distcomm.bootstrap`, whose names this module re-exports.
"""

import sys
import types
from typing import Any

from .bootstrap import *  # noqa: F403  (every name of distcomm.bootstrap.__all__)
from .bootstrap import __all__  # noqa: F401
from .bootstrap import rendezvous as _rendezvous


class _CallableModule(types.ModuleType):
    """This module, callable as torch's `rendezvous` function."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return _rendezvous(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
