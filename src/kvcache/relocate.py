"""Moving a range of a sequence's positions to another start (docs/store.md, "Relocation").

:func:`get_range` copies the K/V rows of the cells that hold positions ``[p0, p1)`` of a sequence
of a :class:`kvcache.UnifiedCache`; :func:`set_range` places them in a sequence (of the same
cache or another of the same geometry) at positions ``[at, at + n)``, its K rows rotated by the
position delta ``at - p0`` with the model's RoPE parameters — the arithmetic of the cache's own
K-shift (``update()``, ``kvcache.rope_shift``). The rows of a range computed at one position and
moved to another are the rows a K-shift of them in place gives, not bit for bit those of a fresh
computation at the new positions: the rotation by ``p0`` and then by ``at - p0`` is rounded twice
(as llama.cpp's context shift and its proposed ``llama_state_seq_set_range``).

Valid for models whose keys carry their position only as a RoPE rotation (normal or NeoX pairs,
with linear scaling, YaRN, per-pair frequency factors or per-layer bases: what
:class:`kvcache.RopeParams` expresses) in a cache without a sliding window; refused with a clear
error: a move without RoPE parameters (ALiBi, absolute position embeddings, no position encoding:
kvcache cannot tell them apart), caches with the per-cell extension (M-RoPE's 2-D positions), a
sliding window, and every cache that is not one unified cache (iSWA, recurrent, hybrid: a
recurrent state sums up every position before it and cannot be moved).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from kvcache._core import RopeParams, StateError, int_arg, rope_shift
from kvcache._store_format import StoreError, StoreGeometry
from kvcache._store_parts import rows_of
from kvcache._text import plural

if TYPE_CHECKING:
    from kvcache.unified import UnifiedCache

__all__ = ["SeqRange", "get_range", "set_range"]

_POS_MAX = 2**31 - 1


@dataclass(frozen=True)
class SeqRange:
    """The K and V rows of positions ``[p0, p0 + n_tokens)`` of a sequence, in position order,
    as :func:`get_range` copies them: per layer ``k[i]`` (n_tokens, K row bytes) and ``v[i]``
    (n_tokens, V row bytes) uint8 (V never transposed), the cache's K/V types and, per layer,
    (model layer, K width, V width, K row bytes, V row bytes)."""

    type_k: int
    type_v: int
    layers: tuple[tuple[int, int, int, int, int], ...]
    p0: int
    k: tuple[npt.NDArray[np.uint8], ...]
    v: tuple[npt.NDArray[np.uint8], ...]

    @property
    def n_tokens(self) -> int:
        """Positions the range holds."""
        return int(self.k[0].shape[0]) if self.k else 0


def _geometry(cache: Any, what: str) -> tuple[int, int, tuple[tuple[int, int, int, int, int], ...]]:
    """(type_k, type_v, layers) of a unified cache holding K/V, or StoreError saying why not."""
    from kvcache.unified import UnifiedCache

    if not isinstance(cache, UnifiedCache):
        raise StoreError(f"{what}: cache must be a UnifiedCache, not {type(cache).__name__} (an iSWA, recurrent or "
                         "hybrid cache's ranges cannot be moved)")
    if getattr(cache, "cell_ext", False):
        raise StoreError(f"{what}: cache carries the per-cell extension (cell_ext=True, M-RoPE's 2-D positions): "
                         "its ranges cannot be moved")
    if cache.buffers == "none":
        raise StoreError(f"{what}: cache holds no K/V memory (buffers='none')")
    g = StoreGeometry.of(cache, 1)
    return g.type_k, g.type_v, g.layers


def _stream(cache: Any, seq_id: int) -> int:
    """seq_id's stream: its cells' K/V rows are stream * size + cell."""
    return seq_id if int(cache.n_stream) > 1 else 0


def get_range(cache: UnifiedCache, seq_id: int, p0: int, p1: int) -> SeqRange:
    """Copy the K/V rows of positions [p0, p1) of seq_id: each position of the range must be held
    by exactly one cell of the sequence (ValueError otherwise). The cache is not changed."""
    _geometry(cache, "get_range")
    p0 = int_arg(p0, "p0", 0, _POS_MAX)
    p1 = int_arg(p1, "p1", 0, _POS_MAX)
    if p1 <= p0:
        raise ValueError(f"get_range: the range [p0, p1) = [{p0}, {p1}) is empty")
    cells, pos = cache.seq_cells(seq_id)
    sel = (pos >= p0) & (pos < p1)
    got = pos[sel]
    if len(got) != p1 - p0 or not np.array_equal(got, np.arange(p0, p1, dtype=got.dtype)):
        # the first position missing, from the held ones alone: the range may span 2**31 positions
        have = np.unique(got).astype(np.int64)
        gaps = np.flatnonzero(have != np.arange(p0, p0 + len(have), dtype=np.int64))
        n_missing = p1 - p0 - len(have)
        first = p0 + int(gaps[0]) if gaps.size else p0 + len(have)
        why = (f"position {first} is not held; {plural(n_missing, 'position')} of the range are not" if n_missing else
               "a position is held by several cells")
        raise ValueError(f"get_range: sequence {seq_id} does not hold every position of [{p0}, {p1}) in exactly "
                         f"one cell ({why})")
    cells = cells[sel].astype(np.int64)
    type_k, type_v, layers = _geometry(cache, "get_range")
    ks, vs = [], []
    for ly in layers:
        k, v = rows_of(cache, ly[0], cells, _stream(cache, seq_id))
        ks.append(k)
        vs.append(v)
    return SeqRange(type_k, type_v, layers, p0, tuple(ks), tuple(vs))


def _rope_for(cache: Any, rope: RopeParams | None, delta: int, what: str) -> tuple[RopeParams | None, Any]:
    """The RoPE parameters and per-layer K head sizes for a move by delta (None when delta is 0)."""
    if rope is not None and not isinstance(rope, RopeParams):
        raise TypeError(f"{what}: rope must be a kvcache.RopeParams or None, not {type(rope).__name__}")
    if delta == 0:
        return None, None
    rp = rope if rope is not None else cache.rope
    if rp is None:
        raise ValueError(f"{what}: moving positions by {delta} rotates K with the model's RoPE, and neither rope= nor "
                         "the cache gives its RopeParams (models without RoPE, ALiBi or absolute position embeddings, "
                         "are refused: kvcache cannot tell whether their K depend on the position)")
    heads = cache.n_embd_head_k
    if heads is None:
        raise ValueError(f"{what}: rotating K needs the K head size: make the cache with n_embd_head_k")
    return rp, heads


def check_target(cache: UnifiedCache, seq_id: int, at: int, rope: RopeParams | None, what: str) -> None:
    """What set_range refuses whatever the range (the cache, seq_id, at, rope), before anything is
    read or changed; the moved range's own checks (geometry, room, free positions) come later."""
    _geometry(cache, what)
    if cache.swa_type != "none":
        raise ValueError(f"{what}: the cache has a sliding window (swa_type {cache.swa_type!r}): its cells are "
                         "hidden and reused by position, and a moved range is refused")
    int_arg(seq_id, "seq_id", 0, cache.n_seq_max - 1)
    int_arg(at, "at", 0, _POS_MAX)
    if rope is not None and not isinstance(rope, RopeParams):
        raise TypeError(f"{what}: rope must be a kvcache.RopeParams or None, not {type(rope).__name__}")


