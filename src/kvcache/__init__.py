"""kvcache: llama.cpp's KV-cache manager for Python inference servers.

Read first: README.md (what kvcache is and how to install it), then docs/quickstart.md (a first
cache and one decode step); docs/index.md lists the other pages (buffers, the two semantics, a
server loop, saved states, PyTorch, the command line). They are in the repository,
https://github.com/kvcache/kvcache, under docs/.

The caches:

- UnifiedCache: one table of cells for every layer, llama.cpp's unified cache (UnifiedCache2025,
  mid-2025 llama.cpp's, or UnifiedCache2026, today's: UnifiedCache(semantics=...) makes either);
- ISWACache: a full-attention and a sliding-window cache for models that interleave them
  (ISWACache2025 or ISWACache2026 likewise);
- RecurrentCache: the recurrent states of Mamba and RWKV style models (RecurrentCache2025 or
  RecurrentCache2026 likewise);
- HybridCache: an attention cache and a recurrent memory for models that mix both kinds of
  layers (LFM2, Granite 4, Jamba, Falcon-H1, Nemotron-H, Qwen3-Next), today's llama.cpp's.

Each is driven as llama.cpp drives its own: find_slot(UBatch) for the cells of a ubatch, its
attention mask, store the layers' K/V, commit. Batch splits a batch into ubatches as llama.cpp
does; ModelGeometry, from_gguf and from_transformers_config give a model's cache dimensions.
Every class documents itself (help(kvcache.UnifiedCache)); the command line is ``kvcache --help``.
"""
import os as _os

__version__ = "0.1.0"

from kvcache._core import (  # noqa: E402
    DEFAULT_LAYOUT,
    LAYOUTS,
    MAX_SEQ,
    AttentionIndices,
    Batch,
    Cells,
    RopeParams,
    StateError,
    StreamUpdate,
    UBatch,
    UpdatePlan,
    dequantize,
    quantize,
    rope_shift,
    view_dtype,
)
from kvcache.unified import UnifiedCache, UnifiedCache2025, UnifiedCache2026  # noqa: E402
from kvcache.recurrent import RecurrentCache, RecurrentCache2025, RecurrentCache2026  # noqa: E402
from kvcache.iswa import ISWACache, ISWACache2025, ISWACache2026, SWAWarning  # noqa: E402
from kvcache.hybrid import HybridCache  # noqa: E402
from kvcache.geometry import (  # noqa: E402
    ModelGeometry,
    from_gguf,
    from_transformers_config,
    read_gguf,
    read_transformers_config,
)

__all__ = [
    "DEFAULT_LAYOUT", "LAYOUTS", "MAX_SEQ", "AttentionIndices", "Batch", "Cells", "ISWACache", "RecurrentCache", "RopeParams", "StateError", "SWAWarning", "UBatch",
    "UnifiedCache", "UnifiedCache2025", "UnifiedCache2026", "ISWACache2025", "ISWACache2026", "RecurrentCache2025",
    "RecurrentCache2026",
    "dequantize", "quantize", "rope_shift", "get_include", "__version__",
    "StreamUpdate", "UpdatePlan", "view_dtype", "ModelGeometry", "from_gguf", "read_gguf",
    "from_transformers_config", "read_transformers_config", "HybridCache",
]


def get_include() -> str:
    """Directory holding kvcache's C headers (include/) and .pxd files.

    Use it as an include directory when compiling a Cython extension that does
    ``from kvcache._core cimport ...`` or a C extension that includes ``kvc_*.h``."""
    return _os.path.dirname(_os.path.abspath(__file__))
