"""The unified KV cache: llama.cpp's ``llama_kv_cache_unified`` over owned, borrowed or no K/V memory,
in either semantics: :class:`UnifiedCache2025` (llama.cpp as of mid-2025) and :class:`UnifiedCache2026`
(today's llama.cpp), both a :class:`UnifiedCache`, which makes the one its ``semantics`` names."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterator, Literal, overload

from kvcache import _signatures
from kvcache._core import (Batch, Cells, SeqExport, SeqImport, SplitUBatch, StreamUpdate, UpdatePlan, _seq_export,
                           _seq_import_begin, _Unified, _Unified2025, _Unified2026)
from kvcache.plan import SEMANTICS

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = ["UnifiedCache", "UnifiedCache2025", "UnifiedCache2026", "Cells", "StreamUpdate", "UpdatePlan"]

class UnifiedCache(_Unified):
    """A unified KV cache: ``kv_size`` cells shared by up to ``n_seq_max`` sequences.

    ``UnifiedCache(kv_size, n_layer, n_embd_k_gqa, n_embd_v_gqa, type_k="f16", type_v="f16",
    v_trans=True, n_seq_max=1, n_pad=32, n_swa=0, swa_type="none", layers=None, buffers="owned",
    n_embd_head_k=None, rope=None, semantics="2025", kv_unified=True, cell_ext=False, ple_token=None)``
    makes a :class:`UnifiedCache2025` (``semantics="2025"``, the default: the mid-2025 llama.cpp
    cache) or a :class:`UnifiedCache2026` (``semantics="2026"``: today's llama.cpp cache,
    docs/semantics.md); both are UnifiedCache instances and can be made directly (without
    ``semantics``). This class has what both have; each adds what only its llama.cpp has.

    - ``kv_size``: number of cells, a positive multiple of ``n_pad``.
    - ``n_layer``: number of model layers; ``n_embd_k_gqa`` / ``n_embd_v_gqa``: K / V row width
      in elements, one int for all layers or one per model layer.
    - ``type_k`` / ``type_v``: ggml type names ("f32", "f16", "bf16", "q8_0", "q4_0", ...).
    - ``v_trans``: store V transposed (needs a V type with one element per block).
    - ``n_seq_max``: valid sequence ids are ``[0, n_seq_max)``, at most ``kvcache.MAX_SEQ`` (256).
    - ``n_swa`` / ``swa_type``: sliding window ("none", "standard" or "chunked").
    - ``layers``: the model layers this cache holds: None (all), ascending indices, or a
      predicate ``il -> bool``.
    - ``buffers``: who holds the K/V memory:

      - ``"owned"`` (default): the cache allocates zeroed, 64-byte aligned numpy arrays
        (``k(il)`` / ``v(il)`` are views of them, exportable through DLPack);
      - borrowed: a dict ``{layer: (K, V)}`` over the kept model layers, or a list of (K, V)
        pairs in ``layers`` order, of host buffers the caller allocated (numpy arrays,
        memoryviews, CPU tensors with ``__dlpack__``): C-contiguous, writable, aligned, of the
        element dtype of the type (see ``kvcache.view_dtype``) or raw uint8, and at least
        ``size * row_bytes`` bytes (V transposed: ``n_embd_v * size`` elements). The cache
        keeps them alive and never reallocates them;
      - ``None`` / ``"none"``: metadata only, for K/V living elsewhere (a GPU): the cache does
        all the bookkeeping and hands over plans: ``slot_indices()`` after find_slot,
        ``k_shift()`` and what ``update()`` returns (the 2025 cache's ``defrag_runs()`` too).
        ``k``, ``v`` and ``store`` raise RuntimeError; ``state_write`` writes zero K/V bytes
        and ``state_read`` restores the cells only (the data is the owner's to save and restore).
    - ``n_embd_head_k``: K head size (one int, or one per model layer), needed to rotate keys;
      each K row holds ``n_embd_k_gqa / n_embd_head_k`` heads.
    - ``rope``: the model's ``RopeParams`` (``update()`` rotates shifted keys with them), or
      None for a model without RoPE. ``kvcache.from_gguf`` fills these from a model file.
    - ``semantics``: ``"2025"`` or ``"2026"``, the class made (see above).
    - ``kv_unified``, ``cell_ext``, ``ple_token``: today's streams and per-cell extension, for
      semantics "2026" only (see :class:`UnifiedCache2026`).

    After sequence edits (``seq_add`` / ``seq_div``, a context shift) and before the next
    decode, ``cache.update()`` rotates the cached keys to their new positions.

    The cache is thread-safe: every method holds the cache's own lock for the whole
    operation, also while it runs without the GIL, so calls from several threads are
    serialized (a thread waiting for the lock does not hold the GIL; free-threaded CPython
    is supported). The views returned by ``k`` / ``v`` are not guarded: writing them while
    another thread moves rows (``update``, ``state_read``) is the caller's to avoid.
    Extensions calling the ``*_c`` methods of the cimport API serialize themselves
    (``lock_c()`` / ``unlock_c()``).

    Sequence ids outside ``[0, n_seq_max)`` (``-1`` is allowed where it means "any" / "whole
    cache") and other invalid arguments raise ValueError / TypeError / IndexError before
    anything changes.
    """

    __slots__ = ()

    @overload
    def __new__(cls, *args: Any, semantics: Literal["2026"], **kwargs: Any) -> UnifiedCache2026: ...
    @overload
    def __new__(cls, *args: Any, semantics: Literal["2025"] = ..., **kwargs: Any) -> UnifiedCache2025: ...
    @overload
    def __new__(cls, *args: Any, semantics: str, **kwargs: Any) -> UnifiedCache: ...

    def __new__(cls, *args: Any, **kwargs: Any) -> UnifiedCache:
        made: UnifiedCache = _signatures.factory_make(UnifiedCache, cls, _signatures.unified, args, kwargs,
                                                      _BY_SEMANTICS)
        return made

    def ubatches(self, batch: Batch, n_ubatch: int, embd_pooled: bool = False) -> Iterator[SplitUBatch]:
        """Iterate over the ubatches of at most ``n_ubatch`` tokens this cache takes a batch in:
        split in batch order, as llama.cpp does for a unified cache (the :class:`Batch` must be
        built with ``simple_split=True``; ``embd_pooled`` changes nothing). A cache of several
        streams takes equal splits (tokens grouped per sequence, every group as long; the Batch
        built with ``simple_split=False``), as today's llama.cpp splits for it (which also keeps
        the sequences of one ubatch consecutive ids; this split does not)."""
        if not isinstance(batch, Batch):
            raise TypeError(f"batch must be a Batch, not {type(batch).__name__}")
        if self.n_stream > 1:
            if batch.simple_split:
                raise ValueError("a cache of several streams splits batches by sequence: build the Batch with "
                                 "simple_split=False")
            return batch.ubatches(n_ubatch, "equal")
        if not batch.simple_split:
            raise ValueError("this cache splits batches in order: build the Batch with simple_split=True")
        return batch.ubatches(n_ubatch, "simple")

    def seq_export(self, seq_id: int) -> SeqExport:
        """Sequence ``seq_id`` ready for a transfer to another process, without a copy: a small
        ``header`` (its cells, positions and this cache's geometry) and the ``regions``
        (address, length) of its K/V bytes inside this cache's buffers, valid while the cache
        is unchanged. A pending defragmentation is settled first. See docs/disaggregated.md."""
        return _seq_export(self, seq_id)

    def seq_import_begin(self, header: Buffer, seq_id: int | None = None) -> SeqImport:
        """Begin receiving the sequence an exporter's ``header`` describes into ``seq_id``
        (None: the exporter's id): the header is checked against this cache (StateError on a
        foreign geometry, the per-cell extension on one side only, truncation or corruption;
        "no room: N cells missing" when too full;
        nothing changes then) and the cells a ``state_read`` of that sequence would take are
        reserved. The returned import's ``regions`` are where the transfer writes; its
        ``commit()`` makes the sequence visible as ``state_read`` would have, ``abort()`` (or
        an exception in ``with``, or garbage collection) leaves the cache as it was. Until
        then the cache refuses changes."""
        return _seq_import_begin(self, header, seq_id)


class UnifiedCache2025(_Unified2025, UnifiedCache):
    """The unified KV cache of llama.cpp as of mid-2025 (llama-cpp-python 0.3.10):
    ``UnifiedCache(..., semantics="2025")`` or ``UnifiedCache2025(...)``, with the parameters of
    :class:`UnifiedCache` (no streams: ``kv_unified`` stays True, no ``cell_ext``).

    find_slot puts a ubatch in contiguous cells from ``head`` on (``slot``); ``restore()``
    undoes the find_slot calls since the last ``commit()``. ``kq_mask`` pads its rows to 64.
    ``update()`` applies the K-shift, then a defragmentation ``defrag_sched`` scheduled
    (``defrag_prepare`` / ``defrag_move`` defragment at once). An iSWA cache slides its window
    with ``prune_swa``.

    Typical step, as llama.cpp's decode does it::

        ub = kvcache.UBatch(pos=[0, 1, 2], seq_id=[0, 0, 0])
        if cache.find_slot(ub):
            for il in cache.layers:
                cache.store(il, k_rows, v_rows)
            mask = cache.kq_mask(ub)
            cache.commit()
        else:
            cache.restore()
    """

    __slots__ = ()


class UnifiedCache2026(_Unified2026, UnifiedCache):
    """The unified KV cache of today's llama.cpp (llama-cpp-python 0.3.36, docs/semantics.md):
    ``UnifiedCache(..., semantics="2026")`` or ``UnifiedCache2026(...)``, with the parameters of
    :class:`UnifiedCache` and these:

    - ``kv_unified``: True (default): one stream for every sequence; False: ``n_seq_max``
      streams, sequence s in stream s, each of ``kv_size`` cells with its own head and K/V rows
      (K / V row ``s * kv_size + cell``; a transposed V per stream).
    - ``cell_ext``: every cell carries llama.cpp's per-cell extension, as the caches of M-RoPE
      and per-layer-embedding models have it: a 2-D position (x, y) and a token id, set from a
      ubatch's ``pos_x`` / ``pos_y`` / ``tokens`` (:class:`UBatch`), used by the KQ mask of
      ubatches with 2-D positions, copied by ``seq_cp`` across streams, reset when a cell
      empties, and saved in the cell records of the states (layouts from ``"2026-03"``: x, y;
      ``"2026"``: x, y and the token id). ``cells().ext`` shows it.
    - ``ple_token`` (with ``cell_ext``, a per-layer-embedding model): every ubatch sets the
      extension, one without token ids (embeddings) storing this token id (llama.cpp: the
      model's image token, else its EOS token).

    ``find_slot`` places each token group in usable cells of its stream, scattered and final
    (``slot_info()`` / ``slot_indices()`` tell where; there is nothing to commit or restore);
    ``prepare()`` is the dry run. ``seq_cp`` across streams copies whole sequences and queues a
    stream copy (``pending_copies``) that ``update()`` performs (it returns a
    :class:`StreamUpdate`; nothing defragments). ``n_kv_per_stream`` follows each stream's
    cells and ``kq_mask`` is ``[streams, rows, n_kv]`` without padding rows. Its state has a
    section per stream (layouts with stream counts; ``"2025"`` only for one stream) and a
    sequence's state is placed in any free cells of its stream (docs/state.md).

    Typical step::

        ub = kvcache.UBatch(pos=[0, 1, 2], seq_id=[0, 0, 0])
        if cache.find_slot(ub):
            for il in cache.layers:
                cache.store(il, k_rows, v_rows)
            mask = cache.kq_mask(ub)
    """

    __slots__ = ()


_CLASSES: tuple[type[UnifiedCache], ...] = (UnifiedCache2025, UnifiedCache2026)
_BY_SEMANTICS = dict(zip(SEMANTICS, _CLASSES))
