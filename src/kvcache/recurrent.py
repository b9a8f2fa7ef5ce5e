"""The recurrent-state cache of Mamba / RWKV style models (see :class:`RecurrentCache`)."""
from __future__ import annotations

from typing import Iterator

from kvcache._core import Batch, SplitUBatch
from kvcache._core import _Recurrent as _RecurrentCore

__all__ = ["RecurrentCache"]


class RecurrentCache(_RecurrentCore):
    __doc__ = _RecurrentCore.__doc__
    __slots__ = ()

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
