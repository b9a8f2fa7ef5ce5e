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

from kvcache._core import SeqExport, SeqImport, _Recurrent2026

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = ["HybridExport", "HybridImport", "PartsExport", "PartsImport", "SeqExport", "SeqImport", "copy_regions",
           "pair_regions", "split_hybrid", "split_parts"]


def _regions(r: object, name: str) -> npt.NDArray[np.uint64]:
    a = np.asarray(r)
    if a.ndim != 2 or a.shape[1] != 2 or a.dtype != np.uint64:
        raise ValueError(f"{name} must be an (N, 2) uint64 array of (address, length), not {a.dtype} {a.shape}")
    return a


def _unified_cache(cache: object, what: str) -> None:
    """TypeError unless cache is a UnifiedCache (what the single-cache helpers take)."""
    from kvcache.unified import UnifiedCache

    if not isinstance(cache, UnifiedCache):
        raise TypeError(f"{what}: cache must be a UnifiedCache, not {type(cache).__name__} (an ISWACache's parts, "
                        f"cache.base and cache.swa, move one by one)")


def pair_regions(src: object, dst: object) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.uint64]]:
    """Split two region lists over the same bytes (an export's and an import's) at the union of
    their boundaries: returns (src', dst') of equal length where region k of one has the length
    of region k of the other (empty regions dropped). ValueError when the totals differ."""
    a, b = _regions(src, "src"), _regions(dst, "dst")
    ea, eb = np.cumsum(a[:, 1], dtype=np.uint64), np.cumsum(b[:, 1], dtype=np.uint64)
    for name, e in (("src", ea), ("dst", eb)):
        if len(e) > 1 and bool(np.any(e[1:] < e[:-1])):    # a sum of u64 lengths that wrapped
            raise ValueError(f"the lengths of {name}'s regions add up to 2**64 bytes or more")
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


def _scatter_bytes(data: Buffer | npt.NDArray[np.uint8], n_bytes: int, whose: str) -> npt.NDArray[np.uint8]:
    """data (a C-contiguous buffer: bytes-like or an array) as flat uint8, without a copy, as
    SeqImport.scatter takes it; ValueError unless it holds n_bytes (whose: what holds that many,
    for the message)."""
    contiguous = data.flags.c_contiguous if isinstance(data, np.ndarray) else memoryview(data).c_contiguous
    if not contiguous:          # (as SeqImport.scatter refuses it: not copied in another order)
        raise ValueError("data must be a C-contiguous buffer")
    if isinstance(data, np.ndarray):
        a = data.reshape(-1).view(np.uint8)
    else:
        a = np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8)
    if a.nbytes != n_bytes:
        raise ValueError(f"data holds {a.nbytes} bytes, {whose} {n_bytes}")
    return a


def split_parts(header: Buffer, n_parts: int) -> list[bytes]:
    """The part headers of a PartsExport header; StateError when it is not one of n_parts parts."""
    from kvcache._core import StateError

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

    @property
    def seq_id(self) -> int:
        """The destination sequence."""
        return self.parts[0].seq_id

    def check(self) -> None:
        """Check every part (SeqImport.check): StateError, nothing changed, when one would fail."""
        for p in self.parts:
            p.check()

    def scatter(self, data: Buffer | npt.NDArray[np.uint8]) -> None:
        """Copy data (the parts' bytes in order, as PartsExport.gather gives them) into the regions."""
        a = _scatter_bytes(data, self.n_bytes, "the sequence's K/V")
        off = 0
        for p in self.parts:
            p.scatter(a[off:off + p.n_bytes])
            off += p.n_bytes

    def commit(self) -> None:
        """Check every part, then commit them all: all or nothing."""
        self.check()
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
_HYBRID_VERSION = 2
_HYBRID_ROWS_MEMORY = 1     # flags: the recurrent rows are regions of the source's memory


