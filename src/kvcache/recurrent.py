"""The recurrent-state cache of Mamba / RWKV style models, in either semantics:
:class:`RecurrentCache2025` (llama.cpp as of mid-2025) and :class:`RecurrentCache2026` (today's
llama.cpp), both a :class:`RecurrentCache`, which makes the one its ``semantics`` names."""
from __future__ import annotations

from typing import Any, Iterator, Literal, overload

from kvcache import _signatures
from kvcache._core import Batch, SplitUBatch, _Recurrent, _Recurrent2025, _Recurrent2026
from kvcache.plan import SEMANTICS

__all__ = ["RecurrentCache", "RecurrentCache2025", "RecurrentCache2026"]

class RecurrentCache(_Recurrent):
    __doc__ = _Recurrent.__doc__
    __slots__ = ()

    @overload
    def __new__(cls, *args: Any, semantics: Literal["2026"], **kwargs: Any) -> RecurrentCache2026: ...
    @overload
    def __new__(cls, *args: Any, semantics: Literal["2025"] = ..., **kwargs: Any) -> RecurrentCache2025: ...
    @overload
    def __new__(cls, *args: Any, semantics: str, **kwargs: Any) -> RecurrentCache: ...

    def __new__(cls, *args: Any, **kwargs: Any) -> RecurrentCache:
        made: RecurrentCache = _signatures.factory_make(RecurrentCache, cls, _signatures.recurrent, args, kwargs,
                                                        _BY_SEMANTICS)
        return made

    def ubatches(self, batch: Batch, n_ubatch: int, embd_pooled: bool = False) -> Iterator[SplitUBatch]:
        """Iterate over the ubatches of at most ``n_ubatch`` tokens this cache takes a batch in,
        as llama.cpp does for a recurrent cache: equal-length slices of several sequences, or one
        sequence at a time when ``embd_pooled`` (pooled embeddings cannot span ubatches). The
        :class:`Batch` must be built with ``simple_split=False``."""
        if not isinstance(batch, Batch):
            raise TypeError(f"batch must be a Batch, not {type(batch).__name__}")
        if batch.simple_split:
            raise ValueError("this cache splits batches by sequence: build the Batch with simple_split=False")
        return batch.ubatches(n_ubatch, "seq" if embd_pooled else "equal")


class RecurrentCache2025(_Recurrent2025, RecurrentCache):
    """The recurrent cache of llama.cpp as of mid-2025 (``llama_kv_cache_recurrent``,
    llama-cpp-python 0.3.10): ``RecurrentCache(..., semantics="2025")`` or
    ``RecurrentCache2025(...)``, with the parameters of :class:`RecurrentCache` (``n_rs_seq`` 0:
    no snapshots).

    ``s_copy`` and ``s_mask`` are the graph inputs of cells ``head .. head + n``: the cell to copy
    each state from, and whether it is kept (1.0) or starts from zero (0.0); both update the
    cells' sources in place as the reference does (each copy and each zeroing happens once).

    Typical step::

        ub = kvcache.UBatch(pos=[0, 1, 2], seq_id=[0, 0, 0], n_seq_tokens=3)
        if cache.find_slot(ub):
            src, keep = cache.s_copy(), cache.s_mask()
            for il in range(cache.n_layer):
                cache.store(il, r_rows, s_rows)
    """

    __slots__ = ()


class RecurrentCache2026(_Recurrent2026, RecurrentCache):
    """The recurrent memory of today's llama.cpp (``llama_memory_recurrent``, llama-cpp-python
    0.3.36, docs/semantics.md): ``RecurrentCache(..., semantics="2026")`` or
    ``RecurrentCache2026(...)``, with the parameters of :class:`RecurrentCache`.

    ``find_slot`` stages each cell's source: ``s_copy`` reads it (``plane * size + cell``), and a
    new state reads the zero row ``rs_z`` the graph clears (there is no ``s_mask``). With
    ``n_rs_seq`` snapshots per state, ``seq_rm(s, p0, -1)`` rolls a state back
    (``rollback_ok``, ``pending_rollback``). Prefix reuse keeps checkpoints of states
    (``enable_prefix_reuse``, ``checkpoint``, ``prefix_attach``, ``prefix_release``, ...;
    docs/prefix-reuse.md).

    Typical step::

        ub = kvcache.UBatch(pos=[0, 1, 2], seq_id=[0, 0, 0], n_seq_tokens=3)
        if cache.find_slot(ub):
            src, zero = cache.s_copy(), cache.rs_z
            for il in range(cache.n_layer):
                cache.store(il, r_rows, s_rows)
    """

    __slots__ = ()


_CLASSES: tuple[type[RecurrentCache], ...] = (RecurrentCache2025, RecurrentCache2026)
_BY_SEMANTICS = dict(zip(SEMANTICS, _CLASSES))
