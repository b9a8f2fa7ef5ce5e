"""Slow, pure-Python models of the unified cache's cell bookkeeping.

:class:`CellTable` holds one table of cells — position, accumulated shift, sequence set per
cell, and the ``head`` where the next slot search starts — with the sequence operations, the
mask and position-bucket rows and the K-shift input that both eras of llama.cpp compute the
same way. Two models are built on it:

- :class:`UnifiedReference` (here): the seed's cache (mid-2025, ``semantics="2025"``): one
  table, contiguous placement, the find_slot recovery stack, defragmentation. It tracks what
  :class:`kvcache.UnifiedCache` tracks about its cells and holds no K/V data. The property
  tests drive it and the C-backed cache with the same random operations, and the golden
  traces check the model itself.
- :class:`reference2026.UnifiedReference2026`: today's cache (``semantics="2026"``):
  one table per stream, scattered placement, prepare, stream copies, K/V data and state blobs.

Where llama.cpp's unified cache is defective, the models follow kvcache's contract
(``tests/golden/FORMAT.md``): ``seq_pos_min/max`` are the true extremes over the cells
(C3), ``seq_rm`` with sequence id -1 matches any sequence (C4), and an out-of-range
sequence id raises :class:`ValueError` without changing anything (C5).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

from kvcache._core import MAX_SEQ  # the caches' bound on sequence ids, from the C core

__all__ = ["UnifiedReference", "CellTable", "RefUBatch", "CellsSnapshot", "relative_position_bucket",
           "is_masked_swa", "pos_range", "check_swa", "check_geometry", "check_divisor", "check_ubatch", "seq_words",
           "MAX_SEQ", "KQ_MASK_PAD", "POS_MAX", "POS_END"]

KQ_MASK_PAD = 64        # mask rows are padded to a multiple of this
POS_MAX = 2**31 - 1     # the largest position
POS_END = 2**31         # the upper bound of an open position range: past every position
_U32 = 2**32

SWA_TYPES = ("none", "standard", "chunked")


@dataclass(frozen=True)
class RefUBatch:
    """A ubatch as the model reads it: positions and, per token group, its sequence ids.

    Tokens are ``len(seq_id)`` groups of ``n_seq_tokens`` consecutive tokens; a simple
    split has ``n_seq_tokens == 1``. :class:`kvcache.UBatch` has the same attributes and
    can be passed wherever this is accepted."""

    pos: Sequence[int]
    seq_id: Sequence[Sequence[int]]
    n_seq_tokens: int = 1
    tokens: Sequence[int] | None = None     # token ids, one per token
    pos_x: Sequence[int] | None = None      # 2-D positions, both or neither
    pos_y: Sequence[int] | None = None


def _groups(ub) -> tuple[list[int], list[list[int]], int]:
    pos = [int(p) for p in ub.pos]
    groups = [[int(s) for s in ([g] if isinstance(g, (int, np.integer)) else g)] for g in ub.seq_id]
    nst = int(getattr(ub, "n_seq_tokens", 1))
    if len(groups) * nst != len(pos):
        raise ValueError(f"seq_id has {len(groups)} groups of {nst} tokens, but pos has {len(pos)}")
    return pos, groups, nst


def _pad(x: int, n: int) -> int:
    return (x + n - 1) // n * n


def _c_div(a: int, b: int) -> int:
    """C integer division (truncates toward zero)."""
    q = abs(a) // abs(b)
    return q if (a >= 0) == (b >= 0) else -q


def pos_range(p0: int, p1: int) -> tuple[int, int]:
    """The position range [p0, p1) a sequence operation covers: negative ends are open (an open
    upper end lies past every position, POS_MAX included)."""
    return (0 if p0 < 0 else p0), (POS_END if p1 < 0 else p1)


def is_masked_swa(swa_type: str, n_swa: int, p0: int, p1: int) -> bool:
    """Is key position p0 outside the sliding window of query position p1?"""
    if swa_type == "standard":
        return p1 - p0 >= n_swa
    if swa_type == "chunked":
        return p0 < (p1 // n_swa) * n_swa
    return False


def relative_position_bucket(p0: int, p1: int, n_buckets: int) -> int:
    """T5's unidirectional relative position bucket of key position p0 seen from query p1.

    The reference computes ``floorf(max_exact + logf(r / max_exact) * (n_buckets - max_exact)
    / log(max_distance / max_exact))``: C's conversions make the logarithm and its product
    with the integer single precision, the division and the sum double, and ``floorf``
    rounds its argument to single precision before flooring."""
    max_distance = 128
    max_exact = n_buckets >> 1
    r = max(p1 - p0, 0)
    if r < max_exact:
        return r
    f32 = np.float32
    log_r = f32(math.log(float(f32(r / max_exact))))          # logf
    prod = float(log_r * f32(n_buckets - max_exact))           # float * integer -> float
    denom = math.log(max_distance / max_exact)
    if denom == 0.0:
        # n_buckets 256 or 257: the reference divides by zero and converts inf / nan to int32,
        # which is undefined; x86 yields INT32_MIN
        return -2**31
    large = max_exact + prod / denom
    large = int(math.floor(float(f32(large))))
    return min(large, n_buckets - 1)


def check_swa(n_swa: int, swa_type: str) -> None:
    """Reject a sliding-window setting the caches do not know."""
    if swa_type not in SWA_TYPES:
        raise ValueError(f"swa_type must be one of {SWA_TYPES}, got {swa_type!r}")
    if swa_type != "none" and n_swa <= 0:
        raise ValueError(f"swa_type {swa_type!r} needs n_swa > 0")


def check_geometry(kv_size: int, n_pad: int, n_seq_max: int, max_seq: int, n_swa: int, swa_type: str,
                   n_layer: int) -> None:
    """Reject cache dimensions llama.cpp aborts on or a cache of up to ``max_seq`` sequences
    cannot hold."""
    if kv_size <= 0:
        raise ValueError(f"kv_size must be positive, got {kv_size}")
    if n_pad <= 0 or kv_size % n_pad:
        raise ValueError(f"kv_size = {kv_size} must be a positive multiple of n_pad = {n_pad}")
    if not 1 <= n_seq_max <= max_seq:
        raise ValueError(f"n_seq_max must lie in [1, {max_seq}], got {n_seq_max}")
    check_swa(n_swa, swa_type)
    if n_layer <= 0:
        raise ValueError(f"n_layer must be positive, got {n_layer}")


def check_divisor(d: int) -> None:
    """Reject a seq_div divisor the reference cannot divide by (it would divide by zero or
    make positions negative)."""
    if d <= 0:
        raise ValueError(f"d must be positive, got {d}")


def check_ubatch(ub, n_seq_max: int) -> tuple[list[int], list[list[int]], int]:
    """Positions, sequence ids per group and tokens per group of a ubatch whose ids lie in
    [0, n_seq_max) and positions in [0, 2**31 - 1]; ValueError otherwise."""
    pos, groups, nst = _groups(ub)
    for g, ids in enumerate(groups):
        if not ids:
            raise ValueError(f"seq_id[{g}] is empty")
        for s in ids:
            if not 0 <= s < n_seq_max:
                raise ValueError(f"seq_id {s} in the ubatch is outside [0, {n_seq_max})")
    for p in pos:
        if not 0 <= p <= POS_MAX:
            raise ValueError(f"position {p} is outside [0, 2**31 - 1]")
    return pos, groups, nst


def seq_words(n_seq_max: int) -> int:
    """64-bit words of a cell's sequence set for ids [0, n_seq_max) (kvcache.Cells.seq_mask)."""
    return 1 if n_seq_max <= 64 else (n_seq_max + 63) // 64


