"""`ErrorHandler` under torch's module path (``...multiprocessing.errors.error_handler``).

The implementation lives in `distcomm.launch.error_handler`, which the workers' exception
hook imports without this package (see that module's docstring).
"""

from ..error_handler import ERROR_FILE_ENV, TORCH_ERROR_FILE_ENV, ErrorHandler

__all__ = ["ERROR_FILE_ENV", "TORCH_ERROR_FILE_ENV", "ErrorHandler"]