class HybridExport:
    """A sequence of a HybridCache (``HybridCache.seq_export``): the attention part's export and
    the recurrent part's state of the sequence (``RecurrentCache.state_write(seq_id,
    prefix=False)``: its cell and its R/S rows), the rows moved as regions like the K/V rows.

    ``header``: ``KVCH``, u32 version 2, u32 length and the attention part's header, u32 length
    and the recurrent state without its rows, u32 flags (bit 0: the rows are regions), u32 rows,
    then per row u64 offset in the recurrent state and u64 length. ``regions``: the attention
    part's, then the recurrent rows' (each layer's R row, then each layer's S row, in the plane
    the state is written from; none when the source has no memory: the rows are zeros then)."""

    def __init__(self, attn: SeqExport | PartsExport, skeleton: bytes, offsets: list[int],
                 rows: npt.NDArray[np.uint64]) -> None:
        self.attn = attn
        self.rows = rows if len(rows) and bool(np.all(rows[:, 0])) else np.empty((0, 2), np.uint64)
        lengths = [int(n) for n in rows[:, 1]]
        flags = _HYBRID_ROWS_MEMORY if len(self.rows) else 0
        self.header = _HYBRID_MAGIC + struct.pack("<II", _HYBRID_VERSION, len(attn.header)) + attn.header + \
            struct.pack("<I", len(skeleton)) + skeleton + struct.pack("<II", flags, len(offsets)) + \
            b"".join(struct.pack("<QQ", o, n) for o, n in zip(offsets, lengths))
        self.regions = np.concatenate([attn.regions, self.rows]) if len(self.rows) else attn.regions
        self.regions.flags.writeable = False
        self.n_bytes = attn.n_bytes + int(self.rows[:, 1].sum()) if len(self.rows) else attn.n_bytes

    def gather(self) -> npt.NDArray[np.uint8]:
        """The bytes of the regions, in order, in one uint8 array: the attention part's, then the rows."""
        rows = [np.frombuffer(ctypes.string_at(int(a), int(n)), np.uint8) for a, n in self.rows.tolist()]
        return np.concatenate([self.attn.gather(), *rows])


class _HybridHeader:
    """The fields of a HybridExport header (:func:`split_hybrid`)."""

    def __init__(self, attn: bytes, skeleton: bytes, flags: int, rows: list[tuple[int, int]]) -> None:
        self.attn = attn
        self.skeleton = skeleton
        self.flags = flags
        self.rows = rows
        self.n_row_bytes = sum(n for _, n in rows)

    def state(self, rows: bytes | None) -> bytes:
        """The recurrent state: the skeleton with the rows (their bytes in order; None: zeros) in place."""
        out = bytearray(len(self.skeleton) + self.n_row_bytes)
        at = sk = got = 0
        for off, n in self.rows:
            gap = off - at
            out[at:off] = self.skeleton[sk:sk + gap]
            if rows is not None:
                out[off:off + n] = rows[got:got + n]
            at, sk, got = off + n, sk + gap, got + n
        out[at:] = self.skeleton[sk:]
        return bytes(out)


