"""kvcache: llama.cpp's KV-cache manager for Python inference servers."""
import os as _os

__version__ = "0.1.0"

from kvcache._core import (  # noqa: E402
    Batch,
    RecurrentCache,
    RopeParams,
    StateError,
    UBatch,
    dequantize,
    quantize,
    rope_shift,
)

__all__ = [
    "Batch", "RecurrentCache", "RopeParams", "StateError", "UBatch",
    "dequantize", "quantize", "rope_shift", "get_include", "__version__",
]


def get_include() -> str:
    """Directory holding kvcache's C headers (include/) and .pxd files.

    Use it as an include directory when compiling a Cython extension that does
    ``from kvcache._core cimport ...`` or a C extension that includes ``kvc_*.h``."""
    return _os.path.dirname(_os.path.abspath(__file__))
