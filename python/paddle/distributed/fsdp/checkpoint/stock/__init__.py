"""Stock paddle compatibility: ``dist.save_state_dict`` / ``load_state_dict`` as a strict superset of stock.

``dispatch.py`` decides who serves a call (this engine or stock's save; this engine or ``loader.py`` for loads);
``unpickler.py`` reads stock's pickled metadata and ``.distcp`` files without executing code; ``index.py`` turns
stock checkpoints, Hugging Face safetensors directories and ours into one piece index; ``loader.py`` (with
``boxes.py``, ``targets.py``, ``aoa.py``) loads from it. (The shared-directory check is gone: saves commit
through the TCP store and work on node-local disks; the adoption of other tools' files is io/local.py's.)
"""

from .dispatch import classify, load_state_dict, save_state_dict  # noqa: F401
from .errors import (  # noqa: F401
    DirectoryMismatchError,
    StockFormatError,
    StockVersionNotFoundError,
    UnsafePickleError,
)
from .index import PieceIndex, index_fork, index_hf, index_stock  # noqa: F401
from .unpickler import load_distcp, load_stock_metadata  # noqa: F401

__all__ = [
    "save_state_dict",
    "load_state_dict",
    "classify",
    "PieceIndex",
    "index_stock",
    "index_hf",
    "index_fork",
    "load_stock_metadata",
    "load_distcp",
    "UnsafePickleError",
    "StockFormatError",
    "StockVersionNotFoundError",
    "DirectoryMismatchError",
]
