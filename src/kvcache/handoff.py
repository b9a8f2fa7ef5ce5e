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

from kvcache._core import SeqExport, SeqImport, _Recurrent

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = ["HybridExport", "HybridImport", "PartsExport", "PartsImport", "SeqExport", "SeqImport", "copy_regions",
           "pair_regions", "split_hybrid", "split_parts"]


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


# --- a hybrid memory (a HybridCache: its attention part, then its recurrent part) ----------------

_HYBRID_MAGIC = b"KVCH"
_HYBRID_VERSION = 1


class HybridExport:
    """A sequence of a HybridCache (``HybridCache.seq_export``): the attention part's export and
    the recurrent part's state of the sequence (``RecurrentCache.state_write(seq_id,
    prefix=False)``: its cell and its R/S rows), framed as one ``header`` (``KVCH``, u32 version
    1, u32 length and the attention part's header, u32 length and the recurrent state). The
    ``regions`` are the attention part's: the recurrent state travels in the header (one state
    per sequence, small next to the K/V of its cells)."""

    def __init__(self, attn: SeqExport, recurrent: bytes) -> None:
        self.attn = attn
        self.recurrent = recurrent
        self.header = _HYBRID_MAGIC + struct.pack("<II", _HYBRID_VERSION, len(attn.header)) + attn.header + \
            struct.pack("<I", len(recurrent)) + recurrent
        self.regions = attn.regions
        self.n_bytes = attn.n_bytes

    def gather(self) -> npt.NDArray[np.uint8]:
        """The attention part's bytes, in order, in one uint8 array (SeqExport.gather)."""
        return self.attn.gather()


def split_hybrid(header: Buffer) -> tuple[bytes, bytes]:
    """The attention part's header and the recurrent state of a HybridExport header; StateError
    when it is not one."""
    from kvcache import StateError

    h = bytes(memoryview(header).cast("B"))
    if len(h) < 12 or h[:4] != _HYBRID_MAGIC:
        raise StateError("not a hybrid memory's hand-off header (magic KVCH)")
    version, n = struct.unpack_from("<II", h, 4)
    if version != _HYBRID_VERSION:
        raise StateError(f"hybrid hand-off header of version {version}; this cache takes version {_HYBRID_VERSION}")
    if len(h) - 12 < n + 4:
        raise StateError(f"hybrid hand-off header truncated in its attention part ({n} bytes, {len(h) - 12} remain)")
    attn = h[12:12 + n]
    (m,) = struct.unpack_from("<I", h, 12 + n)
    rest = h[16 + n:]
    if len(rest) != m:
        raise StateError(f"hybrid hand-off header: the recurrent state says {m} bytes, {len(rest)} follow")
    return attn, rest


class HybridImport:
    """An import into a HybridCache (``HybridCache.seq_import_begin``): the attention part's import
    (its ``regions``), and the recurrent state, checked against the recurrent part when the
    import begins and read into it at ``commit()``, which checks the attention part first: both
    parts or neither. ``abort()`` (or an exception in ``with``) leaves both as they were. Until
    then the HybridCache refuses changes (its attention part is importing)."""

    def __init__(self, attn: SeqImport, recr: _Recurrent, recurrent: bytes) -> None:
        self.attn = attn
        self._recr = recr
        self.recurrent = recurrent
        self.regions = attn.regions
        self.n_bytes = attn.n_bytes
        self.seq_id = attn.seq_id

    @property
    def active(self) -> bool:
        """True until commit() or abort()."""
        return self.attn.active

    def scatter(self, data: Buffer | npt.NDArray[np.uint8]) -> None:
        """Copy data (HybridExport.gather's bytes) into the attention part's regions."""
        self.attn.scatter(data)

    def commit(self) -> None:
        """Check the attention part, read the recurrent state into the sequence, commit the
        attention part. StateError (nothing changed, still active) when either part refuses."""
        self.attn.check()
        self._recr.state_read(self.recurrent, self.seq_id, exact=True, layout="2026")
        self.attn.commit()

    def abort(self) -> None:
        """Abort the attention part's import (the recurrent part was not changed)."""
        self.attn.abort()

    def __enter__(self) -> HybridImport:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> Literal[False]:
        self.abort()
        return False
