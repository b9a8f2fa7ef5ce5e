"""The interleaved sliding-window cache: llama.cpp's ``llama_kv_cache_unified_iswa``.

Models such as Gemma 2/3 or Llama 4 alternate layers that attend to the whole context with
layers that attend only to a sliding window. :class:`ISWACache` keeps the two kinds in two
:class:`kvcache.UnifiedCache` objects — ``base`` for the full-attention layers and ``swa`` for
the windowed ones, usually much smaller — and drives them together."""
from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any, Callable, Generic, Iterable, Iterator, Literal, TypeVar, cast, overload

import numpy as np
import numpy.typing as npt

from kvcache._core import DEFAULT_LAYOUT, Batch, RopeParams, SplitUBatch, SWAPending, UBatch, UpdatePlan, bool_arg, \
    int_arg, layers_arg, n_seq_max_arg, _find_slot_parts, _Hold, _state_read_parts, _state_size_parts, _state_write_parts, \
    _update_parts
from kvcache._signatures import named_errors
from kvcache.handoff import PartsExport, PartsImport, split_parts
from kvcache.plan import SEMANTICS, swa_size
from kvcache.unified import UnifiedCache, UnifiedCache2025, UnifiedCache2026

if TYPE_CHECKING:
    from kvcache._core import _BinaryWriter, _Buffers, _BufferMode, _GGMLType, _MaskDType, _PerLayer, _SlotInfo
    from typing_extensions import Buffer

__all__ = ["ISWACache", "ISWAUpdatePlan", "SWAWarning"]

_SWA_TYPES = ("standard", "chunked")


class SWAWarning(UserWarning):
    """The SWA cache held only part of a sequence's window when it was pruned on commit: the
    sequence may have lost information (typically after cells were removed or the SWA cache
    was too small for the batch)."""


class ISWAUpdatePlan:
    """The UpdatePlans of an iSWA cache's two parts (``base``, ``swa``); true when both are
    (llama.cpp's iSWA update returns the AND of its caches' answers)."""

    __slots__ = ("base", "swa")

    def __init__(self, base: UpdatePlan, swa: UpdatePlan):
        self.base = base
        self.swa = swa

    def __bool__(self) -> bool:
        return bool(self.base) and bool(self.swa)

    def __iter__(self) -> Iterator[UpdatePlan]:
        return iter((self.base, self.swa))

    def __repr__(self) -> str:
        return f"ISWAUpdatePlan(base={self.base!r}, swa={self.swa!r})"




def _out_pair(out: Any) -> tuple[Any, Any]:
    """The base and SWA buffers of an ``out`` argument: None, or a pair."""
    if out is None:
        return None, None
    try:
        out_base, out_swa = out
    except (TypeError, ValueError):
        raise TypeError("out must be None or a pair (base_out, swa_out)") from None
    return out_base, out_swa

_T = TypeVar("_T")


class _Attr(Generic[_T]):
    """A read-only attribute of the pair: attribute `attr` (by default the same name) of `part`
    ("_base" or "_swa", one of its caches; "" the pair itself)."""

    def __init__(self, doc: str, part: str = "_base", attr: str = "") -> None:
        self.__doc__ = doc
        self._part = part
        self._attr = attr
        self._name = attr

    def __set_name__(self, owner: type, name: str) -> None:
        self._name = name
        self._attr = self._attr or name

    @overload
    def __get__(self, obj: None, owner: type | None = None) -> _Attr[_T]: ...
    @overload
    def __get__(self, obj: ISWACache, owner: type | None = None) -> _T: ...
    def __get__(self, obj: ISWACache | None, owner: type | None = None) -> _T | _Attr[_T]:
        if obj is None:
            return self
        value: _T = getattr(getattr(obj, self._part) if self._part else obj, self._attr)
        return value

    def __set__(self, obj: ISWACache, value: object) -> None:
        raise AttributeError(f"ISWACache.{self._name} is read-only")


