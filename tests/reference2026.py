"""A slow, pure-Python model of today's llama.cpp unified cache (``semantics="2026"``).

:class:`UnifiedReference2026` is an executable description of the cache of llama.cpp commit
0c1e57098 (llama-cpp-python 0.3.36) as ``tests/golden/FORMAT-2026.md`` describes it, written
to be read, not to be fast. It replays every trace in ``tests/golden/unified2026/``
(``python -m conformance --target reference``, run from tests/), and the C-backed cache is checked
against it.

What it models:

- **Streams.** ``kv_unified=True``: one cell table (one head, one K/V slab); otherwise
  ``n_seq_max`` tables, sequence s living in stream s. ``kv_size`` is the size of each stream.
  Up to 256 sequences.
- **Placement** (``find_slot`` = llama.cpp's ``find_slot(ubatch, cont=false)`` followed by
  ``apply_ubatch``): per group of the ubatch, in its stream, the usable cells from the head on,
  one at a time, wrapping around — not necessarily contiguous. A cell is usable when it is empty
  or holds one sequence whose window (``is_masked_swa`` against that sequence's largest
  position + 1) has left it. A taken cell that was not empty is emptied first, and every
  sequence that lost a cell loses its positions up to the largest one overwritten (the purge
  that keeps a sequence's positions contiguous). A failed search changes nothing.
- **prepare** (rule C8): the slot of each ubatch found against the state holding the ubatches
  before it, and afterwards the cache exactly as it was.
- **Sequence operations per stream**, ``seq_rm(-1, ...)`` over every stream; ``seq_cp`` across
  streams only of whole sequences: it resets the destination stream, copies the cell metadata
  and queues a stream copy that the next ``update()`` performs on the K/V data (copies first,
  then the shift reset). ``seq_pos_min/max`` are the true extremes over the cells (today's
  llama.cpp keeps an exact position multiset per sequence).
- **Attention inputs**: ``n_kv`` per stream (``min(kv_size, max(P, roundup(used_max_p1, P)))``,
  ``P = max(n_pad, 256)``); the KQ mask per stream ``[streams, rows, n_kv]`` without padding
  rows; T5 position buckets (one stream only); the K-shift input of every stream.
- **K/V data** in llama.cpp's layout: per layer, K rows ``stream * kv_size + cell``; V the same,
  or transposed per stream (element e of cell c at ``[stream, e, c]``); zeroed by ``clear``.
- **The per-cell extension** (``cell_ext=True``: M-RoPE and per-layer-embedding models): each
  cell's 2-D position (x, y) and token id (defaults 0, 0, -1). A ubatch with 2-D positions
  (``pos_x``, ``pos_y``) or token ids, or every ubatch of a cache with ``ple_token``, sets it in
  the cells it takes (what the ubatch lacks at its default; no token id: ``ple_token`` when
  given); a cell that empties gets the defaults back, except one pushed below position 0 by
  ``seq_add``. ``seq_cp`` across streams copies it. The mask of a ubatch with 2-D positions
  (causal) also hides, at a token's own position, the cells of its sequence whose 2-D position
  comes after the token's (y first, then x). The states carry it after each cell's ``n_seq_id``
  (12 bytes: x, y, token id); a sequence's state puts it back into the cells it is placed in.
- **State blobs** (the cache part of ``llama_state_seq_get_data`` without the sequence-blob
  prefix): ``u32 n_stream``, then per stream ``u32 cell_count`` and, when it is not 0, the
  seed's cell list and K/V sections. Single-sequence blobs leave out the cells that the
  sequence's window has left (against its largest position); whole-cache blobs list the ids
  below ``n_seq_max``. Reads (rule C7: a failed read changes nothing, and raises
  :class:`kvcache.StateError`): the stream count must match; a whole-cache read clears the
  cache and puts cell k of stream section s into cell k of stream s; a single-sequence read
  removes the destination sequence from its stream and places the cells there as one ubatch
  (scattered, as ``find_slot`` places); a blob whose every stream is empty is a no-op that keeps
  the destination's cells; bytes after the state are not read.

What today's llama.cpp aborts on (FORMAT-2026.md, "Aborts") raises :class:`ValueError` here and
changes nothing: sequence ids outside ``[0, n_seq_max)`` (``-1`` only where it means "every
sequence" / "whole cache"; kvcache also refuses the ids in ``[n_seq_max, 256)`` that llama.cpp's
unified cache takes but its batch validation rejects), a partial ``seq_cp`` across streams, a
ubatch of a multi-stream cache that is not grouped per sequence in groups of equal size, ``seq_div``
by ``d <= 0``, ``prepare`` of no ubatch, position buckets of several streams.
"""
from __future__ import annotations

import copy
import struct
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import numpy as np

from kvcache._core import StateError, ggml_row_size, ggml_type, quantize, view_dtype
from kvcache.statefile import _Reader, _view
from reference import (CellTable, CellsSnapshot, KQ_MASK_PAD, _pad, check_divisor, check_geometry,
                       check_ubatch)

