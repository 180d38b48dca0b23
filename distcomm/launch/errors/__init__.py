"""Worker failures: `@record`, the error file it writes, and the agent's failure report.

Laid out as torch's ``torch.distributed.elastic.multiprocessing.errors``: `record`,
`ProcessFailure` and `ChildFailedError` here (from `api.py`, which takes `ProcessFailure`
from `failure.py`), `ErrorHandler` in
`error_handler.py` and `get_error_handler` in `handlers.py`, so a port changes only the
package prefix of its imports. The report's placeholder texts (`NO_TRACEBACK`,
`NOT_KEPT`, ...) are importable from here too, outside `__all__`.
"""

from .api import NO_RECORDED_TRACEBACK as NO_RECORDED_TRACEBACK
from .api import NO_TRACEBACK as NO_TRACEBACK
from .api import NOT_AVAILABLE as NOT_AVAILABLE
from .api import NOT_KEPT as NOT_KEPT
from .api import ChildFailedError, ProcessFailure, exit_description, record
from .error_handler import ERROR_FILE_ENV, TORCH_ERROR_FILE_ENV, ErrorHandler
from .handlers import get_error_handler

__all__ = [
    "ERROR_FILE_ENV",
    "TORCH_ERROR_FILE_ENV",
    "ChildFailedError",
    "ErrorHandler",
    "ProcessFailure",
    "exit_description",
    "get_error_handler",
    "record",
]