def set_range(cache: UnifiedCache, seq_id: int, rng: SeqRange, at: int, *, rope: RopeParams | None = None,
              tokens: Any = None, what: str = "set_range") -> int:
    """Place a :class:`SeqRange` in seq_id at positions [at, at + n) (the sequence must hold none of
    them; its other cells stay), K rotated by at - rng.p0 with rope (default: the cache's
    ``rope``; needed unless at == p0). The cells are placed as a ubatch of those positions
    (``find_slot``; a "2025" cache commits, as ``place_seqs`` does) and the rows written with
    ``store``; tokens: the token ids, for a cache with prefix reuse. Returns n.

    Not bit-exact against computing the range at the new positions (two roundings of the
    rotation). Everything is checked, and K rotated, before the cache changes: on ValueError,
    StoreError or StateError (no room) the cache is as it was."""
    check_target(cache, seq_id, at, rope, what)
    if not isinstance(rng, SeqRange):
        raise TypeError(f"{what}: rng must be a SeqRange (get_range), not {type(rng).__name__}")
    type_k, type_v, layers = _geometry(cache, what)
    if (rng.type_k, rng.type_v, rng.layers) != (type_k, type_v, layers):
        raise ValueError(f"{what}: the range's K/V types and layers are not this cache's")
    n = _rows_check(rng, layers, what)
    p0 = int_arg(rng.p0, "rng.p0", 0, _POS_MAX - max(n, 1) + 1)
    if n == 0:
        return 0
    if at + n - 1 > _POS_MAX:
        raise ValueError(f"{what}: at + {n} positions passes the largest position {_POS_MAX}")
    toks = None
    if tokens is not None:
        toks = np.asarray(tokens)
        if toks.shape != (n,):
            raise ValueError(f"{what}: tokens must hold {n} token ids, one per position, not shape {toks.shape}")
    _, pos = cache.seq_cells(seq_id)
    inside = pos[(pos >= at) & (pos < at + n)]
    if inside.size:
        raise ValueError(f"{what}: sequence {seq_id} already holds position {int(inside.min())} of [{at}, {at + n})")
    delta = at - p0
    rp, heads = _rope_for(cache, rope, delta, what)
    ks = []
    for ly, k in zip(layers, rng.k):
        k = np.array(k, dtype=np.uint8, copy=True)
        if rp is not None:
            il = ly[0]
            hd = heads[il]
            rope_shift(k, type_k, ly[1] // hd, hd, np.full(n, delta, np.int32), rp, layer=il)
        ks.append(k)
    # the rows as store() takes them, made before the cache changes: after find_slot only the
    # copies are left, and a "2025" cache's restore() cannot put back the head the search moved
    rows = [(ly[0], k.view(np.asarray(cache.k(ly[0])).dtype),
             np.ascontiguousarray(v).view(np.asarray(cache.v(ly[0])).dtype)) for ly, k, v in zip(layers, ks, rng.v)]
    if cache.semantics == "2025":
        free = cache.cells().pos < 0
        if _longest_run(free) < n:
            raise StateError(f"{what}: no room: {n} positions need {n} contiguous free cells, the longest free run "
                             f"is {_longest_run(free)}")
    from kvcache._core import UBatch

    ub = UBatch(list(range(at, at + n)), [seq_id] * n, tokens=None if toks is None else toks.tolist())
    if not cache.find_slot(ub):
        raise StateError(f"{what}: no room: the cache cannot place {n} cells for sequence {seq_id}")
    undo: Any = cache            # restore / commit: a "2025" cache's
    try:
        for il, k, v in rows:
            cache.store(il, k, v)
    except BaseException:
        if cache.semantics == "2025":
            undo.restore()
        else:
            cache.seq_rm(seq_id, at, at + n)
        raise
    if cache.semantics == "2025":
        undo.commit()
    return n


def _rows_check(rng: SeqRange, layers: tuple[tuple[int, int, int, int, int], ...], what: str) -> int:
    """The number of positions of rng, whose K and V rows must be, per layer, uint8 arrays of
    n rows of the layer's row bytes (a SeqRange can be made by hand: nothing is cast)."""
    n = -1
    for name, rows, col in (("k", rng.k, 3), ("v", rng.v, 4)):
        if not isinstance(rows, (tuple, list)) or len(rows) != len(layers):
            raise ValueError(f"{what}: the range's {name.upper()} rows (rng.{name}) must be "
                             f"{plural(len(layers), 'array')}, one per layer")
        for i, (r, ly) in enumerate(zip(rows, layers)):
            if not isinstance(r, np.ndarray) or r.dtype != np.uint8:
                got = f"dtype {r.dtype}" if isinstance(r, np.ndarray) else type(r).__name__
                raise TypeError(f"{what}: rng.{name}[{i}] must be a uint8 numpy array (the row bytes), not {got}")
            if n < 0:
                n = int(r.shape[0]) if r.ndim == 2 else 0
            if r.shape != (n, ly[col]):
                raise ValueError(f"{what}: rng.{name}[{i}] has shape {r.shape}, expected ({n}, {ly[col]}): "
                                 f"{plural(n, 'row')} of the layer's {ly[col]} row bytes")
    return max(n, 0)


def _longest_run(free: npt.NDArray[np.bool_]) -> int:
    """The longest run of True in free."""
    if not free.any():
        return 0
    d = np.diff(np.concatenate(([0], free.astype(np.int8), [0])))
    starts, ends = np.flatnonzero(d == 1), np.flatnonzero(d == -1)
    return int((ends - starts).max())
