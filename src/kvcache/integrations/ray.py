"""Handing a sequence of a UnifiedCache between Ray actors through Ray's object store.

The sender gathers the sequence's K/V bytes into one uint8 array (``export_sequence``) and returns
it, with the header, from an actor method (or ``ray.put`` s it): Ray stores a numpy array
out of band, and ``ray.get`` on the same node returns a read-only view of the shared memory,
which ``import_sequence`` scatters straight into the cells the receiving cache reserved. Ray
itself is only needed by ``put_sequence``. See docs/disaggregated.md.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from kvcache.handoff import _unified_cache
from kvcache.unified import UnifiedCache

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = ["export_sequence", "import_sequence", "put_sequence"]


def export_sequence(cache: UnifiedCache, seq_id: int) -> tuple[bytes, npt.NDArray[np.uint8]]:
    """The header of sequence seq_id and its K/V bytes as one uint8 array (empty for a cache
    without K/V memory): the two objects to hand to Ray."""
    _unified_cache(cache, "export_sequence")
    exp = cache.seq_export(seq_id)
    return exp.header, exp.gather()


def import_sequence(cache: UnifiedCache, header: Buffer, data: Buffer | npt.NDArray[Any], seq_id: int | None = None) -> int:
    """Restore a sequence from export_sequence's header and data (any C-contiguous buffer, the
    read-only view ray.get returns included) into seq_id (None: the sender's id), exactly as
    state_read would; on any failure the cache is left as it was. Returns the cells placed."""
    _unified_cache(cache, "import_sequence")
    with cache.seq_import_begin(header, seq_id) as imp:
        n = imp.n_cells
        imp.scatter(data)
        imp.commit()
    return n


def put_sequence(cache: UnifiedCache, seq_id: int) -> tuple[bytes, Any]:
    """export_sequence, with the data put into the object store: (header, ObjectRef)."""
    ray: Any = importlib.import_module("ray")   # optional: imported when used
    header, data = export_sequence(cache, seq_id)
    return header, ray.put(data)