class CellsSnapshot:
    """A copy of a cell table: ``pos`` and ``shift`` (int32) and the sequence ids per cell.

    ``n_words``: the words of ``seq_mask`` per cell, as the cache's (``seq_words(n_seq_max)``);
    None: as many as the largest id needs."""

    def __init__(self, pos: Iterable[int], shift: Iterable[int], seqs: Iterable[set[int]],
                 n_words: int | None = None):
        self.pos = np.array(list(pos), dtype=np.int32)
        self.shift = np.array(list(shift), dtype=np.int32)
        self.seqs: list[list[int]] = [sorted(ss) for ss in seqs]
        self.n_words = n_words if n_words is not None else seq_words(1 + max((max(ss, default=0) for ss in self.seqs),
                                                                               default=0))

    @property
    def seq_mask(self) -> np.ndarray:
        """uint64 [cells, n_words]: bit b of word w set when sequence 64 * w + b holds the cell."""
        out = np.zeros((len(self.seqs), self.n_words), dtype=np.uint64)
        for i, ss in enumerate(self.seqs):
            for s in ss:
                out[i, s >> 6] |= np.uint64(1 << (s & 63))
        return out

    def nonempty(self) -> list[list]:
        """``[[idx, pos, [seq ids ascending], shift], ...]`` for every cell with pos != -1."""
        return [[i, p, list(self.seqs[i]), int(self.shift[i])]
                for i, p in enumerate(self.pos.tolist()) if p != -1]


