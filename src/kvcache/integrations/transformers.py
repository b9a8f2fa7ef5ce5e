"""A transformers ``Cache`` over kvcache: ``model.generate(..., cache=cache)`` (the keyword of
transformers 5.24 and later; ``past_key_values=cache`` before) with the cells kept by a :class:`~kvcache.UnifiedCache` (full attention) or an
:class:`~kvcache.ISWACache` (models with sliding-window layers, or chunked-attention layers:
a window of the chunk size, as transformers' own caches keep them).

``from_model(model, n_ctx=...)`` builds one. Each row of the batch is one kvcache sequence (row b
= sequence b) and each of transformers' cache indices one cell (left-padding tokens included,
as transformers stores them), at the kvcache position equal to that index, so kvcache's causal
and sliding-window rules are the ones transformers' masks apply. The kvcache cache keeps the
cells only (metadata mode); K/V live in one CPU torch tensor per kvcache part, head by head as
attention reads them. ``update`` writes the new rows there and returns views when the cells of
every row lie in the layout a fresh cache gives them (cell = index * batch + row), a gather of
exactly the expected keys otherwise (sliding layers, whose cells are reused; a cache restored
elsewhere). While rows are short (up to CAT_MAX indices, autograd off) the full-attention
layers' K/V grow by concatenation instead, as a ``DynamicCache``'s (cheaper there than a write
and a view), and go into the tensor when the rows grow past that or anything else needs them
there; a UnifiedCache's forwards of such rows are placed in kvcache when it is next consulted
(``kv``), in one call. State blobs hold the K/V as kvcache rows (``v_trans=False``), as a plain
kvcache cache's. Anything that would not give transformers exactly the keys it expects raises
instead. Needs ``torch`` and ``transformers`` 5.x."""
from __future__ import annotations

import contextlib
import operator
import weakref
from typing import Any, Iterator, cast

import numpy as np
import torch  # type: ignore[import-not-found,unused-ignore]
import torch.utils.dlpack  # type: ignore[import-not-found,unused-ignore]
from transformers import Cache  # type: ignore[import-not-found,import-untyped,unused-ignore]

from kvcache._core import MAX_SEQ, UBatch, int_arg
from kvcache.geometry import hf_attention
from kvcache.iswa import ISWACache2025
from kvcache.plan import _pad, swa_size
from kvcache.unified import UnifiedCache2025

__all__ = ["KVCache", "from_model"]

_TYPES = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
# cache indices per row up to which the full-attention layers' K/V grow by concatenation (see
# KVCache._cat): below about this length one concatenation per tensor costs less than a write
# and a view of the cache's tensor; above, its copies cost more
CAT_MAX = 1024
_POS_END = 2**31 - 1       # cache indices per row are kvcache positions (int32)


def _batch_size(v: Any) -> int:
    """The batch_size argument: rows are kvcache sequences, 1 to MAX_SEQ of them."""
    return int_arg(v, "batch_size", 1, MAX_SEQ)


class _Layer:
    """What transformers reads off a cache layer (``Cache.is_sliding`` and the properties beside
    it): one per model layer. Its ``keys`` and ``values`` are read from the cache."""
    supports_early_init = False
    is_initialized = True
    is_compileable = False          # update returns exactly the keys written: the masks may be skipped
    is_croppable = True

    def __init__(self, sliding_window: int | None, cache: KVCache, layer_idx: int):
        self.is_sliding = sliding_window is not None
        self.sliding_window = sliding_window
        self._cache = weakref.ref(cache)     # no cycle: the cache is freed when its last user lets go
        self._layer_idx = layer_idx
        # transformers' flag (assisted decoding sets it, and clears it when done): a sliding
        # layer keeps what its window has left until crop, so that crop can undo forwards
        self.record_past = False

    def activate_past_recording(self, recurrent_states_to_keep: int | None = None) -> None:
        """A sliding layer keeps the positions its window leaves until the next crop (see
        record_past); a full-attention layer keeps everything anyway. recurrent_states_to_keep
        (passed from transformers 5.25 on) sizes a recurrent layer's history: these layers have
        none, so it changes nothing."""
        self.record_past = self.is_sliding

    @property
    def keys(self) -> torch.Tensor | None:
        """The layer's keys, [rows, kv heads, indices, head dim], as the next one-token forward
        attends to them besides its own (a sliding layer: the last window - 1); None before the
        first update."""
        cache = self._cache()
        return None if cache is None else cache._layer_kv(self._layer_idx, 0)

    @property
    def values(self) -> torch.Tensor | None:
        """The layer's values, as ``keys``."""
        cache = self._cache()
        return None if cache is None else cache._layer_kv(self._layer_idx, 1)

    def __repr__(self) -> str:
        return f"kvcache layer (sliding window {self.sliding_window})" if self.is_sliding else "kvcache layer"


