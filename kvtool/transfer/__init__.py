"""Moving KV pages: one interface (batches of page copies), several backends.

`torch` is always there (the CPU path and the reference); `kernel`, `staged`, `memcpy` and
`batch` need CUDA and PyCUDA, and are imported only when asked for.
"""

from kvtool.transfer.api import CopyOp, PageSpace, TransferBackend
from kvtool.transfer.registry import available_backends, get_backend

__all__ = ["CopyOp", "PageSpace", "TransferBackend", "available_backends", "get_backend"]
