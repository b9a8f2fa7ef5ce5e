"""Handing a sequence of a :class:`~kvcache.UnifiedCache` to another process without serialising it.

The exporter's ``cache.seq_export(seq_id)`` gives a small header and the regions of the sequence's
K/V bytes inside its buffers; the receiver's ``cache.seq_import_begin(header)`` checks the header,
reserves cells and gives the regions to write into; a transfer library (NIXL, Ray's object store,
anything that moves bytes between addresses) moves them; ``commit()`` makes the sequence visible.
Both region lists enumerate the same bytes in the same order, split where either side's cells are
not adjacent: :func:`pair_regions` splits them at the same places. See docs/disaggregated.md.
"""
from __future__ import annotations

import ctypes

import numpy as np
import numpy.typing as npt

from kvcache._core import SeqExport, SeqImport

__all__ = ["SeqExport", "SeqImport", "copy_regions", "pair_regions"]


def _regions(r: object, name: str) -> npt.NDArray[np.uint64]:
    a = np.asarray(r)
    if a.ndim != 2 or a.shape[1] != 2 or a.dtype != np.uint64:
        raise ValueError(f"{name} must be an (N, 2) uint64 array of (address, length), not {a.dtype} {a.shape}")
    return a


def pair_regions(src: object, dst: object) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.uint64]]:
    """Split two region lists over the same bytes (an export's and an import's) at the union of
    their boundaries: returns (src', dst') of equal length where region k of one has the length
    of region k of the other (empty regions dropped). ValueError when the totals differ."""
    a, b = _regions(src, "src"), _regions(dst, "dst")
    ea, eb = np.cumsum(a[:, 1], dtype=np.uint64), np.cumsum(b[:, 1], dtype=np.uint64)
    ta = int(ea[-1]) if len(ea) else 0
    tb = int(eb[-1]) if len(eb) else 0
    if ta != tb:
        raise ValueError(f"the regions hold {ta} and {tb} bytes: not the same sequence")
    ends = np.union1d(ea, eb)
    ends = ends[ends > 0]
    if len(ends) == 0:
        return np.empty((0, 2), dtype=np.uint64), np.empty((0, 2), dtype=np.uint64)
    starts = np.concatenate([np.zeros(1, dtype=np.uint64), ends[:-1]])
    lengths = ends - starts
    out = []
    for regs, e in ((a, ea), (b, eb)):
        i = np.searchsorted(e, starts, side="right")
        offset = starts - (e[i] - regs[i, 1])
        out.append(np.stack([regs[i, 0] + offset, lengths], axis=1))
    return out[0], out[1]


def copy_regions(src: object, dst: object) -> int:
    """Copy the bytes of region list src into region list dst in this process (plain memcpy of
    each paired region; the two lists as :func:`pair_regions` takes them). Returns the bytes
    copied. Both must be live memory: an export's and an import's regions."""
    a, b = pair_regions(src, dst)
    for (sa, n), (da, _) in zip(a.tolist(), b.tolist()):
        ctypes.memmove(da, sa, n)
    return int(a[:, 1].sum()) if len(a) else 0
