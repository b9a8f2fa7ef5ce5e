"""Batch splitting: cut a batch of tokens into ubatches the way llama.cpp's decoder does.

:class:`Batch` holds one batch; each ``split_*`` call returns the next :class:`SplitUBatch`
(a :class:`kvcache.UBatch` that also carries ``ids``, the batch index of each of its tokens).
:func:`split_batch` does the whole loop at once."""
from __future__ import annotations

from typing import Any, Literal, Sequence

import numpy as np
import numpy.typing as npt

from kvcache._core import Batch, SplitUBatch, UBatch

__all__ = ["Batch", "SplitUBatch", "UBatch", "split_batch"]


def split_batch(pos: Sequence[int], seq_id: Sequence[Any], n_ubatch: int,
                mode: Literal["simple", "equal", "seq"] | None = None, output: Sequence[Any] | None = None,
                logits_all: bool = False) -> tuple[list[SplitUBatch], npt.NDArray[np.int64]]:
    """Split a whole batch: returns ``(ubatches, out_ids)``.

    ``mode`` is ``"simple"`` (the batch in its order), ``"equal"`` or ``"seq"`` (tokens grouped
    by sequence); the default is ``"simple"``. See :class:`Batch` for the other arguments."""
    mode = "simple" if mode is None else mode
    batch = Batch(pos, seq_id, output=output, logits_all=logits_all, simple_split=(mode == "simple"))
    ubatches = list(batch.ubatches(n_ubatch, mode))
    return ubatches, batch.out_ids