class KVCache(Cache):  # type: ignore[misc,unused-ignore]
    """transformers' ``Cache`` contract over a kvcache cache, created on the first ``update``
    (when the batch size and dtype are known) or up front with ``batch_size`` and ``dtype``.

    n_ctx: cache indices per batch row (prompt, left padding and new tokens); the cache has
    ``n_ctx * batch_size`` cells (rounded up to n_pad). n_batch (sliding-window models): the
    most tokens one forward places (batch rows times new tokens), which sizes the window
    cache (default: everything, n_ctx * batch_size). CPU tensors of float32, float16 or
    bfloat16 only. ``kv`` is the kvcache cache (None until created; metadata mode: it keeps the
    cells, the K/V are this Cache's tensors): row b is its sequence b, cache index j its
    position j; consulted, it holds every index this Cache holds."""

    def __init__(self, config: Any, n_ctx: int, *, batch_size: int | None = None, dtype: torch.dtype | None = None,
                 n_batch: int | None = None, n_pad: int = 32):
        _, _, n_kv, head_dim, self._window, self._types = hf_attention(config, chunked_as_sliding=True)
        self._config = config
        sliding = [t == "sliding_attention" for t in self._types]
        super().__init__(layers=[_Layer(self._window if s else None, self, il)   # type: ignore[arg-type,misc,unused-ignore]
                                 for il, s in enumerate(sliding)])
        self._heads = (n_kv, head_dim)
        self._n_layers = len(self._types)
        # checked here, by the rule of kvcache's own constructors, so that a bad size is refused
        # by name now rather than truncated or refused at the first update
        self._n_ctx = int_arg(n_ctx, "n_ctx", 1, _POS_END)
        self._cat_max = min(CAT_MAX, self._n_ctx)
        self._n_batch = None if n_batch is None else int_arg(n_batch, "n_batch", 1, _POS_END)
        self._n_pad = int_arg(n_pad, "n_pad", 1, 2**32 - 1)
        self._kv: UnifiedCache2025 | ISWACache2025 | None = None
        # indices per row (the last ones) update has not placed in _kv yet: forwards of short
        # rows on a UnifiedCache, whose placement waits until _kv is next consulted (see kv)
        self._unplaced = 0
        self._kv_args: dict[str, Any] = {}     # kv's arguments (its twin's, with K/V of its own)
        self._row_list: list[int] = []
        self._rows = 0              # batch rows = sequences 0 .. rows - 1
        self._n = 0                 # cache indices per row, the current forward's included
        self._strided = True        # cell of (index j, row b) is j * rows + b in the full-attention cache
        self._gather: dict[int, torch.Tensor] = {}   # per kvcache part (id) of this forward: [rows, kv_len]
        self._k: list[torch.Tensor] = []             # per layer: its K, [kv heads, cells, head dim]
        self._v: list[torch.Tensor] = []
        # the full-attention layers' K and V (layer i of the part at 2i and 2i + 1) over the
        # strided layout as transformers reads them, [2 * layers, row, head, index, dim]
        self._full5: torch.Tensor | None = None
        # while rows are short (n <= CAT_MAX, strided layout, autograd off): per full-attention
        # layer its K and V as transformers reads them ([rows, heads, index, dim], at _at[il] and
        # _at[il] + 1), grown by concatenation as a DynamicCache's, the full-attention tensor not
        # yet written; None once they went into their cells there (_spill), for good until reset
        self._cat: list[torch.Tensor] | None = None
        self._at: list[int] = []    # per layer: its K's place in _full5, -1 for a sliding layer
        # per layer: (part, plane of its K) in _stores, part 0 full attention, 1 the window
        self._where: list[tuple[int, int]] = []
        self._full_part: UnifiedCache2025 | None = None
        # the K/V tensors (full-attention part, window part; None where none)
        self._stores: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)
        self._history = False       # a forward with autograd on wrote K/V that require grad
        # the K/V shape (rows, kv heads, tokens, head dim) and dtype last checked: update checks
        # no further while they stay
        self._shape: torch.Size | None = None
        self._dtype: torch.dtype | None = None
        self._placed: set[int] = set()   # layers written in the forward under way
        self._pending = False            # a placement of the window cache (iSWA) is not committed yet
        self._forward_clear()
        if batch_size is not None or dtype is not None:
            if batch_size is None or dtype is None:
                raise ValueError("batch_size and dtype go together (both create the cache now)")
            self._create(_batch_size(batch_size), dtype)

    def _forward_clear(self) -> None:
        """No forward under way: the next update places one."""
        self._placed.clear()
        self._q = 0
        self._next = -1             # the layer after those of the forward so far, while they came in order
        # the forward's views of _full5 (strided layout only): every layer's keys, the new rows' place
        self._ret: tuple[torch.Tensor, ...] | None = None
        self._dst: tuple[torch.Tensor, ...] | None = None
        self._catting = False       # the forward's full-attention layers concatenate (see _cat)
        # the layer update's hot path takes next, -1 for none: while a UnifiedCache's rows are
        # short (see _cat) and the layers come in order with K/V as checked last, each forward's
        # layer 0 counting its indices as unplaced (_short_forward), update concatenates and
        # nothing more
        self._short = -1

    # --- the kvcache cache -------------------------------------------------------------------
    def _create(self, rows: int, dtype: torch.dtype) -> None:
        if dtype not in _TYPES:
            raise TypeError(f"K/V of dtype {dtype}: kvcache keeps float32, float16 or bfloat16")
        if rows < 1:
            raise ValueError(f"batch_size = {rows}: expected at least 1 row")
        n_kv, head_dim = self._heads
        width = n_kv * head_dim
        n_layer = len(self._types)
        kv_size = _pad(self._n_ctx * rows, self._n_pad)
        common: dict[str, Any] = dict(kv_size=kv_size, n_layer=n_layer, n_embd_k_gqa=width, n_embd_v_gqa=width,
                                      type_k=_TYPES[dtype], type_v=_TYPES[dtype], v_trans=False, n_seq_max=rows,
                                      n_pad=self._n_pad)
        swa = [il for il, t in enumerate(self._types) if t == "sliding_attention"]
        full = [il for il in range(n_layer) if il not in swa]
        n_batch = self._n_batch if self._n_batch is not None else self._n_ctx * rows
        if swa:
            common.update(swa_layers=swa, n_swa=self._window, swa_type="standard", n_batch=n_batch, swa_full=False)
        # kvcache keeps the cells only (metadata mode); the K/V are one torch tensor per part,
        # [2 * its layers, kv heads, cells, head dim] (K of its layer i at 2i, V at 2i + 1): head
        # by head, as attention reads them (over kvcache's rows of all heads of a cell, the
        # attention of a long context reads slower); state_write / state_read carry them
        # through a twin that holds them as kvcache rows (_twin)
        self._kv_args = common
        self._kv = (ISWACache2025 if swa else UnifiedCache2025)(buffers=None, **common)
        self._unplaced = 0
        self._full_part = self._full()
        self._rows = rows
        self._row_list = list(range(rows))      # the sequences of one cache index, in row order
        self._at = [2 * full.index(il) if il in full else -1 for il in range(n_layer)]
        self._where = [(0, self._at[il]) if self._at[il] >= 0 else (1, 2 * swa.index(il)) for il in range(n_layer)]
        # normal tensors (and views), which forwards in any mode can write
        with torch.inference_mode(False) if torch.is_inference_mode_enabled() else contextlib.nullcontext():
            full_t = torch.zeros(2 * len(full), n_kv, kv_size, head_dim, dtype=dtype) if full else None
            window_t = None
            if swa:
                size_swa = swa_size(kv_size, self._window, rows, n_batch, self._n_pad, False)
                window_t = torch.zeros(2 * len(swa), n_kv, size_swa, head_dim, dtype=dtype)
            self._stores = (full_t, window_t)
            # each layer's K and V, [kv heads, cells, head dim]
            views = (full_t.unbind(0) if full_t is not None else (), window_t.unbind(0) if window_t is not None else ())
            self._k = [views[part][j] for part, j in self._where]
            self._v = [views[part][j + 1] for part, j in self._where]
            self._full5 = None
            if full_t is not None:
                cap = kv_size // rows
                if cap * rows != kv_size:
                    full_t = full_t.narrow(2, 0, cap * rows)
                # cell j * rows + b is index j of row b: [2 * layers, heads, cap, rows, dim] ->
                # [2 * layers, rows, heads, cap, dim]
                self._full5 = full_t.view(2 * len(full), n_kv, cap, rows, head_dim).permute(0, 3, 1, 2, 4)
        self._cat_start()

    def _cat_start(self) -> None:
        """Empty rows: the full-attention layers' K/V start out concatenated (see _cat)."""
        full5 = self._full5
        self._cat = None
        if full5 is not None:
            rows, n_kv, _, head_dim = full5.shape[1:]
            self._cat = [torch.empty(rows, n_kv, 0, head_dim, dtype=full5.dtype)] * full5.shape[0]

    def _spill(self) -> None:
        """The concatenated K/V (if any) into their cells in the tensor, where they stay from now
        on (see _cat)."""
        cat, full, store, full5 = self._cat, self._full_part, self._stores[0], self._full5
        if cat is None:
            return
        if self._unplaced:
            self._place_unplaced()
        n = cat[0].shape[2]
        # outside the strided layout: [rows, n] cells of indices 0 .. n - 1 (checked)
        idx = self._indices(full, 0)[:, :n] if n and not self._strided and full is not None else None
        self._cat = None
        self._catting = False
        if self._short >= 0:
            self._short_end()
        if n and store is not None and full5 is not None:
            with torch.no_grad():
                for at, t in enumerate(cat):
                    if idx is None:
                        full5[at].narrow(2, 0, n).copy_(t)
                    else:
                        store.select(0, at)[:, idx] = t.transpose(0, 1)

    def _twin(self) -> UnifiedCache2025 | ISWACache2025:
        """An empty kvcache cache like kv that holds K/V of its own (kvcache rows): the state
        blobs' K/V pass through it (_rows_to)."""
        return (ISWACache2025 if "swa_layers" in self._kv_args else UnifiedCache2025)(**self._kv_args)

    def _rows_to(self, twin: UnifiedCache2025 | ISWACache2025, into_twin: bool) -> None:
        """Copy every row's K/V between this cache's tensors and twin's kvcache rows (into_twin:
        to twin), cell for cell of the same row and cache index in the two."""
        n_kv, head_dim = self._heads
        dtype = self._k[0].dtype
        cells: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}    # per part: (its cells, twin's)
        for il in range(self._n_layers):
            part, twin_part = self._part(il), (twin.cache_of(il) if isinstance(twin, ISWACache2025) else twin)
            if id(part) not in cells:
                ours_c, theirs_c = [], []
                for b in range(self._rows):
                    c, pos = part.seq_cells(b)
                    tc, tpos = twin_part.seq_cells(b)
                    if not np.array_equal(pos, tpos):
                        raise RuntimeError(f"kvcache placed row {b}'s cells unlike its twin")
                    ours_c.append(c)
                    theirs_c.append(tc)
                cells[id(part)] = (torch.from_numpy(np.concatenate(ours_c).astype(np.int64)),
                                   torch.from_numpy(np.concatenate(theirs_c).astype(np.int64)))
            ours, theirs = cells[id(part)]
            at = self._at[il]
            for i in (0, 1):
                # the twin's rows without a copy, [cells, heads, dim]
                rows = twin_part.k(il) if i == 0 else twin_part.v(il)
                t = torch.utils.dlpack.from_dlpack(rows).view(-1, n_kv, head_dim)
                if t.dtype != dtype:
                    t = t.view(dtype)       # bf16 rows come as uint16 where ml_dtypes is not installed
                with torch.no_grad():
                    if into_twin and self._cat is not None and at >= 0:
                        # concatenated K/V (see _cat), read where they are: a save is no reason
                        # to move them, and mid-forward the layers not yet written hold fewer
                        # indices (while _cat holds them, row b's cells are its indices 0 .. n - 1)
                        src = self._cat[at + i]                              # [rows, heads, m, dim]
                        dst = theirs.view(self._rows, -1)[:, :src.shape[2]].reshape(-1)
                        t[dst] = src.transpose(1, 2).reshape(-1, n_kv, head_dim)
                    elif into_twin:
                        t[theirs] = self._plane(il, i)[:, ours].transpose(0, 1)   # [heads, cells, dim]
                    else:
                        plane = self._plane(il, i)
                        plane[:, ours] = t[theirs].transpose(0, 1)

    def _forget_history(self) -> None:
        """Drop the autograd history of the K/V tensors: a write without autograd (a forward
        under no_grad or inference_mode, a reorder, a restore) makes it wrong for the rows it
        writes, and a DynamicCache's keys lose theirs at such a forward too."""
        with torch.inference_mode(False):      # detach_ does nothing in inference mode
            for t in self._stores:
                if t is not None:
                    t.detach_()
        self._history = False

    def _plane(self, il: int, i: int) -> torch.Tensor:
        """Layer il's K (i = 0) or V (i = 1), [kv heads, cells, head dim]. With autograd on, a view made
        now: a forward writes and reads the tensors through views made after its previous
        write, since autograd refuses in-place writes through older views of a tensor that had
        no history then (and the views of unbind altogether), and reads through them would
        miss the rows' history. Otherwise the views made with the cache. A full-attention
        layer's K/V still concatenated go into the tensor first."""
        if self._cat is not None and self._at[il] >= 0:
            self._spill()
        if not torch.is_grad_enabled():
            return (self._k, self._v)[i][il]
        part, j = self._where[il]
        store = self._stores[part]
        assert store is not None
        return store.select(0, j + i)

    def _part(self, il: int) -> UnifiedCache2025:
        kv = self.kv
        assert kv is not None
        # the parts of the ISWACache2025 this Cache makes
        return cast(UnifiedCache2025, kv.cache_of(il)) if isinstance(kv, ISWACache2025) else kv

    def _window_part(self) -> UnifiedCache2025 | None:
        """The sliding-window part (None without sliding layers or before the first update)."""
        kv = self.kv
        if not isinstance(kv, ISWACache2025) or "sliding_attention" not in self._types:
            return None
        return cast(UnifiedCache2025, kv.cache_of(self._types.index("sliding_attention")))

    def _full(self) -> UnifiedCache2025 | None:
        """The full-attention part (None when every layer slides)."""
        kv = self.kv
        if isinstance(kv, ISWACache2025):
            return cast(UnifiedCache2025, kv.base) if kv.base_layers else None
        return kv

    def _forward_q(self) -> int:
        """Indices per row of the forward under way while some of its layers are not written yet
        (update called for some layers of a step, not all), else 0."""
        if self._short >= 0:
            return self._q if self._short else 0      # the hot path: layers 0 .. _short - 1 written
        placed = self._placed
        return self._q if placed and len(placed) < self._n_layers else 0

    def _not_mid_forward(self, what: str) -> None:
        """RuntimeError, changing nothing, when what cannot be done while a forward is under way."""
        q = self._forward_q()
        if q:
            raise RuntimeError(f"{what} during a forward: {q} new indices per row are written for some layers, "
                               f"not yet for the others; call it between forwards (after a forward that raised "
                               f"part way, state_read(state_write()) drops that forward)")

    def _commit(self) -> None:
        """End the forward under way (if any): its placement is kept."""
        if self._pending:
            assert self.kv is not None
            self.kv.commit()
            self._pending = False
        self._gather.clear()
        self._forward_clear()

    def _offset(self, layer_idx: int, n: int) -> int:
        """First cache index the layer attends to with n indices already stored."""
        if self._types[layer_idx] == "sliding_attention":
            return max(n - self._window + 1, 0)
        return 0

    def _place(self, q: int) -> None:
        """One forward's q new indices of every row: one ubatch, index-major (row b of index j
        is token j * rows + b), placed as one run of cells."""
        kv = self.kv
        assert kv is not None
        if self._pending:
            self._commit()
        else:
            self._placed.clear()
            if self._gather:
                self._gather.clear()
            self._ret = self._dst = None
            self._catting = False
        rows, n = self._rows, self._n
        if n + q > self._n_ctx:
            raise ValueError(f"the cache holds {self._n_ctx} indices per row; {n} are used and {q} more came")
        head: int | None
        if isinstance(kv, ISWACache2025):
            # plain lists: UBatch reads them fastest
            pos = [n] * rows if q == 1 else [j for j in range(n, n + q) for _ in range(rows)]
            seq = self._row_list * q
            if not self._recording():
                kv.sbatch_init(pos, seq)  # the window slides on commit (recording: at crop)
            self._pending = kv.find_slot(UBatch(pos, seq))
            full = self._full_part
            slot = full.slot if self._pending and full is not None else None
            head = None if not self._pending else n * rows if full is None else slot[0] if slot is not None else -1
        else:
            # one call, no UBatch: index n .. n + q - 1 of every row, placed and committed
            head = kv.place_seqs(n, q, rows)
        if head is None:
            raise RuntimeError(f"kvcache found no room for {rows * q} cells (n_ctx={self._n_ctx}, n_batch="
                               f"{self._n_batch})")
        if head != n * rows:
            self._strided = False
        self._q = q
        self._n = n + q
        grad = torch.is_grad_enabled()
        if self._history and not grad:
            self._forget_history()
        full5 = self._full5
        if self._cat is not None:
            if self._strided and not grad and n + q <= self._cat_max:
                self._catting = True
                return
            self._spill()
        if self._strided and full5 is not None and not grad:
            # every full-attention layer's views for this forward, two calls each (with
            # autograd on, update takes the general path: see _plane)
            self._ret = full5.narrow(3, 0, n + q).unbind(0)
            self._dst = full5.narrow(3, n, q).unbind(0)

    def _short_fits(self, q: int) -> bool:
        """Whether a new forward of q indices per row takes update's hot path (see _short): the
        rows stay short, autograd off. Else update takes its general path."""
        return self._n + q <= self._cat_max and not torch.is_grad_enabled()

    def _short_forward(self, q: int) -> None:
        """update's hot path (see _short): a new forward of q indices per row (see _short_fits),
        its placement waiting until kv is consulted (see kv)."""
        self._unplaced += q
        self._q = q
        self._n += q

    def _unplace(self, n: int, q: int, strided: bool) -> None:
        """Take back what _place placed (update failed after it): the forward's cells freed,
        the length, forward size and layout as they were, no forward under way."""
        kv = self._kv
        if isinstance(kv, ISWACache2025):
            kv.restore()                # the cells as before this call's find_slot (if any), the window's too
            self._pending = False
            if not self._recording():
                kv.sbatch_init([], [])  # no window slide due at the next commit
        elif kv is not None:
            for b in range(self._rows):
                kv.seq_rm(b, n, -1)     # place_seqs commits: its cells are freed instead
        self._gather.clear()
        self._forward_clear()
        self._n, self._q, self._strided = n, q, strided

    @property
    def kv(self) -> UnifiedCache2025 | ISWACache2025 | None:
        """The kvcache cache (None until created), with every index this Cache holds placed."""
        if self._unplaced:
            self._place_unplaced()
        return self._kv

    def _place_unplaced(self) -> None:
        """Place the indices update's hot path left unplaced (see _short_forward): one call for
        any number of forwards, the cells those forwards would have got one by one."""
        kv, q, rows = self._kv, self._unplaced, self._rows
        assert isinstance(kv, UnifiedCache2025)     # the hot path's cache (see _short)
        n = self._n - q
        head = kv.place_seqs(n, q, rows)
        if head is None:
            raise RuntimeError(f"kvcache found no room for indices {n} .. {self._n - 1} of {rows} rows (its cells "
                               f"were changed besides this Cache)")
        self._unplaced = 0
        if head != n * rows:
            self._strided = False

    def _short_end(self) -> None:
        """Leave update's hot path: what the general path keeps of the forward so far (the
        hot path keeps _short alone)."""
        short = self._short
        self._short = -1
        self._placed = set(range(short)) if short else set(range(self._n_layers))
        self._next = short if short else -1

    def _indices(self, part: UnifiedCache2025, lo: int) -> torch.Tensor:
        """[rows, n - lo] cells of indices lo .. n - 1 of every row, checked."""
        key = id(part)
        idx = self._gather.get(key)
        if idx is None or idx.shape[1] != self._n - lo:
            want = np.arange(lo, self._n, dtype=np.int32)
            out = np.empty((self._rows, self._n - lo), dtype=np.int64)
            for b in range(self._rows):
                cells, pos = part.seq_cells(b)
                k = int(np.searchsorted(pos, lo))
                if not np.array_equal(pos[k:], want):
                    raise RuntimeError(f"kvcache holds positions {pos[k:].tolist()[:8]}... of row {b}, the "
                                       f"attention expects {lo} .. {self._n - 1}")
                out[b] = cells[k:]
            idx = torch.from_numpy(out)
            self._gather[key] = idx
        return idx

    def _check(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """update's checks of K/V of a shape, dtype or device other than those checked last:
        raises, changing nothing, on K/V the cache cannot take (it creates the cache on the
        first K/V)."""
        if not isinstance(key_states, torch.Tensor) or not isinstance(value_states, torch.Tensor):
            raise TypeError(f"K/V must be torch tensors, not {type(key_states).__name__} / "
                            f"{type(value_states).__name__}")
        if key_states.device.type != "cpu" or value_states.device.type != "cpu":
            raise NotImplementedError(f"K/V on {key_states.device}: this cache keeps CPU tensors (for K/V on a "
                                      f"device, use kvcache's metadata-only mode, see docs/torch.md)")
        if key_states.dim() != 4 or value_states.shape != key_states.shape:
            raise ValueError(f"K/V of shape {tuple(key_states.shape)} / {tuple(value_states.shape)}: expected "
                             f"[rows, kv heads, tokens, head dim], both alike")
        rows, n_kv, q, head_dim = key_states.shape
        if (n_kv, head_dim) != self._heads or q < 1:
            raise ValueError(f"K/V of shape {tuple(key_states.shape)}: the config says {self._heads[0]} kv heads "
                             f"of {self._heads[1]}")
        if value_states.dtype != key_states.dtype:
            raise TypeError(f"key_states and value_states must have one dtype, not {key_states.dtype} and "
                            f"{value_states.dtype}")
        if self.kv is None:
            self._create(rows, key_states.dtype)
        if rows != self._rows:
            raise ValueError(f"batch of {rows} rows; the cache holds {self._rows}")
        if key_states.dtype != self._k[0].dtype:
            raise TypeError(f"K/V of dtype {key_states.dtype}; the cache holds {self._k[0].dtype}")
        self._shape, self._dtype = key_states.shape, key_states.dtype
        if self._short >= 0:
            self._short_end()
        self._next = -1             # the forward under way (if any) sees other K/V: update decides

    # --- transformers' Cache -----------------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new K/V of layer_idx ([rows, kv_heads, q, head_dim], rotated) and return the
        layer's keys and values from get_mask_sizes' kv_offset on, in cache-index order."""
        # K/V as checked last (shape, dtype, CPU) and the layer after the forward's so far: a
        # decode step's later layers take the hot path, nothing more to check or place
        shape = self._shape
        if (key_states.shape != shape or value_states.shape != shape or key_states.dtype is not self._dtype
                or value_states.dtype is not self._dtype or not (key_states.is_cpu and value_states.is_cpu)):
            layer_idx = self._layer_arg(layer_idx)      # before _check creates the cache
            if self._kv is None:
                return self._first_update(key_states, value_states, layer_idx)
            self._check(key_states, value_states)
            shape = self._shape
        short = self._short
        # an int only: a float equal to the layer would reach list indices after the placement
        if layer_idx == short and short >= 0 and type(layer_idx) is int and (
                layer_idx or self._short_fits(shape[2])):   # type: ignore[index]
            # short rows of a UnifiedCache, the layers in order (see _short); the concatenation
            # first, so that K/V it refuses leave the cache as it was
            k, v = self._concat(2 * layer_idx, key_states, value_states)
            if not layer_idx:
                self._short_forward(shape[2])   # type: ignore[index]
            nxt = layer_idx + 1
            self._short = nxt if nxt < self._n_layers else 0
            return k, v
        if type(layer_idx) is not int:
            layer_idx = self._layer_arg(layer_idx)
        if short >= 0:
            self._short_end()
        placed = self._placed
        undo: tuple[int, int, bool] | None = None
        nxt = self._next
        if layer_idx == nxt and nxt >= 0:
            in_order = True             # the layer after those of the forward so far, in order from 0
        else:
            if not 0 <= layer_idx < self._n_layers:
                raise IndexError(f"layer {layer_idx}: the model has {self._n_layers} layers")
            assert shape is not None
            if not placed or layer_idx in placed:
                undo = (self._n, self._q, self._strided)    # the first layer of a new forward
                in_order = layer_idx == 0
            elif shape[2] != self._q:
                raise ValueError(f"layer {layer_idx} brings {shape[2]} indices, the forward {self._q}")
            else:
                in_order = False        # one more layer of the forward under way, in another order
        try:
            if undo is not None:
                self._place(shape[2])   # type: ignore[index]
            at = self._at[layer_idx]
            dst = self._dst
            if self._catting and at >= 0:
                k, v = self._concat(at, key_states, value_states)
            elif dst is not None and at >= 0:
                # the new rows into their cells (index n - q .. n - 1 of every row), the keys as views
                dst[at].copy_(key_states)
                dst[at + 1].copy_(value_states)
                ret = self._ret
                k, v = ret[at], ret[at + 1]   # type: ignore[index]
            else:
                k, v = self._gathered(layer_idx, key_states, value_states)
        except BaseException:
            # no room, or K/V the writes refuse (a tensor subclass, say): the forward this call
            # placed is taken back; a later layer's cells hold nothing of use until it is written
            if undo is not None:
                self._unplace(*undo)
            raise
        placed.add(layer_idx)
        if self._pending and len(placed) == self._n_layers:
            self._commit()              # the window cache slides now
        else:
            self._next = layer_idx + 1 if in_order and layer_idx + 1 < self._n_layers else -1
        if self._catting and in_order and not isinstance(self.kv, ISWACache2025):
            self._short = self._next if self._next >= 0 else 0     # the hot path takes over
        return k, v

    def _layer_arg(self, layer_idx: Any) -> int:
        """update's layer index: an int (or what stands for one) of a layer of the model, else
        TypeError / IndexError."""
        try:
            il = operator.index(layer_idx)
        except TypeError:
            raise TypeError(f"layer_idx must be an int, not {type(layer_idx).__name__}") from None
        if not 0 <= il < self._n_layers:
            raise IndexError(f"layer {il}: the model has {self._n_layers} layers")
        return il

    def _first_update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """update of a cache not created yet: created for these K/V; if the update then fails,
        not created after all."""
        before = dict(self.__dict__)
        try:
            self._check(key_states, value_states)
            return self.update(key_states, value_states, layer_idx)
        except BaseException:
            self.__dict__.clear()
            self.__dict__.update(before)
            raise

    def _concat(self, at: int, key_states: torch.Tensor, value_states: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Short rows (see _cat): the new rows concatenated to the keys and values at at, at + 1
        of _cat, as a DynamicCache's; the results, kept and returned."""
        cat = self._cat
        assert cat is not None
        k = torch.cat((cat[at], key_states), 2)
        v = torch.cat((cat[at + 1], value_states), 2)
        cat[at], cat[at + 1] = k, v     # both or neither
        return k, v

    def _gathered(self, layer_idx: int, key_states: torch.Tensor, value_states: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """update's general path: the new rows into the cells placed, the keys gathered."""
        rows, n_kv, q, head_dim = key_states.shape
        part = self._part(layer_idx)
        slot = part.slot
        assert slot is not None
        head, n_cells = slot
        new = slice(head, head + n_cells)
        idx = self._indices(part, self._offset(layer_idx, self._n - q))
        # token j * rows + b of the ubatch (index n - q + j of row b) is cell head + j * rows + b
        self._plane(layer_idx, 0)[:, new].view(n_kv, q, rows, head_dim).copy_(key_states.permute(1, 2, 0, 3))
        v_rows = self._plane(layer_idx, 1)
        v_rows[:, new].view(n_kv, q, rows, head_dim).copy_(value_states.permute(1, 2, 0, 3))
        k_rows = self._plane(layer_idx, 0)          # after the writes (see _plane)
        if torch.is_grad_enabled():
            self._history = self._history or key_states.requires_grad or value_states.requires_grad
        return k_rows[:, idx].transpose(0, 1), v_rows[:, idx].transpose(0, 1)

    def _layer_kv(self, layer_idx: int, i: int) -> torch.Tensor | None:
        """Layer layer_idx's keys (i = 0) or values (i = 1) from get_mask_sizes' kv_offset on:
        a full-attention layer's concatenation while rows are short (see _cat), views while the
        layout is strided (autograd off), a gather else."""
        if self.kv is None:
            return None
        lo = self._offset(layer_idx, self._n)
        at = self._at[layer_idx]
        if self._cat is not None and at >= 0:
            return self._cat[at + i]
        if self._strided and at >= 0 and not torch.is_grad_enabled() and self._full5 is not None:
            return self._full5[at + i].narrow(2, lo, self._n - lo)
        idx = self._indices(self._part(layer_idx), lo)
        return self._plane(layer_idx, i)[:, idx].transpose(0, 1)

    def __iter__(self) -> Iterator[tuple[torch.Tensor | None, torch.Tensor | None, None]]:
        """(keys, values, None) of every layer, as a DynamicCache iterates."""
        for il in range(self._n_layers):
            yield self._layer_kv(il, 0), self._layer_kv(il, 1), None

    # what transformers asks on every forward (generate, its mask code), fixed when the cache is
    # made: answered from the layer types instead of walking the layers each time
    is_compileable = False

    @property
    def is_sliding(self) -> list[bool]:
        """Per layer: whether it is a sliding-window layer."""
        return [t == "sliding_attention" for t in self._types]

    @property
    def is_linear(self) -> list[bool]:
        """Per layer: False (no linear-attention layers)."""
        return [False] * len(self._types)

    @property
    def is_dummy(self) -> list[bool]:
        """Per layer: False (every layer holds its K/V)."""
        return [False] * len(self._types)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Cache indices stored per row."""
        return self._n

    def get_query_offset(self, layer_idx: int = 0) -> int:
        """Cache index of the forward's first query: the indices stored per row."""
        return self._n

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        """(kv_length, kv_offset) of the keys update will return for layer_idx."""
        lo = self._offset(layer_idx, self._n)
        return self._n + query_length - lo, lo

    def get_max_length(self, layer_idx: int | None = None) -> int:
        """Cache indices a row can hold (n_ctx)."""
        return self._n_ctx

    def _recording(self) -> bool:
        """Whether a sliding layer records its past (transformers' record_past)."""
        return any(layer.record_past for layer in self.layers if layer.is_sliding)   # type: ignore[union-attr]

    def crop(self, max_length: int) -> None:
        """crop(-k) forgets the last k indices of every row, crop(0) none (transformers 5.x);
        crop(m > 0) keeps the first m (the older absolute form). With sliding layers that record
        their past, the window then keeps only what the next forward sees; without, forgetting
        indices whose window the cache has already left raises RuntimeError, changing nothing
        (as a DynamicCache's sliding layers do)."""
        max_length = operator.index(max_length)    # an int (or what stands for one), else TypeError
        keep = self._n + max_length if max_length <= 0 else max_length
        keep = min(max(keep, 0), self._n)
        kv = self.kv
        window = self._window_part()
        if kv is None:
            self._n = keep
            return
        recording = self._recording()
        if keep == self._n and not (window is not None and recording) and self._forward_q():
            return                      # nothing to do: the forward under way goes on
        self._not_mid_forward("crop")   # the layers not yet written would place their new indices anew
        if window is not None and keep < self._n and not recording:
            lo = self._offset(self._types.index("sliding_attention"), keep)
            lost = [b for b in range(self._rows) if keep > 0 and not window.seq_pos_min(b) <= lo]
            if lost:
                raise RuntimeError(f"crop to {keep} indices: the sliding-window layers of row {lost[0]} no longer hold "
                                   f"index {lo} (their window has moved on); call activate_past_recording() before "
                                   f"the forwards that crop undoes")
        self._commit()
        if keep < self._n:
            for b in range(self._rows):
                kv.seq_rm(b, keep, -1)
            self._n = keep
            if self._cat is not None:
                self._cat = [t.narrow(2, 0, keep) for t in self._cat]
        if window is not None and recording:
            for b in range(self._rows):
                window.prune_swa(b, keep, keep)   # what the next forward (index keep) cannot see

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Row b takes the K/V of row beam_idx[b] (beam search)."""
        self._permute(beam_idx, "reorder_cache")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep the rows indices, in that order: only a permutation of all rows is supported (the
        cache's sequences are fixed when it is created)."""
        idx = torch.as_tensor(indices).reshape(-1)
        if idx.dtype == torch.bool:
            idx = idx.nonzero().reshape(-1)
        if sorted(idx.tolist()) != list(range(self._rows)):
            raise NotImplementedError("batch_select_indices: only a permutation of all rows (the kvcache sequences "
                                      "are fixed)")
        self._permute(idx, "batch_select_indices")

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Not supported: NotImplementedError."""
        raise NotImplementedError("batch_repeat_interleave: the kvcache sequences are fixed when the cache is "
                                  "created; build it for the expanded batch")

    def _permute(self, order: torch.Tensor, what: str) -> None:
        """Row b takes row order[b]'s K/V (checked first: bad indices change nothing)."""
        order = torch.as_tensor(order)
        if order.dtype.is_floating_point or order.dtype.is_complex or order.dtype == torch.bool:
            raise TypeError(f"row indices of dtype {order.dtype}: integers expected")
        if self.kv is None or self._n == 0:
            return
        order = order.to("cpu", torch.long).reshape(-1)
        if order.shape[0] != self._rows:
            raise ValueError(f"{order.shape[0]} rows given, the cache holds {self._rows}")
        if int(order.min()) < 0 or int(order.max()) >= self._rows:
            raise IndexError(f"row indices {order.tolist()}: the cache holds rows 0 .. {self._rows - 1}")
        # the layers not yet written would bring the new rows of the order before it
        self._not_mid_forward(what)
        self._commit()
        grad = torch.is_grad_enabled()
        if self._history and not grad:
            self._forget_history()
        by_part: dict[int, torch.Tensor] = {}
        for il in range(len(self._types)):
            part = self._part(il)
            idx = by_part.get(id(part))
            if idx is None:
                # all rows hold the same indices: their cells line up index by index
                idx = by_part[id(part)] = self._indices(part, self._offset(il, self._n))
            for i in (0, 1):
                plane = self._plane(il, i)
                plane[:, idx] = plane[:, idx[order]]
        self._gather.clear()

    def reset(self) -> None:
        """Empty every row (the cache and its memory are kept)."""
        self._commit()
        if self.kv is not None:
            self.kv.clear()
        self._n = 0
        self._strided = True
        self._cat_start()

    # --- save and restore --------------------------------------------------------------------
    def state_write(self) -> bytes:
        """The whole cache as a kvcache state blob (cells and K/V, in kvcache's layout of rows):
        restore it with state_read into a cache of the same model, n_ctx and batch size."""
        kv = self.kv
        if kv is None:
            raise RuntimeError("state_write: nothing stored yet")
        # read only: a forward under way (some of its layers written) goes on undisturbed and
        # the state holds the forwards before it, whose layers are all written
        q = self._forward_q()
        twin = self._twin()
        twin.state_read(kv.state_write())      # the cells (kv writes zeros for the K/V)
        self._rows_to(twin, True)
        if q:
            for b in range(self._rows):
                twin.seq_rm(b, self._n - q, -1)
        return twin.state_write()

    def state_read(self, data: bytes, batch_size: int | None = None, dtype: torch.dtype | None = None) -> None:
        """Restore what state_write saved. A cache not created yet is created with batch_size
        and dtype; afterwards get_seq_length is the saved length, so generate continues the
        saved rows when given their whole sequences so far. Every row must hold indices 0 ..
        n - 1, the same n, at most n_ctx. A state this cache cannot take raises (kvcache's
        StateError, or ValueError) and leaves the cache as it was. Read during a forward (some
        of its layers written), the state replaces that forward too."""
        if batch_size is not None:
            batch_size = _batch_size(batch_size)
        if self.kv is not None and batch_size is not None and batch_size != self._rows:
            raise ValueError(f"batch_size {batch_size}; the cache holds {self._rows} rows")
        if self.kv is None and (batch_size is None or dtype is None):
            raise ValueError("state_read into a cache not created yet needs batch_size and dtype")
        old = self.state_write() if self.kv is not None and self._n else None    # before the twin: one at a time
        # the state read and checked in a twin first: one the cache cannot take is refused
        # before anything here changes (a forward under way included)
        twin = self._checked_twin(data) if self.kv is not None else None
        self._commit()
        before = dict(self.__dict__)    # the attributes _create replaces
        try:
            if self.kv is None:
                assert batch_size is not None and dtype is not None
                self._create(batch_size, dtype)
                twin = self._checked_twin(data)
            assert twin is not None
            self._read(data, twin)
        except BaseException:
            self.__dict__.clear()
            self.__dict__.update(before)
            if self.kv is not None:     # the cache it held, whatever the read got to
                if old is not None:
                    self._read(old, self._checked_twin(old))
                else:
                    self.kv.clear()
            raise
        finally:
            if self._history:
                self._forget_history()  # the tensors' memory was written without autograd

    def _checked_twin(self, data: bytes) -> UnifiedCache2025 | ISWACache2025:
        """A twin (see _twin) holding the state data, its rows checked (see _restored_rows)."""
        twin = self._twin()
        twin.state_read(data)       # checks the whole state; its K/V land in the twin
        self._restored_rows(twin)
        return twin

    def _read(self, data: bytes, twin: UnifiedCache2025 | ISWACache2025) -> None:
        """kv's state_read of data (whole cache), its rows' length and layout, and its K/V into
        this cache's tensors from twin (which holds data, checked)."""
        assert self.kv is not None
        self.kv.state_read(data)
        self._n, self._strided = self._restored_rows(self.kv)
        self._cat = None            # the restored K/V are in the tensors
        self._rows_to(twin, False)

    def _restored_rows(self, kv: UnifiedCache2025 | ISWACache2025) -> tuple[int, bool]:
        """The rows' length n and whether their full-attention cells lie strided, in kv just
        restored (the kvcache cache or a twin), or ValueError: each row must hold indices 0 ..
        n - 1 without holes (the sliding-window part: those the next forward attends to), the
        same n in every row, n <= n_ctx; anything else fails the first update."""
        if isinstance(kv, ISWACache2025):
            full = cast(UnifiedCache2025, kv.base) if kv.base_layers else None
            window: UnifiedCache2025 | None = cast(UnifiedCache2025, kv.swa)
        else:
            full, window = kv, None
        lengths = []
        for b in range(self._rows):
            if full is None:
                lengths.append(int(kv.seq_pos_max(b)) + 1)
                continue
            pos = full.seq_cells(b)[1]
            if not np.array_equal(pos, np.arange(len(pos))):
                raise ValueError(f"the saved row {b} holds indices {pos.tolist()[:8]}...: expected 0 .. n - 1 without "
                                 f"holes")
            lengths.append(len(pos))
        if len(set(lengths)) > 1:
            raise ValueError(f"the saved rows have different lengths {sorted(set(lengths))}")
        n = lengths[0] if lengths else 0
        if n > self._n_ctx:
            raise ValueError(f"the saved rows hold {n} indices; this cache holds {self._n_ctx} per row (n_ctx)")
        if window is not None:
            lo = max(n - self._window + 1, 0)
            for b in range(self._rows):
                pos = window.seq_cells(b)[1]
                tail = pos[int(np.searchsorted(pos, lo)):]
                if not np.array_equal(tail, np.arange(lo, n)):
                    raise ValueError(f"the saved row {b}'s sliding-window layers hold indices {tail.tolist()[:8]}... "
                                     f"from {lo} on: the next forward attends to {lo} .. {n - 1}")
        strided = full is None or all(
            np.array_equal(full.seq_cells(b)[0], np.arange(n) * self._rows + b) for b in range(self._rows))
        return n, strided

    # --- copies ------------------------------------------------------------------------------
    def __reduce__(self) -> tuple[Any, ...]:
        """``pickle`` and ``copy.deepcopy`` (transformers' way to reuse a prompt's cache for
        several continuations): a new cache of the same model and sizes holding this one's rows,
        through ``state_write`` / ``state_read``."""
        if self.kv is None:
            return _restored, (self._config, self._n_ctx, self._n_batch, self._n_pad, None, None, None)
        return _restored, (self._config, self._n_ctx, self._n_batch, self._n_pad, self._rows, self._k[0].dtype,
                           self.state_write())

    def __copy__(self) -> KVCache:
        """Refused: a shallow copy would share the kvcache cache with this one while counting
        its rows apart; ``copy.deepcopy`` copies the rows."""
        raise TypeError("copy.copy of a kvcache transformers Cache: use copy.deepcopy (a copy of the rows)")

    def __repr__(self) -> str:
        return f"KVCache({self.kv!r}, rows={self._rows}, length={self._n})"


def _restored(config: Any, n_ctx: int, n_batch: int | None, n_pad: int, rows: int | None, dtype: torch.dtype | None,
              state: bytes | None) -> KVCache:
    """A KVCache rebuilt from what __reduce__ gave (holding the state's rows, if any)."""
    cache = KVCache(config, n_ctx, n_batch=n_batch, n_pad=n_pad)
    if state is not None:
        cache.state_read(state, batch_size=rows, dtype=dtype)
    return cache


def from_model(model: Any, n_ctx: int, **options: Any) -> KVCache:
    """A KVCache for a transformers model (its config): ``options`` as KVCache's (batch_size,
    dtype, n_batch, n_pad)."""
    return KVCache(model.config, n_ctx, **options)