class CellTable:
    """One table of ``size`` cells and its ``head``, with the rules both eras apply to it.

    Per cell: ``pos`` (-1 = empty), ``shift`` (accumulated since the last reset) and the set
    of sequences holding it. A cell may be used (pos >= 0) by no sequence, as after a
    whole-cache state read of such a cell. ``empty_keeps_shift``: the seed leaves a cell's
    shift as it was when the cell is emptied; today's llama.cpp zeroes it. Sequence ids are
    not checked here: the caches built on the table check them."""

    def __init__(self, size: int, n_swa: int = 0, swa_type: str = "none", empty_keeps_shift: bool = True):
        self.size = size
        self.n_swa = n_swa
        self.swa_type = swa_type
        self.empty_keeps_shift = empty_keeps_shift
        self.pos = [-1] * size              # -1 = empty
        self.shift = [0] * size             # accumulated since the last reset_shift
        self.seq: list[set[int]] = [set() for _ in range(size)]
        self.has_shift = False
        self.head = 0

    # --- cells ------------------------------------------------------------------------

    def is_empty(self, i: int) -> bool:
        """Whether cell i holds no token."""
        return self.pos[i] == -1

    @property
    def used(self) -> int:
        """Number of non-empty cells."""
        return sum(1 for p in self.pos if p != -1)

    @property
    def used_max_p1(self) -> int:
        """Index of the last non-empty cell + 1, or 0."""
        for i in range(self.size - 1, -1, -1):
            if self.pos[i] != -1:
                return i + 1
        return 0

    def reset_cells(self) -> None:
        """Empty every cell, zero every shift, head = 0."""
        self.pos = [-1] * self.size
        self.shift = [0] * self.size
        self.seq = [set() for _ in range(self.size)]
        self.has_shift = False
        self.head = 0

    def _empty_cell(self, i: int) -> None:
        # k_shift reads 0 for empty cells, whichever way the shift is kept
        self.pos[i] = -1
        self.seq[i] = set()
        if not self.empty_keeps_shift:
            self.shift[i] = 0

    def _cell_seq_rm(self, i: int, s: int) -> bool:
        self.seq[i].discard(s)
        if not self.seq[i]:
            self._empty_cell(i)
            return True
        return False

    def _cell_pos_add(self, i: int, d: int) -> bool:
        self.pos[i] = min(self.pos[i] + d, POS_MAX)   # saturates (llama.cpp would overflow)
        self.shift[i] += d
        self.has_shift = True
        if self.pos[i] < 0:
            self._empty_cell(i)
            return True
        return False

    def _cell_pos_div(self, i: int, d: int) -> None:
        old = self.pos[i]
        self.pos[i] = _c_div(old, d)
        self.shift[i] += old - self.pos[i]   # the opposite sign to pos_add, as the reference has it
        self.has_shift = True

    def _pos_in(self, i: int, p0: int, p1: int) -> bool:
        return self.pos[i] != -1 and p0 <= self.pos[i] < p1

    def _lower_head(self, new_head: int | None) -> None:
        # a search may start at the first freed cell, never later than it did
        if new_head is not None and new_head < self.head:
            self.head = new_head

    # --- sequence operations (ids already checked) -----------------------------------------

    def remove(self, seq_id: int, p0: int, p1: int) -> None:
        """seq_rm: remove ``seq_id`` (-1: every sequence) from the cells with pos in [p0, p1)."""
        p0, p1 = pos_range(p0, p1)
        new_head = None
        for i in range(self.size):
            if not self._pos_in(i, p0, p1):
                continue
            if seq_id == -1:
                self._empty_cell(i)
                emptied = True
            elif seq_id in self.seq[i]:
                emptied = self._cell_seq_rm(i, seq_id)
            else:
                emptied = False
            if emptied and new_head is None:
                new_head = i
        self._lower_head(new_head)

    def copy(self, src: int, dst: int, p0: int, p1: int) -> None:
        """seq_cp within the table: add ``dst`` to every cell of ``src`` with pos in [p0, p1)."""
        if src == dst:
            return
        p0, p1 = pos_range(p0, p1)
        for i in range(self.size):
            if self._pos_in(i, p0, p1) and src in self.seq[i]:
                self.seq[i].add(dst)

    def keep(self, seq_id: int) -> None:
        """seq_keep: cells holding ``seq_id`` lose their other ids, the others empty."""
        new_head = None
        for i in range(self.size):
            if seq_id in self.seq[i]:
                self.seq[i] = {seq_id}
            elif self.seq[i]:
                self._empty_cell(i)
                if new_head is None:
                    new_head = i
        self._lower_head(new_head)

    def add(self, seq_id: int, p0: int, p1: int, shift: int) -> None:
        """seq_add: add ``shift`` to the positions of ``seq_id`` in [p0, p1); cells pushed below
        0 empty."""
        if shift == 0:
            return
        p0, p1 = pos_range(p0, p1)
        if p0 == p1:
            return
        new_head = None
        for i in range(self.size):
            if self._pos_in(i, p0, p1) and seq_id in self.seq[i]:
                if self._cell_pos_add(i, shift) and new_head is None:
                    new_head = i
        # the reference restarts the next search at the first freed cell, else at 0
        self.head = new_head if new_head is not None else 0

    def divide(self, seq_id: int, p0: int, p1: int, d: int) -> None:
        """seq_div: divide the positions of ``seq_id`` in [p0, p1) by ``d`` (> 0)."""
        if d == 1:
            return
        p0, p1 = pos_range(p0, p1)
        if p0 == p1:
            return
        for i in range(self.size):
            if self._pos_in(i, p0, p1) and seq_id in self.seq[i]:
                self._cell_pos_div(i, d)

    def pos_min(self, seq_id: int) -> int:
        """Smallest position of ``seq_id`` over the cells, -1 when it has none."""
        return min((p for p, ss in zip(self.pos, self.seq) if seq_id in ss), default=-1)

    def pos_max(self, seq_id: int) -> int:
        """Largest position of ``seq_id`` over the cells, -1 when it has none."""
        return max((p for p, ss in zip(self.pos, self.seq) if seq_id in ss), default=-1)

    # --- inputs of the attention graph ------------------------------------------------------

    def is_masked_swa(self, p0: int, p1: int) -> bool:
        """Is key position p0 outside the sliding window of query position p1?"""
        return is_masked_swa(self.swa_type, self.n_swa, p0, p1)

    def mask_row(self, seq_id: int, p1: int, n_kv: int, causal: bool, alibi: bool) -> np.ndarray:
        """The KQ mask row of a token of ``seq_id`` at position p1 over cells [0, n_kv): 0 (or
        -|p0 - p1| with ALiBi) where it sees the cell, -inf elsewhere."""
        row = np.full(n_kv, -np.inf, dtype=np.float32)
        for i in range(n_kv):
            if self.is_empty(i) or seq_id not in self.seq[i]:
                continue
            p0 = self.pos[i]
            if (causal and p0 > p1) or self.is_masked_swa(p0, p1):
                continue
            row[i] = -abs(p0 - p1) if alibi else 0.0
        return row

    def bucket_row(self, p1: int, n_kv: int, n_buckets: int) -> np.ndarray:
        """T5 relative position buckets of query position p1 over cells [0, n_kv) (empty cells
        count as position -1)."""
        return np.array([relative_position_bucket(self.pos[i], p1, n_buckets) for i in range(n_kv)],
                        dtype=np.int32)

    def k_shift(self) -> np.ndarray:
        """The per-cell shift input of the K-shift graph (0 for empty cells)."""
        return np.array([0 if self.is_empty(i) else self.shift[i] for i in range(self.size)],
                        dtype=np.int32)

    def reset_shift(self) -> None:
        """Zero every shift (after the K-shift has been applied)."""
        self.shift = [0] * self.size
        self.has_shift = False

    def cells(self) -> CellsSnapshot:
        """A snapshot of pos / shift / sequence ids per cell."""
        return CellsSnapshot(self.pos, self.shift, self.seq)