def split_hybrid(header: Buffer) -> _HybridHeader:
    """The fields of a HybridExport header; StateError when it is not one."""
    from kvcache._core import StateError

    h = bytes(memoryview(header).cast("B"))
    if len(h) < 12 or h[:4] != _HYBRID_MAGIC:
        raise StateError("not a hybrid memory's hand-off header (magic KVCH)")
    version, n = struct.unpack_from("<II", h, 4)
    if version != _HYBRID_VERSION:
        raise StateError(f"hybrid hand-off header of version {version}; this cache takes version {_HYBRID_VERSION}")
    if len(h) - 12 < n + 4:
        raise StateError(f"hybrid hand-off header truncated in its attention part ({n} bytes, {len(h) - 12} remain)")
    attn = h[12:12 + n]
    off = 12 + n
    (m,) = struct.unpack_from("<I", h, off)
    if len(h) - off - 4 < m + 8:
        raise StateError(f"hybrid hand-off header truncated in its recurrent state ({m} bytes)")
    skeleton = h[off + 4:off + 4 + m]
    off += 4 + m
    flags, k = struct.unpack_from("<II", h, off)
    off += 8
    if flags & ~_HYBRID_ROWS_MEMORY:
        raise StateError(f"hybrid hand-off header: unknown flags {flags:#x}")
    if len(h) - off != 16 * k:
        raise StateError(f"hybrid hand-off header: {k} recurrent rows need {16 * k} bytes, {len(h) - off} follow")
    rows = [struct.unpack_from("<QQ", h, off + 16 * i) for i in range(k)]
    at = 0
    for i, (o, n) in enumerate(rows):
        if o < at or n == 0:
            raise StateError(f"hybrid hand-off header: recurrent row {i} at byte {o} of {n} bytes: out of order")
        at = o + n
    if at > len(skeleton) + sum(n for _, n in rows):
        raise StateError("hybrid hand-off header: the recurrent rows lie past the end of the recurrent state")
    return _HybridHeader(attn, skeleton, flags, rows)


class HybridImport:
    """An import into a HybridCache (``HybridCache.seq_import_begin``): the attention part's import
    and a buffer for the recurrent rows; ``regions``: the attention part's, then that buffer.
    ``commit()`` checks the attention part, reads the recurrent state (its rows from the buffer)
    into the sequence, commits the attention part: both parts or neither. ``abort()`` (or an
    exception in ``with``) leaves both as they were. Until then the HybridCache refuses changes,
    and so do its parts (``attn``, ``recr``)."""

    def __init__(self, attn: SeqImport | PartsImport, recr: _Recurrent2026, fields: _HybridHeader,
                 hold: object) -> None:
        self.attn = attn
        self._recr = recr
        self._fields = fields
        self._hold = hold
        self._marked = True
        self.seq_id = attn.seq_id
        moved = bool(fields.flags & _HYBRID_ROWS_MEMORY)
        self._rows = np.zeros(fields.n_row_bytes if moved else 0, np.uint8)
        mine = np.array([[self._rows.ctypes.data, self._rows.nbytes]], np.uint64) if moved and len(self._rows) else \
            np.empty((0, 2), np.uint64)
        self.regions = np.concatenate([attn.regions, mine])
        self.regions.flags.writeable = False
        self.n_bytes = attn.n_bytes + self._rows.nbytes
        recr._import_mark(True)

    @property
    def active(self) -> bool:
        """True until commit() or abort()."""
        return self.attn.active

    def scatter(self, data: Buffer | npt.NDArray[np.uint8]) -> None:
        """Copy data (HybridExport.gather's bytes) into the regions."""
        a = _scatter_bytes(data, self.n_bytes, "the sequence's")
        self.attn.scatter(a[:self.attn.n_bytes])
        self._rows[:] = a[self.attn.n_bytes:]

    def _unmark(self) -> None:
        if self._marked:
            self._marked = False
            self._recr._import_mark(False)

    def commit(self) -> None:
        """Check the attention part, read the recurrent state into the sequence, commit the
        attention part. StateError (nothing changed, still active) when either part refuses."""
        with self._hold:        # type: ignore[attr-defined]
            self.attn.check()
            rows = self._rows.tobytes() if self._fields.flags & _HYBRID_ROWS_MEMORY else None
            self._unmark()
            try:
                self._recr.state_read(self._fields.state(rows), self.seq_id, exact=True, layout="2026")
            except BaseException:
                self._marked = True
                self._recr._import_mark(True)
                raise
            self.attn.commit()

    def abort(self) -> None:
        """Abort the import: both parts as they were."""
        self.attn.abort()
        self._unmark()

    def __del__(self) -> None:
        self._unmark()

    def __enter__(self) -> HybridImport:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> Literal[False]:
        self.abort()
        return False
