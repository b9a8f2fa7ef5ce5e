"""A transformers ``Cache`` over kvcache: ``model.generate(..., past_key_values=cache)`` with the
keys and values held by a :class:`~kvcache.UnifiedCache` (full attention) or an
:class:`~kvcache.ISWACache` (models with sliding-window layers).

``from_model(model, n_ctx=...)`` builds one. Each row of the batch is one kvcache sequence (row b
= sequence b) and each of transformers' cache indices one cell (left-padding tokens included,
as transformers stores them), at the kvcache position equal to that index, so kvcache's causal
and sliding-window rules are the ones transformers' masks apply. K/V live in the cache's own
memory (CPU, ``v_trans=False``), seen from torch without a copy; ``update`` writes the new rows
there and returns views when the cells of every row lie in the layout a fresh cache gives them
(cell = index * batch + row), a gather of exactly the expected keys otherwise (sliding layers,
whose cells are reused; a cache restored elsewhere). Anything that would not give transformers
exactly the keys it expects raises instead. Needs ``torch`` and ``transformers`` 5.x."""
from __future__ import annotations

from typing import Any

import numpy as np
import torch  # type: ignore[import-not-found,unused-ignore]
from transformers import Cache  # type: ignore[import-not-found,import-untyped,unused-ignore]

from kvcache._core import UBatch
from kvcache.geometry import hf_attention
from kvcache.iswa import ISWACache
from kvcache.plan import _pad
from kvcache.unified import UnifiedCache

__all__ = ["KVCache", "from_model"]

_TYPES = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}


class _Layer:
    """What transformers reads off a cache layer (``Cache.is_sliding`` and the properties beside
    it): one per model layer, holding nothing."""
    supports_early_init = False
    is_initialized = True
    is_compileable = False          # update returns exactly the keys written: the masks may be skipped
    is_croppable = True

    def __init__(self, sliding_window: int | None):
        self.is_sliding = sliding_window is not None
        self.sliding_window = sliding_window

    def __repr__(self) -> str:
        return f"kvcache layer (sliding window {self.sliding_window})" if self.is_sliding else "kvcache layer"