class UnifiedReference(CellTable):
    """The cell semantics of the seed's unified KV cache of ``kv_size`` cells, in plain Python.

    ``n_layer`` is the number of layers the cache keeps; it only enters the defrag move
    budget. Sequence ids are valid in ``[0, n_seq_max)``."""

    def __init__(self, kv_size: int, n_seq_max: int = 1, n_pad: int = 32, n_swa: int = 0,
                 swa_type: str = "none", n_layer: int = 1):
        check_geometry(kv_size, n_pad, n_seq_max, MAX_SEQ, n_swa, swa_type, n_layer)
        super().__init__(kv_size, n_swa, swa_type, empty_keeps_shift=True)
        self.n_seq_max = n_seq_max
        self.n_pad = n_pad
        self.n_layer = n_layer
        self.n = 0
        self.do_defrag = False
        self.defrag_ids: list[int] = []
        # one (first cell, [(pos, seqs) per cell]) per find_slot since the last commit
        self._recovery: list[tuple[int, list[tuple[int, set[int]]]]] = []

    def cells(self) -> CellsSnapshot:
        """A snapshot of pos / shift / sequence ids per cell, seq_mask as wide as the cache's."""
        return CellsSnapshot(self.pos, self.shift, self.seq, seq_words(self.n_seq_max))

    def _cell_mv(self, src: int, dst: int) -> None:
        self.pos[dst], self.shift[dst], self.seq[dst] = self.pos[src], self.shift[src], self.seq[src]
        self.pos[src], self.shift[src], self.seq[src] = -1, 0, set()

    def _check_seq(self, s: int, name: str, allow_any: bool = False) -> None:
        if allow_any and s == -1:
            return
        if not 0 <= s < self.n_seq_max:
            raise ValueError(f"{name} = {s} is outside [0, {self.n_seq_max})")

    # --- sequence operations ------------------------------------------------------------

    def clear(self) -> None:
        """Empty every cell, zero every shift, head = 0; ``n`` and the recovery stack stay."""
        self.reset_cells()

    def seq_rm(self, seq_id: int, p0: int = -1, p1: int = -1) -> bool:
        """Remove sequence ``seq_id`` (-1: every sequence) from the cells with pos in [p0, p1)."""
        self._check_seq(seq_id, "seq_id", allow_any=True)
        self.remove(seq_id, p0, p1)
        return True

    def seq_cp(self, seq_id_src: int, seq_id_dst: int, p0: int = -1, p1: int = -1) -> None:
        """Add ``seq_id_dst`` to every cell of ``seq_id_src`` with pos in [p0, p1)."""
        self._check_seq(seq_id_src, "seq_id_src")
        self._check_seq(seq_id_dst, "seq_id_dst")
        self.copy(seq_id_src, seq_id_dst, p0, p1)

    def seq_keep(self, seq_id: int) -> None:
        """Keep only ``seq_id``: cells holding it lose their other ids, the rest empty."""
        self._check_seq(seq_id, "seq_id")
        self.keep(seq_id)

    def seq_add(self, seq_id: int, p0: int, p1: int, shift: int) -> None:
        """Add ``shift`` to the positions of ``seq_id`` in [p0, p1); cells pushed below 0 empty."""
        self._check_seq(seq_id, "seq_id")
        self.add(seq_id, p0, p1, shift)

    def seq_div(self, seq_id: int, p0: int, p1: int, d: int) -> None:
        """Divide the positions of ``seq_id`` in [p0, p1) by ``d`` (> 0)."""
        self._check_seq(seq_id, "seq_id")
        check_divisor(d)
        self.divide(seq_id, p0, p1, d)

    def seq_pos_min(self, seq_id: int) -> int:
        """Smallest position of ``seq_id`` over the cells, -1 when it has none (C3)."""
        self._check_seq(seq_id, "seq_id")
        return self.pos_min(seq_id)

    def seq_pos_max(self, seq_id: int) -> int:
        """Largest position of ``seq_id`` over the cells, -1 when it has none (C3)."""
        self._check_seq(seq_id, "seq_id")
        return self.pos_max(seq_id)

    # --- placing a ubatch -------------------------------------------------------------------

    def _check_ubatch(self, ub) -> tuple[list[int], list[list[int]], int]:
        return check_ubatch(ub, self.n_seq_max)

    def find_slot(self, ub) -> bool:
        """Place the ubatch in the first run of empty cells found from ``head`` (wrapping).

        On failure ``head`` may have moved (as the reference's search leaves it)."""
        pos, groups, nst = self._check_ubatch(ub)
        n_tokens = len(pos)
        # with enough free cells before head, search from the start to fill the cache
        if self.head > self.used + 2 * n_tokens:
            self.head = 0
        if n_tokens > self.size:
            return False
        n_tested = 0
        while True:
            if self.head + n_tokens > self.size:
                n_tested += self.size - self.head
                self.head = 0
                continue
            found = True
            for i in range(n_tokens):
                if not self.is_empty(self.head + i):
                    found = False
                    self.head += i + 1
                    n_tested += i + 1
                    break
            if found:
                break
            if n_tested >= self.size:
                return False
        h = self.head
        self._recovery.append((h, [(self.pos[h + i], set(self.seq[h + i])) for i in range(n_tokens)]))
        for t in range(n_tokens):
            self.pos[h + t] = pos[t]
            self.seq[h + t] = set(groups[t // nst])
        self.n = min(self.size, max(self.n_pad, _pad(self.used_max_p1, self.n_pad)))
        return True

    def commit(self) -> None:
        """Forget the recovery information of the find_slot calls so far."""
        self._recovery.clear()

    def restore(self) -> None:
        """Put back the cells every find_slot since the last commit overwrote (in call order).

        Positions and sequences come back; shifts are left as they are."""
        for i, cells in self._recovery:
            for j, (p, ss) in enumerate(cells):
                self.pos[i + j] = p
                self.seq[i + j] = set(ss)
        self._recovery.clear()

    def set_full(self) -> None:
        """Make the attention span the whole cache (n = size), head = 0."""
        self.n = self.size
        self.head = 0

    # --- inputs of the attention graph ------------------------------------------------------

    def kq_mask(self, ub, causal: bool = True, alibi: bool = False) -> np.ndarray:
        """The KQ mask [pad(n_tokens, 64), n]: 0 (or -|p0 - p1| with ALiBi) where a token sees a
        cell, -inf elsewhere and in the padding rows. Token rows use their group's first id."""
        pos, groups, nst = self._check_ubatch(ub)
        n_tokens = len(pos)
        out = np.full((_pad(n_tokens, KQ_MASK_PAD), self.n), -np.inf, dtype=np.float32)
        for t in range(n_tokens):
            out[t] = self.mask_row(groups[t // nst][0], pos[t], self.n, causal, alibi)
        return out

    def pos_bucket(self, ub, n_buckets: int) -> np.ndarray:
        """T5 relative position buckets [n_tokens, n] (empty cells count as position -1)."""
        pos, _, _ = self._check_ubatch(ub)
        out = np.zeros((len(pos), self.n), dtype=np.int32)
        for t, p1 in enumerate(pos):
            out[t] = self.bucket_row(p1, self.n, n_buckets)
        return out

    # --- defragmentation ----------------------------------------------------------------

    def defrag_sched(self, thold: float) -> None:
        """Request a defrag when fragmentation exceeds ``thold`` (only for n >= 2048)."""
        f32 = np.float32
        frag = f32(0.0)
        if self.n >= 2048:
            frag = max(f32(0.0), f32(1.0) - f32(self.used + self.n_pad) / f32(self.n))
        if frag > f32(thold):
            self.do_defrag = True

    def defrag_prepare(self, n_max_nodes: int) -> bool:
        """Plan a defrag: fill holes below ``used`` with cells from the end, moving the cell
        metadata now. ``defrag_ids[i]`` is where cell i goes (``i`` or ``len`` = stays).

        The move budget is ``(n_max_nodes - 2*n_layer) / (6*n_layer)`` in unsigned 32-bit
        arithmetic (small ``n_max_nodes`` wrap around to a huge budget); a budget of 0 is
        unlimited because the count passes 0 before it is first compared."""
        n_layer = self.n_layer
        n_kv = self.used_max_p1
        n_used = self.used
        max_moves = ((n_max_nodes - 2 * n_layer) % _U32) // ((6 * n_layer) % _U32)
        n_moves = 0
        ids = [n_kv] * n_kv
        self.defrag_ids = ids
        i0 = 0
        while i0 < n_used:
            if not self.is_empty(i0):
                ids[i0] = i0
                i0 += 1
                continue
            # a hole of nh cells: fill it with the last nh cells not yet placed
            nh = 1
            while i0 + nh < n_used and self.is_empty(i0 + nh):
                nh += 1
            nf = 0
            src = n_kv - 1
            while src > i0:
                if not self.is_empty(src) and ids[src] == n_kv:
                    nf += 1
                    if nf == nh:
                        break
                src -= 1
            if nf != nh:
                raise RuntimeError("defrag: fewer movable cells than holes (the used count is wrong)")
            nf = 0
            cont = False
            stop = False
            i1 = src
            while i1 < n_kv:
                if self.is_empty(i1) or ids[i1] != n_kv:
                    if n_moves == max_moves:
                        stop = True
                        break
                    cont = False
                    i1 += 1
                    continue
                ids[i1] = i0 + nf
                self._cell_mv(i1, i0 + nf)
                self.head = n_used
                if not cont:
                    n_moves += 1
                    cont = True
                nf += 1
                if nf == nh:
                    break
                i1 += 1
            if stop or n_moves == max_moves:
                break
            i0 += nh
        return n_moves > 0

    def __repr__(self) -> str:
        return (f"UnifiedReference(size={self.size}, head={self.head}, n={self.n}, "
                f"used={self.used}, n_seq_max={self.n_seq_max})")
