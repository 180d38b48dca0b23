"""`get_error_handler` under torch's module path (``...multiprocessing.errors.handlers``)."""

from ..error_handler import get_error_handler

__all__ = ["get_error_handler"]
