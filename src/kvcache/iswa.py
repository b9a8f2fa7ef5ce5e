"""The interleaved sliding-window cache: llama.cpp's ``llama_kv_cache_unified_iswa``.

Models such as Gemma 2/3 or Llama 4 alternate layers that attend to the whole context with
layers that attend only to a sliding window. :class:`ISWACache` keeps the two kinds in two
:class:`kvcache.UnifiedCache` objects — ``base`` for the full-attention layers and ``swa`` for
the windowed ones, usually much smaller — and drives them together."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal, overload

from kvcache import _signatures
from kvcache._core import (ISWAUpdatePlan, SWAWarning, _ISWA, _ISWA2025, _ISWA2026, _seq_export_parts,
                           _seq_import_begin_parts)
from kvcache.handoff import PartsExport, PartsImport, split_parts
from kvcache.plan import SEMANTICS

if TYPE_CHECKING:
    from typing_extensions import Buffer

    from kvcache.unified import UnifiedCache

__all__ = ["ISWACache", "ISWACache2025", "ISWACache2026", "ISWAUpdatePlan", "SWAWarning"]


class ISWACache(_ISWA):
    """An interleaved sliding-window KV cache: a base cache for the full-attention layers and a
    SWA cache for the sliding-window layers, driven together.

    ``ISWACache(kv_size, n_layer, n_embd_k_gqa, n_embd_v_gqa, swa_layers, n_swa,
    swa_type="standard", n_batch=512, swa_full=None, type_k="f16", type_v="f16", v_trans=True,
    n_seq_max=1, n_pad=32, buffers="owned", n_embd_head_k=None, rope=None, semantics="2025",
    kv_unified=True, cell_ext=False, ple_token=None, layers=None)`` makes an :class:`ISWACache2025` or, with
    ``semantics="2026"``, an :class:`ISWACache2026`: each class is one semantics, and has the
    operations of that semantics only.

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
      or in neither (an ISWACache2026 has no commit / restore / set_full / sbatch_init /
      defrag_sched), ``prepare`` is the dry run of both, ``update`` performs both caches'
      stream copies and shifts (docs/semantics.md).
    - ``kv_unified`` (semantics "2026"): False gives both caches a stream per sequence.
    - ``cell_ext``, ``ple_token`` (semantics "2026"): the per-cell extension in both caches, as
      for :class:`UnifiedCache`.
    - ``buffers``: "owned", None / "none" (metadata only) for both caches, or the borrowed
      (K, V) pairs of every model layer: a dict ``{layer: (K, V)}`` or a list indexed by model
      layer; each cache gets its layers' pairs (see :class:`UnifiedCache`).
    - ``layers``: the model layers with K/V (indices or a predicate; default every layer): a
      hybrid model's attention layers (:class:`kvcache.HybridCache` with a window); the others
      belong to neither cache. ``swa_layers`` must be among them.
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

    __slots__ = ()

    # ISWACache(...) is the ISWACache2025 or ISWACache2026 its semantics asks for (the
    # parameters: kvcache._signatures.iswa, the compiled class's __new__ for typing)
    @overload
    def __new__(cls, *args: Any, semantics: Literal["2026"], **kwargs: Any) -> ISWACache2026: ...
    @overload
    def __new__(cls, *args: Any, semantics: Literal["2025"] | None = ..., **kwargs: Any) -> ISWACache2025: ...
    @overload
    def __new__(cls, *args: Any, semantics: str | None, **kwargs: Any) -> ISWACache: ...

    def __new__(cls, *args: Any, **kwargs: Any) -> ISWACache:
        made: ISWACache = _signatures.factory_make(ISWACache, cls, _signatures.iswa, args, kwargs, _BY_SEMANTICS)
        return made

    if TYPE_CHECKING:
        # the parts are UnifiedCache objects (the compiled class knows them as its base class)
        @property
        def base(self) -> UnifiedCache: ...
        @property
        def swa(self) -> UnifiedCache: ...
        def cache_of(self, il: int) -> UnifiedCache: ...

    def seq_export(self, seq_id: int) -> PartsExport:
        """Sequence seq_id ready for a transfer: each cache's export (UnifiedCache.seq_export),
        the base cache's then the SWA cache's, framed as one header, their regions in that
        order (semantics "2026": the SWA cache's without the cells outside the window, as the
        sequence's state). See docs/disaggregated.md."""
        return PartsExport(_seq_export_parts((self.base, self.swa), seq_id))

    def seq_import_begin(self, header: Buffer, seq_id: int | None = None) -> PartsImport:
        """Begin receiving the sequence a PartsExport header describes (UnifiedCache.seq_import_begin
        for each cache: both begun, or neither, StateError then); its commit() checks both parts
        before committing either; abort() or an exception in ``with`` leaves both as they were."""
        return PartsImport(_seq_import_begin_parts((self.base, self.swa), split_parts(header, 2), seq_id))


class ISWACache2025(_ISWA2025, ISWACache):
    """The iSWA cache of llama.cpp as of mid-2025 (llama-cpp-python 0.3.10): what
    ``ISWACache(...)`` makes by default. find_slot places a ubatch in both caches, restore()
    undoes the placements since the last commit(), which keeps them and prunes the SWA cache
    with the ranges the batch's split recorded (ubatches / sbatch_init); set_full and
    defrag_sched as UnifiedCache's. See :class:`ISWACache` for the arguments."""

    __slots__ = ()


class ISWACache2026(_ISWA2026, ISWACache):
    """Today's llama.cpp iSWA cache (llama-cpp-python 0.3.36): what ``ISWACache(...,
    semantics="2026")`` makes. find_slot places a ubatch in both caches for good, or in
    neither; prepare() is the dry run; update() performs both caches' stream copies and
    shifts. See :class:`ISWACache` for the arguments (semantics None or "2026")."""

    __slots__ = ()


_CLASSES: tuple[type[ISWACache], ...] = (ISWACache2025, ISWACache2026)
_BY_SEMANTICS = dict(zip(SEMANTICS, _CLASSES))