class ISWACache:
    """An interleaved sliding-window KV cache: a base cache for the full-attention layers and a
    SWA cache for the sliding-window layers, driven together.

    ``ISWACache(kv_size, n_layer, n_embd_k_gqa, n_embd_v_gqa, swa_layers, n_swa,
    swa_type="standard", n_batch=512, swa_full=None, type_k="f16", type_v="f16", v_trans=True,
    n_seq_max=1, n_pad=32, buffers="owned", n_embd_head_k=None, rope=None, semantics="2025",
    kv_unified=True, cell_ext=False, ple_token=None)``

    - ``kv_size``: cells of the base cache (per stream; a positive multiple of ``n_pad``).
    - ``n_layer``, ``n_embd_k_gqa``, ``n_embd_v_gqa``: model layers and their K / V row widths
      (one int or one per model layer), as for :class:`UnifiedCache`.
    - ``swa_layers``: the model layers that use the sliding window (indices, or a predicate
      ``il -> bool``); the others go to the base cache.
    - ``n_swa`` (> 0) and ``swa_type`` (``"standard"`` or ``"chunked"``): the window.
    - ``n_batch``: the largest ubatch (llama.cpp's ``n_ubatch``); the SWA cache gets enough cells
      for every sequence's window plus one ubatch (:func:`kvcache.plan.swa_size`): in the 2025
      semantics ``min(kv_size, pad(n_swa * n_seq_max + n_batch, n_pad))``, today's
      ``pad(min(kv_size, n_swa * (n_seq_max if kv_unified else 1) + n_batch), 256)``.
    - ``swa_full``: give the SWA cache ``kv_size`` cells (and, semantics "2025", never prune
      it). None (default): the default of the semantics, False for "2025", True for "2026".
    - ``semantics``: "2025" (llama.cpp's iSWA cache as of mid-2025, llama-cpp-python 0.3.10,
      described below) or "2026" (today's llama.cpp): both caches are
      ``UnifiedCache(semantics="2026")``, the SWA one reusing the cells its window has left
      instead of being pruned; ``find_slot`` places a ubatch in both
      or in neither (no commit / restore / set_full / sbatch_init / defrag: ValueError),
      ``prepare`` is the dry run of both, ``update`` performs both caches' stream copies and
      shifts (docs/semantics.md).
    - ``kv_unified`` (semantics "2026"): False gives both caches a stream per sequence.
    - ``cell_ext``, ``ple_token`` (semantics "2026"): the per-cell extension in both caches, as
      for :class:`UnifiedCache`.
    - ``buffers``: "owned", None / "none" (metadata only) for both caches, or the borrowed
      (K, V) pairs of every model layer: a dict ``{layer: (K, V)}`` or a list indexed by model
      layer; each cache gets its layers' pairs (see :class:`UnifiedCache`).
    - the other arguments (``n_embd_head_k`` and the model's ``rope`` among them) are passed to
      both caches.

    One decode step, as llama.cpp does it::

        batch = kvcache.Batch(pos, seq_id)              # simple_split=True
        for ub in cache.ubatches(batch, n_ubatch):      # records the batch's ranges
            if not cache.find_slot(ub):
                cache.restore(); break
            for il in range(cache.n_layer):
                cache.store(il, k_rows, v_rows)         # goes to the cache holding layer il
            base_mask, swa_mask = cache.kq_mask(ub)
        else:
            cache.commit()                              # then prunes the SWA cache

    Every operation is applied to both caches as llama.cpp does (both are always called);
    arguments are checked before either changes. Sequence positions (``seq_pos_min/max``) are
    answered by the SWA cache. A state is the base cache's part followed by the SWA cache's.

    Thread-safe: every operation holds the locks of both caches (see :class:`UnifiedCache`),
    so it is atomic for other threads, and one that raises leaves both caches as they were.
    """

    __slots__ = ("_base", "_swa", "_swa_layers", "_n_batch", "_swa_full", "_pending",
                 "_hold", "_op", "_today")

    # buffers for both caches: a mode name, or the pairs of each cache's layers
    @staticmethod
    def _split_buffers(buffers: _Buffers, n_layer: int, swa_set: frozenset[int]) -> tuple[_Buffers, _Buffers]:
        if buffers is None or isinstance(buffers, str):
            return buffers, buffers
        if isinstance(buffers, dict):
            pairs = buffers
        elif isinstance(buffers, (list, tuple)):
            if len(buffers) != n_layer:
                raise ValueError(f"buffers has {len(buffers)} entries, expected one (K, V) pair per model "
                                 f"layer ({n_layer})")
            pairs = dict(enumerate(buffers))
        else:
            raise TypeError(f"buffers must be 'owned', None, 'none', a dict {{layer: (K, V)}} or a list of "
                            f"(K, V) pairs, not {type(buffers).__name__}")
        base = {il: kv for il, kv in pairs.items() if il not in swa_set}
        swa = {il: kv for il, kv in pairs.items() if il in swa_set}
        return base, swa

    @named_errors
    def __init__(self, kv_size: int, n_layer: int, n_embd_k_gqa: _PerLayer, n_embd_v_gqa: _PerLayer,
                 swa_layers: Iterable[int] | Callable[[int], bool], n_swa: int,
                 swa_type: Literal["standard", "chunked"] = "standard", n_batch: int = 512,
                 swa_full: bool | None = None, type_k: _GGMLType = "f16", type_v: _GGMLType = "f16",
                 v_trans: bool = True, n_seq_max: int = 1, n_pad: int = 32, buffers: _Buffers = "owned",
                 n_embd_head_k: _PerLayer | None = None, rope: RopeParams | None = None,
                 semantics: Literal["2025", "2026"] = "2025", kv_unified: bool = True, cell_ext: bool = False,
                 ple_token: int | None = None):
        n_layer = int_arg(n_layer, "n_layer", 0, 2**31 - 1)
        layers = layers_arg(swa_layers, n_layer, "swa_layers", any_order=True)
        n_swa = int_arg(n_swa, "n_swa", 1, 2**31 - 1)
        if swa_type not in _SWA_TYPES:
            raise ValueError(f"swa_type = {swa_type!r}: expected one of {', '.join(map(repr, _SWA_TYPES))}")
        n_batch = int_arg(n_batch, "n_batch", 1, 2**31 - 1)
        if not isinstance(semantics, str) or semantics not in SEMANTICS:
            raise ValueError(f"semantics = {semantics!r}: expected one of {', '.join(map(repr, SEMANTICS))}")
        today = semantics == "2026"
        swa_full = bool_arg(today if swa_full is None else swa_full, "swa_full")
        kv_unified = bool_arg(kv_unified, "kv_unified")
        kv_size = int_arg(kv_size, "kv_size", 1, 2**32 - 1)
        n_pad = int_arg(n_pad, "n_pad", 1, 2**32 - 1)
        n_seq_max = n_seq_max_arg(n_seq_max)
        size_swa = swa_size(kv_size, n_swa, n_seq_max, n_batch, n_pad, swa_full, semantics, kv_unified)
        swa_set = frozenset(layers)
        common: dict[str, Any] = dict(n_layer=n_layer, n_embd_k_gqa=n_embd_k_gqa, n_embd_v_gqa=n_embd_v_gqa, type_k=type_k,
                      type_v=type_v, v_trans=v_trans, n_seq_max=n_seq_max, n_pad=n_pad,
                      n_embd_head_k=n_embd_head_k, rope=rope, semantics=semantics, kv_unified=kv_unified,
                      cell_ext=cell_ext, ple_token=ple_token)
        buf_base, buf_swa = self._split_buffers(buffers, n_layer, swa_set)
        self._base: UnifiedCache = UnifiedCache(kv_size=kv_size, n_swa=0, swa_type="none", buffers=buf_base,
                                  layers=[il for il in range(n_layer) if il not in swa_set], **common)
        self._swa: UnifiedCache = UnifiedCache(kv_size=size_swa, n_swa=n_swa, swa_type=swa_type, layers=list(layers),
                                 buffers=buf_swa, **common)
        self._swa_layers = layers
        self._n_batch = n_batch
        self._swa_full = swa_full
        self._today = today
        self._pending = SWAPending()
        self._hold = _Hold(self._base, self._swa)   # both caches' locks, in the global order
        # the same, as one operation of both: a callback it runs (a file's write(), an array
        # exporter's hooks) cannot change either cache under it
        self._op = _Hold(self._base, self._swa, busy=True)

    # --- the parts and the geometry (read-only) ----------------------------------------------
    base: _Attr[UnifiedCache] = _Attr('The cache of the full-attention layers (kv_size cells, no window).', "", '_base')
    swa: _Attr[UnifiedCache] = _Attr('The cache of the sliding-window layers.', "", '_swa')
    n_layer: _Attr[int] = _Attr('Number of model layers.')
    swa_layers: _Attr[tuple[int, ...]] = _Attr('Model layers held by the SWA cache, ascending.', "_swa", "layers")
    base_layers: _Attr[tuple[int, ...]] = _Attr('Model layers held by the base cache, ascending.', "_base", "layers")
    n_swa: _Attr[int] = _Attr('Sliding window size.', "_swa")
    swa_type: _Attr[str] = _Attr("'standard' or 'chunked'.", "_swa")
    semantics: _Attr[str] = _Attr("'2025' (llama.cpp's iSWA cache as of mid-2025) or '2026' (today's llama.cpp), "
                                  "as both caches have it.")
    kv_unified: _Attr[bool] = _Attr('True when every sequence shares one stream in both caches.')
    cell_ext: _Attr[bool] = _Attr("True when both caches' cells carry the per-cell extension (see UnifiedCache).")
    ple_token: _Attr[int | None] = _Attr('The token id a ubatch without token ids stores (see UnifiedCache), or None.')
    n_stream: _Attr[int] = _Attr('Streams of each cache (1, or n_seq_max when not kv_unified).')
    n_seq_max: _Attr[int] = _Attr('Valid sequence ids are [0, n_seq_max).')
    size_base: _Attr[int] = _Attr('Cells of the base cache.', "_base", "size")
    size_swa: _Attr[int] = _Attr('Cells of the SWA cache.', "_swa", "size")
    buffers: _Attr[_BufferMode] = _Attr("How the K/V memory is held: 'owned', 'borrowed' or 'none' (see UnifiedCache).")
    n_embd_head_k: _Attr[tuple[int, ...] | None] = _Attr('K head size per model layer, or None.')
    rope: _Attr[RopeParams | None] = _Attr("The model's RopeParams (update() rotates K with them), or None.")
    n_batch: _Attr[int] = _Attr('The batch size the SWA cache was sized for.', "", '_n_batch')
    swa_full: _Attr[bool] = _Attr('True when the SWA cache has kv_size cells (semantics "2025": and is never pruned).',
                                  "", '_swa_full')

    @property
    def n_threads(self) -> int:
        """Threads a large K/V move may use, in both caches (see UnifiedCache.n_threads)."""
        return self._base.n_threads

    @n_threads.setter
    def n_threads(self, value: int) -> None:
        with self._hold:
            self._base.n_threads = value
            self._swa.n_threads = value

    @property
    def can_shift(self) -> bool:
        """Whether a K-shift may be applied: only when both caches have the same size (a smaller
        SWA cache has pruned cells whose positions a shift would need). Semantics "2026": what
        today's ``llama_memory_can_shift`` answers (the same rule); update() shifts anyway."""
        return self._base.size == self._swa.size

    @property
    def has_shift(self) -> bool:
        """True when either cache has a pending K-shift."""
        with self._hold:
            return self._base.has_shift or self._swa.has_shift

    @property
    def pending(self) -> list[list[int]]:
        """The pruning ranges recorded by the last sbatch_init: ``[[seq, pmin, pmax], ...]``."""
        return self._pending.items()

    @property
    def size_k_bytes(self) -> int:
        """Bytes of K memory of both caches."""
        return self._base.size_k_bytes + self._swa.size_k_bytes

    @property
    def size_v_bytes(self) -> int:
        """Bytes of V memory of both caches."""
        return self._base.size_v_bytes + self._swa.size_v_bytes

    @property
    def total_size(self) -> int:
        """size_k_bytes + size_v_bytes."""
        return self.size_k_bytes + self.size_v_bytes

    def __repr__(self) -> str:
        return (f"ISWACache(kv_size={self._base.size}, n_layer={self.n_layer}, swa_layers={list(self._swa_layers)}, "
                f"n_swa={self.n_swa}, swa_type={self.swa_type!r}, n_batch={self._n_batch}, "
                f"swa_full={self._swa_full}, n_seq_max={self.n_seq_max}, size_swa={self._swa.size}"
                + (f", semantics='2026', kv_unified={self.kv_unified}"
                   + (", cell_ext=True)" if self.cell_ext else ")") if self._today else ")"))

    def _refuse_2026(self, what: str, why: str) -> None:
        # checked before either cache is touched
        if self._today:
            raise ValueError(f"{what}: an iSWA cache of semantics '2026' has no {what} ({why})")

    def _parts_2025(self) -> tuple[UnifiedCache2025, UnifiedCache2025]:
        # the two caches of semantics "2025" (the caller refused "2026" first)
        return cast(UnifiedCache2025, self._base), cast(UnifiedCache2025, self._swa)

    # --- batches ---------------------------------------------------------------------------
    def sbatch_init(self, batch_or_pos: Any, seq_id: Any = None) -> list[list[int]]:
        """Record, per sequence, the smallest and largest position of a whole batch: commit()
        prunes the SWA cache with these ranges. Nothing is recorded with ``swa_full``.

        ``batch_or_pos``: a :class:`Batch` (then ``seq_id`` is not given), or the positions of
        the batch with ``seq_id`` one id or id list per token. Returns :attr:`pending`.
        Semantics "2026" has no pruning ranges (ValueError)."""
        self._refuse_2026("sbatch_init", "find_slot reuses the cells a window has left")
        if isinstance(batch_or_pos, Batch):
            if seq_id is not None:
                raise TypeError("sbatch_init: seq_id must not be given with a Batch")
            batch: Batch | UBatch = batch_or_pos
        else:
            if seq_id is None:
                raise TypeError("sbatch_init: seq_id is required with positions")
            batch = UBatch(batch_or_pos, seq_id)
        self._pending.set(batch, self.n_seq_max, not self._swa_full)
        return self._pending.items()

    def ubatches(self, batch: Batch, n_ubatch: int, embd_pooled: bool = False) -> Iterator[SplitUBatch]:
        """Record the batch's pruning ranges (sbatch_init), then iterate over its ubatches of at
        most ``n_ubatch`` tokens, split in batch order as llama.cpp does for this cache (the
        Batch must be built with ``simple_split=True``; ``embd_pooled`` changes nothing).
        Semantics "2026": the splits of UnifiedCache.ubatches (equal splits with several
        streams), nothing recorded."""
        if self._today:
            return self._base.ubatches(batch, n_ubatch, embd_pooled)
        if not isinstance(batch, Batch):
            raise TypeError(f"batch must be a Batch, not {type(batch).__name__}")
        if not batch.simple_split:
            raise ValueError("this cache splits batches in order: build the Batch with simple_split=True")
        it = batch.ubatches(n_ubatch, "simple")
        self.sbatch_init(batch)
        return it

    # --- slots -----------------------------------------------------------------------------
    def find_slot_each(self, ub: UBatch) -> tuple[bool, bool]:
        """Place the ubatch in the base cache, then in the SWA cache (both are always tried);
        returns each cache's result. When the SWA cache raises (MemoryError), the base
        cache's placement is undone: both are as they were. Semantics "2026": the ubatch is
        placed in both caches when each found room, else in neither (as today's llama.cpp
        prepares both before it applies either); the results say which found room."""
        ok_base, ok_swa = _find_slot_parts((self._base, self._swa), ub)
        return ok_base, ok_swa

    def find_slot(self, ub: UBatch) -> bool:
        """Place the ubatch in both caches; True when both found room (restore() undoes it;
        semantics "2026": placed for good, and a False changed nothing)."""
        ok_base, ok_swa = self.find_slot_each(ub)
        return ok_base and ok_swa

    def prepare(self, ubatches: Iterable[UBatch]) -> tuple[list[_SlotInfo], list[_SlotInfo]] | None:
        """The dry run of placing several ubatches in turn in both caches (semantics "2026", see
        UnifiedCache.prepare): ``(base_slot_infos, swa_slot_infos)``, or None when one does not
        fit in either cache. Both caches are left exactly as they were."""
        ubs = list(ubatches)
        with self._hold:
            base = cast(UnifiedCache2026, self._base).prepare(ubs)
            swa = cast(UnifiedCache2026, self._swa).prepare(ubs)
        if base is None or swa is None:
            return None
        return base, swa

    def slot_info(self) -> tuple[_SlotInfo, _SlotInfo]:
        """Where the last successful find_slot put each token in each cache:
        ``(base.slot_info(), swa.slot_info())``."""
        with self._hold:
            return self._base.slot_info(), self._swa.slot_info()

    def slot_indices(self, out: tuple[Any, Any] | None = None) -> tuple[Any, Any]:
        """The cell of each placed token in each cache: ``(base.slot_indices(),
        swa.slot_indices())`` (see UnifiedCache.slot_indices); ``out``: None or a pair of
        buffers to fill."""
        out_base, out_swa = _out_pair(out)
        with self._hold:
            return self._base.slot_indices(out_base), self._swa.slot_indices(out_swa)

    def commit(self) -> None:
        """Keep what find_slot placed in both caches, then slide the window: every sequence of
        the last sbatch_init loses the SWA cells no position of that batch can see. Warns
        (:class:`SWAWarning`) when a sequence's window was only partly in the SWA cache."""
        self._refuse_2026("commit", "find_slot places for good; prepare() is the dry run")
        partial = []
        base, swa = self._parts_2025()
        with self._hold:
            base.commit()
            swa.commit()
            pending = self._pending.items()
            self._pending.clear()
            for s, pmin, pmax in pending:
                if swa.prune_swa(s, pmin, pmax):
                    partial.append((s, pmin))
        # warned once every sequence is pruned (a warning turned into an error stops nothing)
        for s, pmin in partial:
            warnings.warn(f"partial SWA cache for sequence {s}: fewer than min(n_swa = {self.n_swa}, "
                          f"pmin = {pmin}) cells before position {pmin} are in the cache; information "
                          f"may have been lost", SWAWarning, stacklevel=2)

    def restore(self) -> None:
        """Undo the find_slot calls of both caches since the last commit (data is kept)."""
        self._refuse_2026("restore", "find_slot places for good; prepare() is the dry run")
        base, swa = self._parts_2025()
        with self._hold:
            base.restore()
            swa.restore()

    def set_full(self) -> None:
        """n = size and head = 0 in both caches (worst-case graph reservation)."""
        self._refuse_2026("set_full", "n_kv follows each stream's cells")
        base, swa = self._parts_2025()
        with self._hold:
            base.set_full()
            swa.set_full()

    def clear(self) -> None:
        """Empty both caches (the pending ranges are kept, as llama.cpp does)."""
        with self._hold:
            self._base.clear()
            self._swa.clear()

    # --- sequences -------------------------------------------------------------------------
    def seq_rm(self, seq_id: int, p0: int = -1, p1: int = -1) -> bool:
        """Remove seq_id (-1: any) from the cells with p0 <= pos < p1 of both caches."""
        with self._hold:
            ok_base = self._base.seq_rm(seq_id, p0, p1)
            ok_swa = self._swa.seq_rm(seq_id, p0, p1)
        return ok_base and ok_swa

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        """Add dst to every cell of src with p0 <= pos < p1, in both caches. Semantics "2026"
        with several streams: across streams whole sequences only (ValueError otherwise,
        nothing changed; the base cache, never smaller, refuses whatever the SWA cache would)."""
        with self._hold:
            self._base.seq_cp(src, dst, p0, p1)
            self._swa.seq_cp(src, dst, p0, p1)

    def seq_keep(self, seq_id: int) -> None:
        """Keep only seq_id, in both caches."""
        with self._hold:
            self._base.seq_keep(seq_id)
            self._swa.seq_keep(seq_id)

    def seq_add(self, seq_id: int, p0: int, p1: int, shift: int) -> None:
        """Shift the positions of seq_id in [p0, p1), in both caches."""
        with self._hold:
            self._base.seq_add(seq_id, p0, p1, shift)
            self._swa.seq_add(seq_id, p0, p1, shift)

    def seq_div(self, seq_id: int, p0: int, p1: int, d: int) -> None:
        """Integer-divide the positions of seq_id in [p0, p1) by d (> 0), in both caches."""
        with self._hold:
            self._base.seq_div(seq_id, p0, p1, d)
            self._swa.seq_div(seq_id, p0, p1, d)

    def seq_pos_min(self, seq_id: int) -> int:
        """Smallest position of seq_id in the SWA cache (-1 when absent)."""
        return self._swa.seq_pos_min(seq_id)

    def seq_pos_max(self, seq_id: int) -> int:
        """Largest position of seq_id (the SWA cache's answer; -1 when absent)."""
        return self._swa.seq_pos_max(seq_id)

    # --- K/V data --------------------------------------------------------------------------
    def cache_of(self, il: int) -> UnifiedCache:
        """The cache holding model layer il."""
        if not isinstance(il, (int, np.integer)) or isinstance(il, (bool, np.bool_)):
            raise TypeError(f"il must be an int (a model layer index), not {type(il).__name__}")
        if not 0 <= il < self.n_layer:
            raise IndexError(f"il = {il} is not a model layer (n_layer = {self.n_layer})")
        return self._swa if int(il) in self._swa_layers else self._base

    def k(self, il: int) -> npt.NDArray[Any]:
        """K of model layer il (a view into the cache holding it)."""
        return self.cache_of(il).k(il)

    def v(self, il: int) -> npt.NDArray[Any]:
        """V of model layer il (a view into the cache holding it)."""
        return self.cache_of(il).v(il)

    def store(self, il: int, k_rows: npt.NDArray[Any] | None, v_rows: npt.NDArray[Any] | None) -> None:
        """Write the K/V rows of model layer il for the ubatch just placed (see UnifiedCache.store)."""
        self.cache_of(il).store(il, k_rows, v_rows)

    # --- graph inputs ----------------------------------------------------------------------
    def kq_mask(self, ub: UBatch, causal: bool = True, alibi: bool = False,
                out: tuple[npt.NDArray[Any], npt.NDArray[Any]] | None = None,
                dtype: _MaskDType = "f32", pad: bool | None = None) -> tuple[npt.NDArray[Any], npt.NDArray[Any]]:
        """The KQ masks of ub against both caches: ``(base_mask, swa_mask)``; the SWA mask also
        hides what lies outside the window. ``out``: None or a pair of arrays to fill; ``pad``
        (None: the semantics' default) and the shapes as UnifiedCache.kq_mask."""
        out_base, out_swa = _out_pair(out)
        with self._op:
            return (self._base.kq_mask(ub, causal=causal, alibi=alibi, out=out_base, dtype=dtype, pad=pad),
                    self._swa.kq_mask(ub, causal=causal, alibi=alibi, out=out_swa, dtype=dtype, pad=pad))

    def k_shift(self) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.int32]]:
        """The per-cell K-shift inputs of both caches: ``(base_shift, swa_shift)``."""
        with self._hold:
            return self._base.k_shift(), self._swa.k_shift()

    def reset_shift(self) -> None:
        """Clear the pending shifts of both caches (after the K-shift was applied)."""
        with self._hold:
            self._base.reset_shift()
            self._swa.reset_shift()

    # --- maintenance -----------------------------------------------------------------------
    def defrag_sched(self, thold: float) -> None:
        """Schedule a defrag in each cache whose fragmentation exceeds thold."""
        self._refuse_2026("defrag_sched", "today's llama.cpp does not defragment")
        if not isinstance(thold, (int, float, np.integer, np.floating)) or isinstance(thold, (bool, np.bool_)):
            raise TypeError(f"thold must be a number, not {type(thold).__name__}")
        base, swa = self._parts_2025()
        with self._hold:
            base.defrag_sched(thold)
            swa.defrag_sched(thold)

    def update(self, rope: RopeParams | None = None, n_max_nodes: int = 65536) -> ISWAUpdatePlan:
        """Apply the pending K-shift and scheduled defrag of both caches (UnifiedCache.update).

        A K-shift needs :attr:`can_shift`: with a pending shift and caches of different sizes
        this raises RuntimeError and changes nothing. Returns the two caches' UpdatePlans; its
        truth is what llama.cpp's iSWA update returns, the AND of the two. Semantics "2026":
        each cache's StreamUpdate (its stream copies, then its shifts), whatever can_shift
        says: today's llama.cpp shifts each cache's own cells (a position the SWA cache has
        dropped is not needed; can_shift is only what ``llama_memory_can_shift`` reports)."""
        with self._hold:
            if self.has_shift and not self.can_shift and not self._today:
                raise RuntimeError(f"update: a K-shift is pending but this cache cannot shift (SWA cache of "
                                   f"{self._swa.size} cells, base cache of {self._base.size}: build it with "
                                   f"swa_full=True to allow position shifts)")
            if self._today:
                for c in (self._base, self._swa):
                    c._check_update(rope, n_max_nodes)
                return ISWAUpdatePlan(self._base.update(rope, n_max_nodes), self._swa.update(rope, n_max_nodes))
            # arguments, rotations and their memory are checked for both caches before either changes
            base, swa = _update_parts((self._base, self._swa), rope, n_max_nodes)
        return ISWAUpdatePlan(base, swa)

    # --- state -----------------------------------------------------------------------------
    def state_size(self, seq_id: int = -1, *, layout: str = DEFAULT_LAYOUT, prefix: bool | None = None) -> int:
        """Bytes state_write(seq_id, layout=layout, prefix=prefix) produces."""
        return _state_size_parts((self._base, self._swa), seq_id, layout, prefix)

    def state_write(self, seq_id: int = -1, *, layout: str = DEFAULT_LAYOUT, prefix: bool | None = None) -> bytes:
        """The state of seq_id (-1: everything) in llama.cpp's layout ``layout`` (a name of
        kvcache.LAYOUTS): the base cache's part, then the SWA cache's; a sequence's state of a
        layout with the sequence-blob prefix starts with it once (prefix=False: without). From
        "2026-06" on a sequence's state leaves out the SWA cache's cells outside the window."""
        return _state_write_parts((self._base, self._swa), seq_id, layout, prefix)

    def state_write_into(self, buf: Buffer | _BinaryWriter, seq_id: int = -1, *, layout: str = DEFAULT_LAYOUT,
                         prefix: bool | None = None) -> int:
        """Write the state of seq_id (-1: everything) into buf: a writable buffer of at least
        state_size(seq_id) bytes (each cache writes its part straight into it) or a binary file
        object. Returns the bytes written. layout, prefix: as state_write."""
        with self._op:
            return self._state_write_into(buf, seq_id, layout, prefix)

    def _state_write_into(self, buf: Any, seq_id: int, layout: str, prefix: bool | None) -> int:
        n_base = self._base.state_size(seq_id, layout=layout, prefix=prefix)
        n = n_base + self._swa.state_size(seq_id, layout=layout, prefix=False)
        try:
            m = memoryview(buf)  # a file object raises TypeError
        except TypeError:
            m = None
        if m is None:
            if not hasattr(buf, "write"):
                raise TypeError(f"buf must be a writable buffer or a binary file object, not {type(buf).__name__}")
            return (self._base.state_write_into(buf, seq_id, layout=layout, prefix=prefix) +
                    self._swa.state_write_into(buf, seq_id, layout=layout, prefix=False))
        if m.readonly:
            raise TypeError(f"buf must be writable ({type(buf).__name__} is read-only)")
        if not m.c_contiguous:
            raise ValueError("buf must be a C-contiguous buffer")
        m = m.cast("B") if m.ndim != 1 or m.format != "B" else m
        if m.nbytes < n:
            raise ValueError(f"buf holds {m.nbytes} bytes, the state needs {n}")
        return (self._base.state_write_into(m[:n_base], seq_id, layout=layout, prefix=prefix) +
                self._swa.state_write_into(m[n_base:n], seq_id, layout=layout, prefix=False))

    def seq_export(self, seq_id: int) -> PartsExport:
        """Sequence seq_id ready for a transfer: each cache's export (UnifiedCache.seq_export),
        the base cache's then the SWA cache's, framed as one header, their regions in that
        order (semantics "2026": the SWA cache's without the cells outside the window, as the
        sequence's state). See docs/disaggregated.md."""
        return PartsExport([self._base.seq_export(seq_id), self._swa.seq_export(seq_id)])

    def seq_import_begin(self, header: Buffer, seq_id: int | None = None) -> PartsImport:
        """Begin receiving the sequence a PartsExport header describes (UnifiedCache.seq_import_begin
        for each cache: both begun, or neither, StateError then); its commit() checks both parts
        before committing either; abort() or an exception in ``with`` leaves both as they were."""
        h_base, h_swa = split_parts(header, 2)
        first = self._base.seq_import_begin(h_base, seq_id)
        try:
            second = self._swa.seq_import_begin(h_swa, seq_id)
        except BaseException:
            first.abort()
            raise
        return PartsImport([first, second])

    def state_read(self, data: Buffer, seq_id: int = -1, *, convert: bool = False, exact: bool = False,
                   layout: str | None = None) -> int:
        """Restore a state written by state_write (or llama.cpp) into seq_id (-1: everything).

        All or nothing: when any part is malformed, does not fit or finds no room, StateError is
        raised and both caches (cells, K/V bytes, uncommitted slots) and the pending ranges are
        exactly as they were. Returns the bytes consumed (bytes after the state are not read,
        unless exact: then they are an error). convert: accept parts whose V layout (transposed
        or not) differs from the caches' and convert them. layout: a name of kvcache.LAYOUTS,
        or None to find it from the bytes (as UnifiedCache.state_read)."""
        return _state_read_parts((self._base, self._swa), data, seq_id, convert=convert, exact=exact,
                                 layout=layout)
