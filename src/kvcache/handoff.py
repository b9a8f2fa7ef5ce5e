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
import struct
from typing import TYPE_CHECKING, Literal

import numpy as np
import numpy.typing as npt

from kvcache._core import SeqExport, SeqImport

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = ["PartsExport", "PartsImport", "SeqExport", "SeqImport", "copy_regions", "pair_regions", "split_parts"]


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


# --- caches of several parts (an ISWACache: its base cache, then its SWA cache) -----------------

_PARTS_MAGIC = b"KVCP"
_PARTS_VERSION = 1


class PartsExport:
    """A sequence of a cache made of unified parts (``ISWACache.seq_export``): each part's
    export, framed as one ``header`` (``KVCP``, u32 version 1, u32 parts, then per part u32
    length and that part's header), and the parts' ``regions`` one after the other."""

    def __init__(self, parts: list[SeqExport]) -> None:
        self.parts = parts
        self.header = _PARTS_MAGIC + struct.pack("<II", _PARTS_VERSION, len(parts)) + b"".join(
            struct.pack("<I", len(p.header)) + p.header for p in parts)
        self.regions = np.concatenate([p.regions for p in parts]) if parts else np.empty((0, 2), np.uint64)
        self.regions.flags.writeable = False
        self.n_bytes = sum(p.n_bytes for p in parts)

    def gather(self) -> npt.NDArray[np.uint8]:
        """The parts' bytes, in order, in one uint8 array."""
        return np.concatenate([p.gather() for p in self.parts]) if self.parts else np.empty(0, np.uint8)


def split_parts(header: Buffer, n_parts: int) -> list[bytes]:
    """The part headers of a PartsExport header; StateError when it is not one of n_parts parts."""
    from kvcache import StateError

    h = bytes(memoryview(header).cast("B"))
    if len(h) < 12 or h[:4] != _PARTS_MAGIC:
        raise StateError("not a hand-off header of several parts (magic KVCP)")
    version, n = struct.unpack_from("<II", h, 4)
    if version != _PARTS_VERSION or n != n_parts:
        raise StateError(f"hand-off header of version {version} with {n} parts; this cache takes version "
                         f"{_PARTS_VERSION} with {n_parts}")
    out, off = [], 12
    for k in range(n):
        if len(h) - off < 4:
            raise StateError(f"hand-off header truncated at part {k}")
        (m,) = struct.unpack_from("<I", h, off)
        if len(h) - off - 4 < m:
            raise StateError(f"hand-off header truncated in part {k}")
        out.append(h[off + 4:off + 4 + m])
        off += 4 + m
    if off != len(h):
        raise StateError(f"{len(h) - off} trailing bytes after the hand-off header")
    return out


class PartsImport:
    """An import into a cache of several parts (``ISWACache.seq_import_begin``): every part's
    import begun (or none), ``regions`` one part after the other, ``commit()`` checks every part
    before committing any, ``abort()`` (or an exception in ``with``) aborts them all."""

    def __init__(self, parts: list[SeqImport]) -> None:
        self.parts = parts
        self.regions = np.concatenate([p.regions for p in parts]) if parts else np.empty((0, 2), np.uint64)
        self.regions.flags.writeable = False
        self.n_bytes = sum(p.n_bytes for p in parts)

    @property
    def active(self) -> bool:
        """True until commit() or abort()."""
        return any(p.active for p in self.parts)

    def scatter(self, data: Buffer | npt.NDArray[np.uint8]) -> None:
        """Copy data (the parts' bytes in order, as PartsExport.gather gives them) into the regions."""
        if isinstance(data, np.ndarray):
            a = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
        else:
            a = np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8)
        if a.nbytes != self.n_bytes:
            raise ValueError(f"data holds {a.nbytes} bytes, the sequence's K/V {self.n_bytes}")
        off = 0
        for p in self.parts:
            p.scatter(a[off:off + p.n_bytes])
            off += p.n_bytes

    def commit(self) -> None:
        """Check every part, then commit them all: all or nothing."""
        for p in self.parts:
            p.check()
        for p in self.parts:
            p.commit()

    def abort(self) -> None:
        """Abort every part that is still active."""
        for p in self.parts:
            p.abort()

    def __enter__(self) -> PartsImport:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> Literal[False]:
        self.abort()
        return False