class KVCache(Cache):  # type: ignore[misc,unused-ignore]
    """transformers' ``Cache`` contract over a kvcache cache, created on the first ``update``
    (when the batch size and dtype are known) or up front with ``batch_size`` and ``dtype``.

    n_ctx: cache indices per batch row (prompt, left padding and new tokens); the cache has
    ``n_ctx * batch_size`` cells (rounded up to n_pad). n_batch (sliding-window models): the
    most tokens one forward places (batch rows times new tokens), which sizes the window
    cache (default: everything, n_ctx * batch_size). CPU tensors of float32, float16 or
    bfloat16 only. ``kv`` is the kvcache cache (None until created): row b is its sequence b,
    cache index j its position j."""

    def __init__(self, config: Any, n_ctx: int, *, batch_size: int | None = None, dtype: torch.dtype | None = None,
                 n_batch: int | None = None, n_pad: int = 32):
        _, _, n_kv, head_dim, self._window, self._types = hf_attention(config)
        sliding = [t == "sliding_attention" for t in self._types]
        super().__init__(layers=[_Layer(self._window if s else None) for s in sliding])   # type: ignore[arg-type,misc,unused-ignore]
        self._heads = (n_kv, head_dim)
        self._n_ctx = int(n_ctx)
        if self._n_ctx < 1:
            raise ValueError(f"n_ctx = {n_ctx}: must be at least 1")
        self._n_batch = n_batch
        self._n_pad = int(n_pad)
        self.kv: UnifiedCache | ISWACache | None = None
        self._row_ids = self._pos1 = np.zeros(0, dtype=np.int32)
        self._rows = 0              # batch rows = sequences 0 .. rows - 1
        self._n = 0                 # cache indices per row, the current forward's included
        self._strided = True        # cell of (index j, row b) is j * rows + b in the full-attention cache
        self._placed: set[int] = set()   # layers written in the forward under way (placed, not committed)
        self._q = 0
        self._gather: dict[int, torch.Tensor] = {}   # per kvcache part (id) of this forward: [rows, kv_len]
        self._k: list[torch.Tensor] = []
        self._v: list[torch.Tensor] = []
        self._k4: list[torch.Tensor | None] = []
        self._v4: list[torch.Tensor | None] = []
        self._kt: list[torch.Tensor | None] = []
        self._vt: list[torch.Tensor | None] = []
        if batch_size is not None or dtype is not None:
            if batch_size is None or dtype is None:
                raise ValueError("batch_size and dtype go together (both create the cache now)")
            self._create(int(batch_size), dtype)

    # --- the kvcache cache -------------------------------------------------------------------
    def _create(self, rows: int, dtype: torch.dtype) -> None:
        if dtype not in _TYPES:
            raise TypeError(f"K/V of dtype {dtype}: kvcache keeps float32, float16 or bfloat16")
        if rows < 1:
            raise ValueError(f"batch size {rows}")
        n_kv, head_dim = self._heads
        width = n_kv * head_dim
        n_layer = len(self._types)
        kv_size = _pad(self._n_ctx * rows, self._n_pad)
        common: dict[str, Any] = dict(kv_size=kv_size, n_layer=n_layer, n_embd_k_gqa=width, n_embd_v_gqa=width,
                                      type_k=_TYPES[dtype], type_v=_TYPES[dtype], v_trans=False, n_seq_max=rows,
                                      n_pad=self._n_pad)
        swa = [il for il, t in enumerate(self._types) if t == "sliding_attention"]
        if swa:
            n_batch = self._n_batch if self._n_batch is not None else self._n_ctx * rows
            self.kv = ISWACache(swa_layers=swa, n_swa=self._window, swa_type="standard", n_batch=n_batch,
                                **common)
        else:
            self.kv = UnifiedCache(**common)
        self._rows = rows
        self._row_ids = np.arange(rows, dtype=np.int32)
        self._pos1 = np.zeros(rows, dtype=np.int32)         # a decode step's positions (copied by UBatch)
        self._k, self._v = [], []
        self._k4, self._v4, self._kt, self._vt = [], [], [], []
        full = self._full()
        for il in range(n_layer):
            k, v = _as_torch(self.kv.k(il), dtype), _as_torch(self.kv.v(il), dtype)
            self._k.append(k)
            self._v.append(v)
            # the full-attention layers as [index, row, head, dim] over the strided layout, and
            # as transformers reads them, [row, head, index, dim]: update slices these
            k4 = v4 = None
            if self._part(il) is full:
                cap = k.shape[0] // rows
                k4 = k[:cap * rows].view(cap, rows, n_kv, head_dim)
                v4 = v[:cap * rows].view(cap, rows, n_kv, head_dim)
            self._k4.append(k4)
            self._v4.append(v4)
            self._kt.append(None if k4 is None else k4.permute(1, 2, 0, 3))
            self._vt.append(None if v4 is None else v4.permute(1, 2, 0, 3))

    def _part(self, il: int) -> UnifiedCache:
        kv = self.kv
        assert kv is not None
        return kv.cache_of(il) if isinstance(kv, ISWACache) else kv

    def _full(self) -> UnifiedCache | None:
        """The full-attention part (None when every layer slides)."""
        kv = self.kv
        if isinstance(kv, ISWACache):
            return kv.base if kv.base_layers else None
        return kv

    def _commit(self) -> None:
        if self._placed:
            assert self.kv is not None
            self.kv.commit()
            self._placed.clear()
            self._gather.clear()

    def _offset(self, layer_idx: int, n: int) -> int:
        """First cache index the layer attends to with n indices already stored."""
        if self._types[layer_idx] == "sliding_attention":
            return max(n - self._window + 1, 0)
        return 0

    def _place(self, q: int) -> None:
        """One forward's q new indices of every row: one ubatch, index-major (row b of index j
        is token j * rows + b), placed as one run of cells."""
        assert self.kv is not None
        self._commit()
        rows, n = self._rows, self._n
        if n + q > self._n_ctx:
            raise ValueError(f"the cache holds {self._n_ctx} indices per row; {n} are used and {q} more came")
        if q == 1:
            self._pos1.fill(n)
            pos, seq = self._pos1, self._row_ids
        else:
            pos = np.repeat(np.arange(n, n + q, dtype=np.int32), rows)
            seq = np.tile(self._row_ids, q)
        ub = UBatch(pos, seq)
        if isinstance(self.kv, ISWACache):
            self.kv.sbatch_init(pos, seq)      # the window slides on commit
        if not self.kv.find_slot(ub):
            raise RuntimeError(f"kvcache found no room for {rows * q} cells (n_ctx={self._n_ctx}, n_batch="
                               f"{self._n_batch})")
        full = self._full()
        if full is not None and full.slot != (n * rows, q * rows):
            self._strided = False
        self._q = q
        self._n = n + q

    def _indices(self, part: UnifiedCache, lo: int) -> torch.Tensor:
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

    # --- transformers' Cache -----------------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new K/V of layer_idx ([rows, kv_heads, q, head_dim], rotated) and return the
        layer's keys and values from get_mask_sizes' kv_offset on, in cache-index order."""
        if key_states.device.type != "cpu" or value_states.device.type != "cpu":
            raise NotImplementedError(f"K/V on {key_states.device}: this cache keeps CPU tensors (for K/V on a "
                                      f"device, use kvcache's metadata-only mode, see docs/torch.md)")
        rows, n_kv, q, head_dim = key_states.shape
        if (n_kv, head_dim) != self._heads or tuple(value_states.shape) != tuple(key_states.shape):
            raise ValueError(f"K/V of shape {tuple(key_states.shape)} / {tuple(value_states.shape)}: the config "
                             f"says {self._heads[0]} kv heads of {self._heads[1]}")
        if self.kv is None:
            self._create(rows, key_states.dtype)
        if rows != self._rows:
            raise ValueError(f"batch of {rows} rows; the cache holds {self._rows}")
        if key_states.dtype != self._k[layer_idx].dtype:
            raise TypeError(f"K/V of dtype {key_states.dtype}; the cache holds {self._k[layer_idx].dtype}")
        if not self._placed or layer_idx in self._placed:
            self._place(q)
        elif q != self._q:
            raise ValueError(f"layer {layer_idx} brings {q} indices, the forward {self._q}")
        self._placed.add(layer_idx)
        k4, v4, kt, vt = self._k4[layer_idx], self._v4[layer_idx], self._kt[layer_idx], self._vt[layer_idx]
        if self._strided and k4 is not None and v4 is not None and kt is not None and vt is not None:
            # cell j * rows + b: index j of row b; the run placed is indices n - q .. n - 1
            k4[self._n - q:self._n].copy_(key_states.permute(2, 0, 1, 3))
            v4[self._n - q:self._n].copy_(value_states.permute(2, 0, 1, 3))
            k, v = kt[:, :, :self._n], vt[:, :, :self._n]
        else:
            k, v = self._gathered(layer_idx, key_states, value_states)
        if len(self._placed) == len(self._types):
            self._commit()
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
        # token j * rows + b of the ubatch (index n - q + j of row b) is cell head + j * rows + b
        self._k[layer_idx][new].view(q, rows, n_kv, head_dim).copy_(key_states.permute(2, 0, 1, 3))
        self._v[layer_idx][new].view(q, rows, n_kv, head_dim).copy_(value_states.permute(2, 0, 1, 3))
        idx = self._indices(part, self._offset(layer_idx, self._n - q))
        k = self._k[layer_idx][idx].view(rows, -1, n_kv, head_dim).transpose(1, 2)
        v = self._v[layer_idx][idx].view(rows, -1, n_kv, head_dim).transpose(1, 2)
        return k, v

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Cache indices stored per row."""
        return self._n

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        """(kv_length, kv_offset) of the keys update will return for layer_idx."""
        lo = self._offset(layer_idx, self._n)
        return self._n + query_length - lo, lo

    def get_max_length(self, layer_idx: int | None = None) -> int:
        """Cache indices a row can hold (n_ctx)."""
        return self._n_ctx

    def crop(self, max_length: int) -> None:
        """crop(-k) forgets the last k indices of every row (transformers 5.x); crop(m >= 0) keeps
        the first m (transformers 4.x)."""
        keep = self._n + max_length if max_length < 0 else max_length
        keep = max(keep, 0)
        if keep >= self._n:
            return
        self._commit()
        if self.kv is not None:
            for b in range(self._rows):
                self.kv.seq_rm(b, keep, -1)
        self._n = keep

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Row b takes the K/V of row beam_idx[b] (beam search)."""
        self._permute(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep the rows indices, in that order: only a permutation of all rows is supported (the
        cache's sequences are fixed when it is created)."""
        idx = torch.as_tensor(indices).reshape(-1)
        if idx.dtype == torch.bool:
            idx = idx.nonzero().reshape(-1)
        if sorted(idx.tolist()) != list(range(self._rows)):
            raise NotImplementedError("batch_select_indices: only a permutation of all rows (the kvcache sequences "
                                      "are fixed)")
        self._permute(idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Not supported: NotImplementedError."""
        raise NotImplementedError("batch_repeat_interleave: the kvcache sequences are fixed when the cache is "
                                  "created; build it for the expanded batch")

    def _permute(self, order: torch.Tensor) -> None:
        self._commit()
        if self.kv is None or self._n == 0:
            return
        order = torch.as_tensor(order).to("cpu", torch.long).reshape(-1)
        if order.shape[0] != self._rows:
            raise ValueError(f"{order.shape[0]} rows given, the cache holds {self._rows}")
        by_part: dict[int, torch.Tensor] = {}
        for il in range(len(self._types)):
            part = self._part(il)
            idx = by_part.get(id(part))
            if idx is None:
                # all rows hold the same indices: their cells line up index by index
                idx = by_part[id(part)] = self._indices(part, self._offset(il, self._n))
            self._k[il][idx] = self._k[il][idx[order]]
            self._v[il][idx] = self._v[il][idx[order]]
        self._gather.clear()

    def reset(self) -> None:
        """Empty every row (the cache and its memory are kept)."""
        if self.kv is not None:
            self.kv.clear()
        self._placed.clear()
        self._gather.clear()
        self._n = 0
        self._strided = True

    # --- save and restore --------------------------------------------------------------------
    def state_write(self) -> bytes:
        """The whole cache as a kvcache state blob (cells and K/V): restore it with state_read
        into a cache of the same model, n_ctx and batch size."""
        if self.kv is None:
            raise RuntimeError("state_write: nothing stored yet")
        self._commit()
        return self.kv.state_write()

    def state_read(self, data: bytes, batch_size: int | None = None, dtype: torch.dtype | None = None) -> None:
        """Restore what state_write saved. A cache not created yet is created with batch_size
        and dtype; afterwards get_seq_length is the saved length, so generate continues the
        saved rows when given their whole sequences so far."""
        if self.kv is None:
            if batch_size is None or dtype is None:
                raise ValueError("state_read into a cache not created yet needs batch_size and dtype")
            self._create(int(batch_size), dtype)
        elif batch_size is not None and batch_size != self._rows:
            raise ValueError(f"batch_size {batch_size}; the cache holds {self._rows} rows")
        assert self.kv is not None
        self._placed.clear()
        self._gather.clear()
        self.kv.state_read(data)
        ends = {self.kv.seq_pos_max(b) + 1 for b in range(self._rows)}
        full = self._full()
        starts = {full.seq_pos_min(b) for b in range(self._rows)} if full is not None else {0}
        if len(ends) != 1:
            self.reset()
            raise ValueError(f"the saved rows have different lengths {sorted(ends)}")
        self._n = ends.pop()
        if full is not None and self._n and starts != {0}:
            self.reset()
            raise ValueError("the saved rows do not start at index 0")
        self._strided = full is None or all(
            np.array_equal(full.seq_cells(b)[0], np.arange(self._n) * self._rows + b) for b in range(self._rows))

    def __repr__(self) -> str:
        return f"KVCache({self.kv!r}, rows={self._rows}, length={self._n})"


def _as_torch(a: Any, dtype: torch.dtype) -> torch.Tensor:
    """A torch tensor over a cache buffer view (no copy)."""
    if dtype == torch.bfloat16:
        return torch.from_numpy(np.asarray(a).view(np.uint16)).view(torch.bfloat16)
    return torch.from_numpy(np.asarray(a))


def from_model(model: Any, n_ctx: int, **options: Any) -> KVCache:
    """A KVCache for a transformers model (its config): ``options`` as KVCache's (batch_size,
    dtype, n_batch, n_pad)."""
    return KVCache(model.config, n_ctx, **options)