__all__ = ["UnifiedReference2026", "UpdateResult", "SlotInfo", "LLAMA_MAX_SEQ", "N_KV_PAD_MIN",
           "STATUS_SUCCESS", "STATUS_NO_UPDATE"]

LLAMA_MAX_SEQ = 256     # sequences a cache can hold (LLAMA_MAX_SEQ; the seed's was 64)
N_KV_PAD_MIN = 256      # n_kv is padded to a multiple of at least this many cells
STATUS_SUCCESS = 0      # llama_memory_status of an update that did something
STATUS_NO_UPDATE = 1    # ... and of one that had nothing to do

#: the slot of a ubatch: per token group, its stream and the cell of each of its tokens
SlotInfo = list[tuple[int, np.ndarray]]

# one group of a ubatch: its stream and the indices of its tokens in the ubatch
_Group = tuple[int, list[int]]


@dataclass(frozen=True)
class UpdateResult:
    """What ``update()`` found and did.

    ``status``: STATUS_SUCCESS (0) when there was a shift or a stream copy to apply, else
    STATUS_NO_UPDATE (1); ``had_shift``: a shift was pending; ``copies``: the number of stream
    copies performed; ``has_shift``: a shift is pending afterwards (never); ``shift``: the
    K-shift input read before the update, int32 ``[n_stream * kv_size]``, stream-major, 0 for
    empty cells."""

    status: int
    had_shift: bool
    copies: int
    has_shift: bool
    shift: np.ndarray


def _per_layer(v: int | Sequence[int], n_layer: int, name: str) -> list[int]:
    vals = [int(v)] * n_layer if isinstance(v, (int, np.integer)) else [int(x) for x in v]
    if len(vals) != n_layer:
        raise ValueError(f"{name} has {len(vals)} entries, not one per model layer ({n_layer})")
    if any(x <= 0 for x in vals):
        raise ValueError(f"{name} must be positive, got {vals}")
    return vals


#: a cell's extension when nothing set it: (x, y, token id)
EXT_DEFAULT = (0, 0, -1)


class _ExtTable(CellTable):
    """A cell table that may carry the per-cell extension (``ext``: per cell (x, y, tok), or
    None for a cache without it)."""

    def __init__(self, size: int, n_swa: int, swa_type: str, ext: bool):
        super().__init__(size, n_swa, swa_type, empty_keeps_shift=False)
        self.ext: list[tuple[int, int, int]] | None = [EXT_DEFAULT] * size if ext else None

    def reset_cells(self) -> None:
        super().reset_cells()
        if self.ext is not None:
            self.ext = [EXT_DEFAULT] * self.size

    def _empty_cell(self, i: int) -> None:
        super()._empty_cell(i)
        if self.ext is not None:
            self.ext[i] = EXT_DEFAULT

    def _cell_pos_add(self, i: int, d: int) -> bool:
        # llama.cpp's pos_add empties a cell pushed below 0 without touching its extension
        kept = self.ext[i] if self.ext is not None else None
        emptied = super()._cell_pos_add(i, d)
        if self.ext is not None and kept is not None:
            self.ext[i] = kept
        return emptied

    def cells(self) -> CellsSnapshot:
        snap = super().cells()
        snap.ext = None if self.ext is None else np.array(self.ext, dtype=np.int32).reshape(self.size, 3)  # type: ignore[attr-defined]
        return snap


class UnifiedReference2026:
    """Today's llama.cpp unified cache: ``n_stream`` cell tables of ``kv_size`` cells, their
    K/V data and state blobs.

    ``UnifiedReference2026(kv_size, n_layer, n_embd_k_gqa, n_embd_v_gqa, type_k="f16",
    type_v="f16", v_trans=True, n_seq_max=1, n_pad=1, n_swa=0, swa_type="none",
    semantics="2026", kv_unified=True, layers=None, cell_ext=False, ple_token=None)`` — the arguments of the C-backed
    ``kvcache.UnifiedCache(semantics="2026")``: ``n_embd_*_gqa`` one int or one per model layer,
    ``layers`` the model layers kept (None: all), ``kv_size`` cells per stream.

    Attributes (as given, not to be changed): ``size`` (cells per stream), ``n_stream`` (1 with
    ``kv_unified``, else ``n_seq_max``), ``kv_unified``, ``semantics``, ``n_seq_max``, ``n_layer``,
    ``layers`` (tuple, ascending), ``type_k`` / ``type_v`` (ggml type names), ``v_trans``,
    ``n_pad`` (at least 256 is applied to ``n_kv``), ``n_swa``, ``swa_type``; ``streams``: the
    cell table of each stream (:class:`reference.CellTable`)."""

    def __init__(self, kv_size: int, n_layer: int, n_embd_k_gqa: int | Sequence[int],
                 n_embd_v_gqa: int | Sequence[int], type_k: str | int = "f16", type_v: str | int = "f16",
                 v_trans: bool = True, n_seq_max: int = 1, n_pad: int = 1, n_swa: int = 0,
                 swa_type: str = "none", semantics: str = "2026", kv_unified: bool = True,
                 layers: Iterable[int] | None = None, cell_ext: bool = False, ple_token: int | None = None):
        if semantics != "2026":
            raise ValueError(f"this is the model of semantics '2026' (the seed's is "
                             f"reference.UnifiedReference), got {semantics!r}")
        check_geometry(kv_size, n_pad, n_seq_max, LLAMA_MAX_SEQ, n_swa, swa_type, n_layer)
        self._n_embd_k = _per_layer(n_embd_k_gqa, n_layer, "n_embd_k_gqa")
        self._n_embd_v = _per_layer(n_embd_v_gqa, n_layer, "n_embd_v_gqa")
        kept = list(range(n_layer)) if layers is None else [int(il) for il in layers]
        if kept != sorted(set(kept)) or not all(0 <= il < n_layer for il in kept):
            raise ValueError(f"layers must be distinct ascending model layers in [0, {n_layer}), got {kept}")
        self._tk = ggml_type(type_k)
        self._tv = ggml_type(type_v)
        if v_trans and self._tv.blck_size != 1:
            raise ValueError(f"a transposed V needs a type of one element per block, not {self._tv.name}")
        self.size = kv_size
        self.n_layer = n_layer
        self.layers = tuple(kept)
        self.type_k = str(self._tk.name)
        self.type_v = str(self._tv.name)
        self.v_trans = bool(v_trans)
        self.n_seq_max = n_seq_max
        self.n_pad = n_pad
        self.n_swa = n_swa
        self.swa_type = swa_type
        self.semantics = "2026"
        self.kv_unified = bool(kv_unified)
        self.n_stream = 1 if kv_unified else n_seq_max
        if ple_token is not None and not cell_ext:
            raise ValueError("ple_token needs the per-cell extension (cell_ext=True)")
        self.cell_ext = bool(cell_ext)
        self.ple_token = None if ple_token is None else int(ple_token)
        self.streams = [_ExtTable(kv_size, n_swa, swa_type, self.cell_ext) for _ in range(self.n_stream)]
        self._pending: list[tuple[int, int]] = []     # queued stream copies (src, dst), in order
        # a transposed V has the widest row of the model in every layer, as llama.cpp pads it
        self._v_width = max(self._n_embd_v) if self.v_trans else 0
        rows = self.n_stream * kv_size
        self._k = {il: np.zeros((rows, ggml_row_size(self._tk.id, self._n_embd_k[il])), np.uint8)
                   for il in self.layers}
        if self.v_trans:
            self._v = {il: np.zeros((self.n_stream, self._v_width, kv_size, self._tv.type_size), np.uint8)
                       for il in self.layers}
        else:
            self._v = {il: np.zeros((rows, ggml_row_size(self._tv.id, self._n_embd_v[il])), np.uint8)
                       for il in self.layers}
        # the slot of the last successful find_slot, for store()
        self._last: SlotInfo | None = None

    def stream_of(self, seq_id: int) -> int:
        """The stream sequence ``seq_id`` lives in."""
        self._check_seq(seq_id, "seq_id")
        return 0 if self.n_stream == 1 else seq_id

    # --- the state of the streams ---------------------------------------------------------

    @property
    def heads(self) -> tuple[int, ...]:
        """Per stream, the cell where the next slot search starts."""
        return tuple(t.head for t in self.streams)

    @property
    def used_per_stream(self) -> tuple[int, ...]:
        """Per stream, the number of non-empty cells."""
        return tuple(t.used for t in self.streams)

    @property
    def used_max_p1_per_stream(self) -> tuple[int, ...]:
        """Per stream, the index of the last non-empty cell + 1 (0 when empty)."""
        return tuple(t.used_max_p1 for t in self.streams)

    @property
    def n_kv_per_stream(self) -> tuple[int, ...]:
        """Per stream, the cells the attention spans: ``min(kv_size, max(P, roundup(used_max_p1,
        P)))`` with ``P = max(n_pad, 256)``."""
        p = max(self.n_pad, N_KV_PAD_MIN)
        return tuple(min(self.size, max(p, _pad(t.used_max_p1, p))) for t in self.streams)

    @property
    def has_shift(self) -> bool:
        """Whether a position shift awaits ``update()`` in any stream."""
        return any(t.has_shift for t in self.streams)

    @property
    def pending_copies(self) -> int:
        """Number of stream copies queued by cross-stream ``seq_cp`` for the next ``update()``."""
        return len(self._pending)

    def stream_cells(self) -> tuple[CellsSnapshot, ...]:
        """A snapshot of each stream's cells."""
        return tuple(t.cells() for t in self.streams)

    def cells(self) -> tuple[CellsSnapshot, ...]:
        """A snapshot of each stream's cells (as ``stream_cells``)."""
        return self.stream_cells()

    # --- argument checks --------------------------------------------------------------------

    def _check_seq(self, s: int, name: str, allow_any: bool = False) -> None:
        if allow_any and s == -1:
            return
        if not 0 <= s < self.n_seq_max:
            raise ValueError(f"{name} = {s} is outside [0, {self.n_seq_max})")

    def _table(self, seq_id: int) -> _ExtTable:
        return self.streams[self.stream_of(seq_id)]

    def _ubatch_ext(self, ub: Any, n: int) -> list[tuple[int, int, int]] | None:
        """The extension each token of a ubatch sets, or None when it sets none."""
        xs, ys, toks = (getattr(ub, k, None) for k in ("pos_x", "pos_y", "tokens"))
        if (xs is None) != (ys is None):
            raise ValueError("a 2-D position needs both pos_x and pos_y")
        if xs is not None and not self.cell_ext:
            raise ValueError("a ubatch with 2-D positions needs a cache with the per-cell extension")
        if xs is None and toks is None and self.ple_token is None:
            return None
        return [(int(xs[t]) if xs is not None else 0, int(ys[t]) if ys is not None else 0,
                 int(toks[t]) if toks is not None else self.ple_token if self.ple_token is not None else -1)
                for t in range(n)]

    def _ubatch(self, ub: Any) -> tuple[list[int], list[list[int]], list[_Group]]:
        """Positions, sequence ids per token and the token groups of a ubatch.

        One stream: one group of every token (tokens of several sequences may interleave, a
        token may carry several ids). Several streams: the tokens grouped per sequence, groups
        in order of appearance, all of one length, every token with exactly one id."""
        pos, groups, nst = check_ubatch(ub, self.n_seq_max)
        if not pos:
            raise ValueError("the ubatch has no tokens")
        # a token's ids as listed (duplicates dropped): the mask follows its first one
        ids = [list(dict.fromkeys(groups[t // nst])) for t in range(len(pos))]
        if self.n_stream == 1:
            return pos, ids, [(0, list(range(len(pos))))]
        unq: list[int] = []
        for t_ids in ids:
            if t_ids[0] not in unq:
                unq.append(t_ids[0])
        n_seq_tokens, rest = divmod(len(pos), len(unq))
        out: list[_Group] = []
        for g, s in enumerate(unq):
            toks = list(range(g * n_seq_tokens, (g + 1) * n_seq_tokens))
            if rest or any(ids[t] != [s] for t in toks):
                raise ValueError("a ubatch of a cache with several streams must hold the tokens of each "
                                 "sequence together, one id per token, every sequence with as many tokens "
                                 f"(got the sequence ids {[t_ids for t_ids in ids]})")
            out.append((s, toks))
        return pos, ids, out

    # --- placement ------------------------------------------------------------------------

    def _usable(self, t: CellTable, i: int) -> bool:
        if t.is_empty(i):
            return True
        # a used cell is reused only once the window of its one sequence has left it
        if len(t.seq[i]) != 1 or self.swa_type == "none":
            return False
        (q,) = t.seq[i]
        return t.is_masked_swa(t.pos[i], t.pos_max(q) + 1)

    def _find_slot(self, groups: list[_Group]) -> SlotInfo | None:
        """The cells of each group, or None when one of them does not fit (nothing changes)."""
        slot: SlotInfo = []
        for strm, toks in groups:
            t = self.streams[strm]
            n = len(toks)
            head = t.head
            # with enough free cells before head, search from the start to fill the cache
            if head > t.used + 2 * n:
                head = 0
            if n > self.size:
                return None
            idxs: list[int] = []
            n_tested = 0
            while True:
                if head == self.size:
                    head = 0
                i = head
                head += 1
                n_tested += 1
                if self._usable(t, i):
                    idxs.append(i)
                if len(idxs) == n:
                    break
                if n_tested >= self.size:
                    return None
            slot.append((strm, np.array(idxs, dtype=np.int32)))
        return slot

    def _apply(self, slot: SlotInfo, groups: list[_Group], pos: list[int], ids: list[list[int]],
               ext: list[tuple[int, int, int]] | None = None) -> None:
        """Put the tokens into their cells (with their extensions, when the ubatch sets them),
        purge what they overwrote, move the heads."""
        overwritten: dict[int, int] = {}    # sequence -> largest position overwritten
        for (strm, idxs), (_, toks) in zip(slot, groups):
            t = self.streams[strm]
            for i, tok in zip(idxs.tolist(), toks):
                if not t.is_empty(i):
                    (q,) = t.seq[i]
                    overwritten[q] = max(overwritten.get(q, -1), t.pos[i])
                    t._empty_cell(i)
                t.pos[i] = pos[tok]
                t.seq[i] = set(ids[tok])
                if t.ext is not None and ext is not None:
                    t.ext[i] = ext[tok]
        # keep every sequence's positions contiguous: drop what lies below an overwritten one
        for q in sorted(overwritten):
            t = self._table(q)
            p_min = t.pos_min(q)
            if p_min <= overwritten[q]:
                t.remove(q, p_min, overwritten[q] + 1)
        for strm, idxs in slot:
            self.streams[strm].head = int(idxs[-1]) + 1

    def find_slot(self, ub: Any) -> bool:
        """Place a ubatch (``find_slot(cont=false)`` + ``apply_ubatch``): True when it fits.

        On success ``slot_info()`` tells where each token went and ``store`` writes its K/V
        rows; on failure nothing changes."""
        pos, ids, groups = self._ubatch(ub)
        ext = self._ubatch_ext(ub, len(pos))
        slot = self._find_slot(groups)
        if slot is None:
            self._last = None
            return False
        self._apply(slot, groups, pos, ids, ext)
        self._last = slot
        return True

    def slot_info(self) -> SlotInfo:
        """Where the last ``find_slot`` put each token: per group ``(stream, int32 cells)``,
        token ``g * n_seq_tokens + i`` in cell ``cells[i]`` of the group's stream; ``[]`` when
        it failed or none ran yet."""
        return [] if self._last is None else [(s, idxs.copy()) for s, idxs in self._last]

    def prepare(self, ubatches: Sequence[Any]) -> list[SlotInfo] | None:
        """Where ``find_slot`` would place each ubatch after the ones before it, or None when one
        does not fit; the cache is left exactly as it was (rule C8)."""
        parsed = [self._ubatch(ub) for ub in ubatches]
        if not parsed:
            raise ValueError("prepare needs at least one ubatch")
        saved = copy.deepcopy(self.streams)
        try:
            slots: list[SlotInfo] = []
            for pos, ids, groups in parsed:
                slot = self._find_slot(groups)
                if slot is None:
                    return None
                self._apply(slot, groups, pos, ids)
                slots.append(slot)
            return slots
        finally:
            self.streams = saved

    def store(self, il: int, k_rows: Any, v_rows: Any) -> None:
        """Write the K and V rows (float, one row per token in ubatch order, ``None``: leave) of
        model layer ``il`` for the ubatch the last ``find_slot`` placed."""
        if self._last is None:
            raise RuntimeError("store needs a ubatch placed by find_slot")
        self._check_layer(il)
        rows = [strm * self.size + int(c) for strm, idxs in self._last for c in idxs]
        n = len(rows)
        if k_rows is not None:
            self._k[il][rows] = self._encode(k_rows, self._tk.id, n, self._n_embd_k[il], "k_rows")
        if v_rows is not None:
            vb = self._encode(v_rows, self._tv.id, n, self._n_embd_v[il], "v_rows")
            if self.v_trans:
                for r, row in zip(rows, vb):
                    s, c = divmod(r, self.size)
                    self._v[il][s, :self._n_embd_v[il], c] = row.reshape(-1, self._tv.type_size)
            else:
                self._v[il][rows] = vb

    @staticmethod
    def _encode(x: Any, type_id: int, n: int, width: int, name: str) -> np.ndarray:
        arr = np.asarray(x, dtype=np.float32)
        if arr.shape != (n, width):
            raise ValueError(f"{name} must have shape ({n}, {width}), got {arr.shape}")
        return quantize(arr, type_id)

    # --- sequence operations ----------------------------------------------------------------

    def clear(self) -> None:
        """Empty every stream (heads 0, shifts reset) and zero the K/V data; queued stream
        copies stay queued."""
        for t in self.streams:
            t.reset_cells()
        for arr in (*self._k.values(), *self._v.values()):
            arr.fill(0)

    def seq_rm(self, seq_id: int, p0: int = -1, p1: int = -1) -> bool:
        """Remove ``seq_id`` from its stream's cells with pos in [p0, p1); -1: empty those cells
        in every stream. Always True."""
        self._check_seq(seq_id, "seq_id", allow_any=True)
        for t in (self.streams if seq_id == -1 else [self._table(seq_id)]):
            t.remove(seq_id, p0, p1)
        return True

    def seq_cp(self, seq_id_src: int, seq_id_dst: int, p0: int = -1, p1: int = -1) -> None:
        """Copy ``seq_id_src`` to ``seq_id_dst``: within a stream, add the id to the source's
        cells with pos in [p0, p1); across streams (whole sequences only), reset the
        destination stream to the source's cells of ``seq_id_src`` and queue the K/V copy."""
        self._check_seq(seq_id_src, "seq_id_src")
        self._check_seq(seq_id_dst, "seq_id_dst")
        s0, s1 = self.stream_of(seq_id_src), self.stream_of(seq_id_dst)
        if s0 == s1:
            self.streams[s0].copy(seq_id_src, seq_id_dst, p0, p1)
            return
        partial = any(p > 0 and p + 1 < self.size for p in (p0, p1))
        if partial:
            raise ValueError(f"seq_cp across streams copies whole sequences only: [{p0}, {p1}) is part "
                             f"of a stream of {self.size} cells")
        src, dst = self.streams[s0], self.streams[s1]
        dst.reset_cells()
        for i in range(self.size):
            if seq_id_src in src.seq[i]:
                dst.pos[i] = src.pos[i]
                dst.seq[i] = {seq_id_dst}
                dst.shift[i] = src.shift[i]
                dst.has_shift = dst.has_shift or src.shift[i] != 0
                if dst.ext is not None and src.ext is not None:
                    dst.ext[i] = src.ext[i]
        dst.head = src.head
        self._pending.append((s0, s1))

    def seq_keep(self, seq_id: int) -> None:
        """Keep only ``seq_id`` in its stream (other streams are not touched)."""
        self._check_seq(seq_id, "seq_id")
        self._table(seq_id).keep(seq_id)

    def seq_add(self, seq_id: int, p0: int, p1: int, shift: int) -> None:
        """Add ``shift`` to the positions of ``seq_id`` in [p0, p1); cells pushed below 0 empty."""
        self._check_seq(seq_id, "seq_id")
        self._table(seq_id).add(seq_id, p0, p1, shift)

    def seq_div(self, seq_id: int, p0: int, p1: int, d: int) -> None:
        """Divide the positions of ``seq_id`` in [p0, p1) by ``d`` (> 0)."""
        self._check_seq(seq_id, "seq_id")
        check_divisor(d)
        self._table(seq_id).divide(seq_id, p0, p1, d)

    def seq_pos_min(self, seq_id: int) -> int:
        """Smallest position of ``seq_id`` in its stream, -1 when it has none."""
        self._check_seq(seq_id, "seq_id")
        return self._table(seq_id).pos_min(seq_id)

    def seq_pos_max(self, seq_id: int) -> int:
        """Largest position of ``seq_id`` in its stream, -1 when it has none."""
        self._check_seq(seq_id, "seq_id")
        return self._table(seq_id).pos_max(seq_id)

    # --- update ---------------------------------------------------------------------------

    def k_shift(self) -> np.ndarray:
        """The K-shift input: int32 ``[n_stream * kv_size]``, stream-major, 0 for empty cells."""
        return np.concatenate([t.k_shift() for t in self.streams])

    def update(self) -> UpdateResult:
        """What llama_context runs before a decode: the queued stream copies (whole K and V
        slabs of every layer, in order), then the shift reset (no RoPE is applied here)."""
        had_shift = self.has_shift
        copies, self._pending = self._pending, []
        shift = self.k_shift()
        if not had_shift and not copies:
            return UpdateResult(STATUS_NO_UPDATE, False, 0, False, shift)
        for s0, s1 in copies:
            for il in self.layers:
                k = self._k[il]
                k[s1 * self.size:(s1 + 1) * self.size] = k[s0 * self.size:(s0 + 1) * self.size]
                v = self._v[il]
                if self.v_trans:
                    v[s1] = v[s0]
                else:
                    v[s1 * self.size:(s1 + 1) * self.size] = v[s0 * self.size:(s0 + 1) * self.size]
        if had_shift:
            for t in self.streams:
                t.reset_shift()
        return UpdateResult(STATUS_SUCCESS, had_shift, len(copies), self.has_shift, shift)

    # --- attention inputs -----------------------------------------------------------------

    def kq_mask(self, ub: Any, causal: bool = True, pad: bool = False, alibi: bool = False) -> np.ndarray:
        """The KQ mask, float32 ``[streams, rows, n_kv]``: 0 (``alibi``: ``-|p0 - p1|``) where a
        token sees a cell of its stream, -inf elsewhere. One stream: ``streams`` 1 and a row per
        token; several: a block per token group. ``n_kv`` is the largest over the ubatch's
        streams; ``pad`` adds -inf rows up to a multiple of 64 per stream (the seed's layout)."""
        pos, ids, groups = self._ubatch(ub)
        ext = self._ubatch_ext(ub, len(pos)) if getattr(ub, "pos_x", None) is not None else None
        n_kv_all = self.n_kv_per_stream
        n_kv = max(n_kv_all[strm] for strm, _ in groups)
        rows = len(groups[0][1])
        out = np.full((len(groups), _pad(rows, KQ_MASK_PAD) if pad else rows, n_kv), -np.inf, dtype=np.float32)
        for g, (_, toks) in enumerate(groups):
            for r, tok in enumerate(toks):
                s = ids[tok][0]
                t = self._table(s)
                out[g, r] = t.mask_row(s, pos[tok], n_kv, causal, alibi)
                if ext is not None and causal and t.ext is not None:
                    # M-RoPE: at the token's own position, the cells 2-D after it are hidden too
                    x, y, _ = ext[tok]
                    for i in range(n_kv):
                        cx, cy, _ = t.ext[i]
                        if t.pos[i] == pos[tok] and s in t.seq[i] and (cy > y or (cy == y and cx > x)):
                            out[g, r, i] = -np.inf
        return out

    def pos_bucket(self, ub: Any, n_buckets: int) -> np.ndarray:
        """T5 relative position buckets, int32 ``[n_tokens, n_kv]`` over stream 0 (one stream
        only; empty cells count as position -1)."""
        if self.n_stream != 1:
            raise ValueError("position buckets need a cache of one stream")
        pos, _, _ = self._ubatch(ub)
        t = self.streams[0]
        n_kv = self.n_kv_per_stream[0]
        return np.array([t.bucket_row(p, n_kv, n_buckets) for p in pos], dtype=np.int32).reshape(len(pos), n_kv)

    # --- K/V data ---------------------------------------------------------------------------

    def _check_layer(self, il: int) -> None:
        if il not in self._k:
            raise ValueError(f"layer {il} is not held by this cache (layers {list(self.layers)})")

    def k(self, il: int) -> np.ndarray:
        """K of model layer ``il``: ``[n_stream * kv_size, n_embd_k_gqa]`` (row ``stream * kv_size
        + cell``) of ``kvcache.view_dtype(type_k)`` (uint8 rows for block-quantized types)."""
        self._check_layer(il)
        return self._k[il].view(view_dtype(self._tk.id))

    def v(self, il: int) -> np.ndarray:
        """V of model layer ``il``: like ``k``, or transposed ``[n_stream, n_embd_v, kv_size]``
        (``n_embd_v`` the widest V row of the model)."""
        self._check_layer(il)
        if self.v_trans:
            v = self._v[il]
            return v.reshape(self.n_stream, self._v_width, -1).view(view_dtype(self._tv.id))
        return self._v[il].view(view_dtype(self._tv.id))

    # --- state blobs ------------------------------------------------------------------------

    @staticmethod
    def _check_layout(layout: str) -> None:
        if layout != "2026":
            raise ValueError(f"the reference model reads and writes layout '2026' only, got {layout!r}")

    def state_write(self, seq_id: int = -1, layout: str = "2026", prefix: bool = False) -> bytes:
        """The cache state of sequence ``seq_id`` (-1: the whole cache), as today's
        ``llama_state_seq_get_data`` has it after its sequence-blob prefix (prefix=True: with the
        prefix, the magic and the seq id, as that function returns it)."""
        self._check_layout(layout)
        self._check_seq(seq_id, "seq_id", allow_any=True)
        if prefix and seq_id < 0:
            raise ValueError("prefix=True: a whole-cache state (seq_id -1) has no sequence-blob prefix")
        out = bytearray(struct.pack("<Ii", 0xAF143CD8, seq_id) if prefix else b"")
        out += struct.pack("<I", self.n_stream)
        for s, t in enumerate(self.streams):
            if seq_id == -1:
                listed = [i for i in range(self.size) if not t.is_empty(i)]
            else:
                # the window is the sequence's as of its largest position (not max + 1)
                p_max = t.pos_max(seq_id)
                listed = [i for i in range(self.size) if not t.is_empty(i) and seq_id in t.seq[i]
                          and not t.is_masked_swa(t.pos[i], p_max)]
            out += struct.pack("<I", len(listed))
            if listed:
                out += self._cells_section(t, listed, seq_id)
                out += self._data_section(s, listed)
        return bytes(out)

    def _cells_section(self, t: _ExtTable, listed: list[int], seq_id: int) -> bytes:
        out = bytearray()
        for i in listed:
            ids = sorted(q for q in t.seq[i] if q < self.n_seq_max) if seq_id == -1 else [seq_id]
            out += struct.pack("<iI", t.pos[i], len(ids))
            if t.ext is not None:
                out += struct.pack("<3i", *t.ext[i])
            out += struct.pack(f"<{len(ids)}i", *ids)
        return bytes(out)

    def _data_section(self, s: int, listed: list[int]) -> bytes:
        rows = [s * self.size + i for i in listed]
        out = bytearray(struct.pack("<II", int(self.v_trans), len(self.layers)))
        for il in self.layers:
            out += struct.pack("<iQ", self._tk.id, self._k[il].shape[1])
            out += self._k[il][rows].tobytes()
        for il in self.layers:
            if self.v_trans:
                ne = self._n_embd_v[il]
                out += struct.pack("<iII", self._tv.id, self._tv.type_size, ne)
                out += self._v[il][s, :ne][:, listed].tobytes()
            else:
                out += struct.pack("<iQ", self._tv.id, self._v[il].shape[1])
                out += self._v[il][rows].tobytes()
        return bytes(out)

    def state_read(self, data: Any, seq_id: int = -1, layout: str = "2026") -> int:
        """Restore a state ``state_write`` wrote (bytes-like) into sequence ``seq_id`` (-1: the
        whole cache); returns the bytes it consumed (bytes after the state are not read).

        Raises :class:`kvcache.StateError` when the blob is malformed, cut short, written for
        another geometry or does not fit, and then nothing has changed (rule C7)."""
        self._check_layout(layout)
        self._check_seq(seq_id, "seq_id", allow_any=True)
        view = _view(data)
        saved = (copy.deepcopy(self.streams), list(self._pending),
                 {il: a.copy() for il, a in self._k.items()}, {il: a.copy() for il, a in self._v.items()})
        try:
            return self._read(_Reader(view, "cache state"), seq_id)
        except BaseException:
            self.streams, self._pending, self._k, self._v = saved
            raise

    def _read(self, r: _Reader, seq_id: int) -> int:
        n_stream = r.u32("the stream count")
        if n_stream != self.n_stream:
            raise StateError(f"n_stream mismatch: the state holds {n_stream} streams, the cache has "
                             f"{self.n_stream}")
        try:
            if seq_id == -1:
                self.clear()
            for s in range(n_stream):
                count = r.u32(f"the cell count of stream {s}")
                if count == 0:
                    continue
                strm = s if seq_id == -1 else self.stream_of(seq_id)
                if count > self.size:
                    raise StateError(f"stream {s} of the state holds {count} cells, a stream of the cache "
                                     f"{self.size}")
                if seq_id == -1:
                    cells = self._read_cells_whole(r, self.streams[strm], count)
                else:
                    cells = self._read_cells_seq(r, strm, count, seq_id)
                self._read_data(r, strm, cells)
        except StateError as e:
            raise StateError(f"failed to restore kv cache: {e}") from None
        return r.off

    def _read_ext(self, r: _Reader, t: _ExtTable, i: int) -> tuple[int, int, int] | None:
        if t.ext is None:
            return None
        return (r.i32(f"the x of cell {i}"), r.i32(f"the y of cell {i}"), r.i32(f"the token id of cell {i}"))

    def _read_cells_whole(self, r: _Reader, t: _ExtTable, count: int) -> list[int]:
        """Cell k of the section into cell k of the (cleared) stream."""
        for i in range(count):
            pos = r.i32(f"the position of cell {i}")
            n_ids = r.u32(f"the sequence count of cell {i}")
            ext = self._read_ext(r, t, i)
            if ext is not None and t.ext is not None:
                t.ext[i] = ext
            if pos < 0:
                raise StateError(f"cell {i} has position {pos}")
            if n_ids > self.n_seq_max:
                raise StateError(f"cell {i} lists {n_ids} sequences, the cache has {self.n_seq_max}")
            ids: set[int] = set()
            for _ in range(n_ids):
                q = r.i32(f"a sequence id of cell {i}")
                if not 0 <= q < self.n_seq_max or q in ids:
                    raise StateError(f"cell {i} lists sequence id {q} twice or outside [0, {self.n_seq_max})")
                ids.add(q)
            t.pos[i], t.seq[i] = pos, ids
        t.head = 0
        return list(range(count))

    def _read_cells_seq(self, r: _Reader, strm: int, count: int, seq_id: int) -> list[int]:
        """The cells placed as one ubatch of ``seq_id`` after removing the sequence."""
        t = self.streams[strm]
        t.remove(seq_id, -1, -1)
        pos: list[int] = []
        exts: list[tuple[int, int, int]] = []
        for i in range(count):
            p = r.i32(f"the position of cell {i}")
            n_ids = r.u32(f"the sequence count of cell {i}")
            if n_ids != 1:
                raise StateError(f"cell {i} of a sequence's state lists {n_ids} sequences, not 1")
            ext = self._read_ext(r, t, i)
            if ext is not None:
                exts.append(ext)
            r.i32(f"the sequence id of cell {i}")     # the destination id replaces it
            if p < 0:
                raise StateError(f"cell {i} has position {p}")
            pos.append(p)
        groups: list[_Group] = [(strm, list(range(count)))]
        slot = self._find_slot(groups)
        if slot is None:
            raise StateError(f"failed to find {count} available cells in kv cache")
        # placed as a ubatch, then the saved extensions put back into the cells it took
        self._apply(slot, groups, pos, [[seq_id]] * count, exts or None)
        return [int(c) for c in slot[0][1]]

    def _read_data(self, r: _Reader, strm: int, cells: list[int]) -> None:
        n = len(cells)
        rows = [strm * self.size + c for c in cells]
        v_trans = r.u32("the V layout")
        n_layer = r.u32("the layer count")
        if n_layer != len(self.layers):
            raise StateError(f"the state holds {n_layer} layers, the cache {len(self.layers)}")
        if v_trans != int(self.v_trans):
            raise StateError(f"the state's V is {'' if v_trans else 'not '}transposed, the cache's "
                             f"{'is' if self.v_trans else 'is not'}")
        for il in self.layers:
            self._expect(r.i32(f"the K type of layer {il}"), self._tk.id, f"the K type of layer {il}")
            row = self._k[il].shape[1]
            self._expect(r.u64(f"the K row size of layer {il}"), row, f"the K row size of layer {il}")
            self._k[il][rows] = np.frombuffer(r.take(n * row, f"the K rows of layer {il}"), np.uint8).reshape(n, row)
        for il in self.layers:
            self._expect(r.i32(f"the V type of layer {il}"), self._tv.id, f"the V type of layer {il}")
            if self.v_trans:
                es, ne = self._tv.type_size, self._n_embd_v[il]
                self._expect(r.u32(f"the V element size of layer {il}"), es, f"the V element size of layer {il}")
                self._expect(r.u32(f"the V width of layer {il}"), ne, f"the V width of layer {il}")
                block = np.frombuffer(r.take(ne * n * es, f"the V elements of layer {il}"), np.uint8)
                self._v[il][strm][:ne, cells] = block.reshape(ne, n, es)
            else:
                row = self._v[il].shape[1]
                self._expect(r.u64(f"the V row size of layer {il}"), row, f"the V row size of layer {il}")
                self._v[il][rows] = np.frombuffer(r.take(n * row, f"the V rows of layer {il}"), np.uint8).reshape(n, row)

    @staticmethod
    def _expect(got: int, want: int, what: str) -> None:
        if got != want:
            raise StateError(f"{what} is {got} in the state, {want} in the cache")

    def __repr__(self) -> str:
        return (f"UnifiedReference2026(kv_size={self.size}, n_stream={self.n_stream}, heads={list(self.heads)}, "
                f"used={list(self.used_per_stream)}, n_seq_max={self.n_seq_max})")
