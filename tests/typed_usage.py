"""A small typed program over kvcache's main API.

tests/test_typing.py checks it with ``mypy --strict`` (the assert_type lines pin what the stubs
promise) and runs it, so it stays both well-typed and true."""
from __future__ import annotations

import io
import sys
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

import kvcache
from kvcache import statefile
from kvcache.batch import SplitUBatch

if sys.version_info >= (3, 11):
    from typing import assert_type
else:  # pragma: no cover - typing_extensions comes with mypy
    from typing_extensions import assert_type

MODEL = Path(__file__).resolve().parent / "data" / "models" / "tiny_llama.gguf"


def unified_decode() -> tuple[kvcache.UnifiedCache, bytes]:
    """Prefill two sequences, shift one, update, save one sequence."""
    rope = kvcache.RopeParams(4, mode="neox", freq_base=10000.0)
    cache = kvcache.UnifiedCache(kv_size=64, n_layer=2, n_embd_k_gqa=8, n_embd_v_gqa=8, type_k="f16",
                                 type_v="f16", n_seq_max=2, n_embd_head_k=4, rope=rope)
    batch = kvcache.Batch([0, 1, 2, 0, 1, 2], [0, 0, 0, 1, 1, 1])
    for ub in cache.ubatches(batch, n_ubatch=4):
        assert_type(ub, SplitUBatch)
        if not cache.find_slot(ub):
            cache.restore()
            raise RuntimeError("no room")
        slot = cache.slot
        assert slot is not None
        head, n_tokens = slot
        rows = np.ones((n_tokens, 8), dtype=np.float32)
        for il in cache.layers:
            cache.store(il, rows, rows)
        mask = cache.kq_mask(ub)
        assert_type(mask, npt.NDArray[np.float32])
        half = cache.kq_mask(ub, dtype="f16")
        assert_type(half, npt.NDArray[np.float16])
        assert mask.shape == half.shape == (64, cache.n)
        idx = cache.attention_indices(ub, out=kvcache.AttentionIndices.buffers(4, 64))
        assert_type(idx.kv_indices, npt.NDArray[np.int32])
        assert int(idx.qo_indptr[-1]) == n_tokens and idx.n_kv == cache.n
        cache.commit()
    assert_type(batch.out_ids, npt.NDArray[np.int64])

    cache.seq_add(1, 0, -1, 3)            # sequence 1 moves three positions on
    assert cache.seq_pos_max(1) == 5
    plan = cache.update()                 # rotates the shifted keys with `rope`
    assert_type(plan, kvcache.UpdatePlan)
    assert plan.rotated and plan.k_shift is not None
    assert_type(plan.k_shift, npt.NDArray[np.int32])

    cells = cache.cells()
    assert_type(cells, kvcache.Cells)
    assert len(cells.nonempty()) == cache.used == 6
    k0 = cache.k(0)
    assert k0.dtype == np.float16
    return cache, cache.state_write(0)


def sequence_file_round_trip(cache: kvcache.UnifiedCache) -> int:
    """Save sequence 0 as llama.cpp's sequence file, load it into a fresh cache."""
    out = io.BytesIO()
    n = statefile.write_sequence_file(out, cache, seq_id=0, tokens=[11, 12, 13])
    loaded = statefile.load(io.BytesIO(out.getvalue()))
    assert isinstance(loaded, statefile.SequenceFile)
    assert_type(loaded.tokens, npt.NDArray[np.int32])
    fresh = kvcache.UnifiedCache(64, 2, 8, 8, n_seq_max=2)
    consumed = loaded.restore(fresh, seq_id=1)
    assert fresh.seq_pos_max(1) == 2 and consumed + loaded.cache_offset == n
    return n


def iswa_step() -> list[npt.NDArray[Any]]:
    """One ubatch through an interleaved sliding-window cache."""
    cache = kvcache.ISWACache(kv_size=64, n_layer=2, n_embd_k_gqa=8, n_embd_v_gqa=8, swa_layers=[1], n_swa=4,
                              n_batch=8)
    batch = kvcache.Batch(list(range(6)), [0] * 6)
    masks: list[npt.NDArray[Any]] = []
    for ub in cache.ubatches(batch, 8):
        assert cache.find_slot(ub)
        for il in range(cache.n_layer):
            cache.store(il, np.zeros((ub.n_tokens, 8), np.float16), None)
        base_mask, swa_mask = cache.kq_mask(ub, dtype="bool")
        masks = [base_mask, swa_mask]
    cache.commit()
    assert cache.swa_layers == (1,) and cache.base_layers == (0,)
    # the file writers take any cache with a state (UnifiedCache, ISWACache, RecurrentCache)
    assert statefile.write_sequence_file(io.BytesIO(), cache, seq_id=0, tokens=list(range(6))) > 0
    return masks


def recurrent_step() -> npt.NDArray[np.int32]:
    """Two sequences of a recurrent model, one token each."""
    cache = kvcache.RecurrentCache(n_seq_max=2, n_layer=1, n_embd_k_gqa=4, n_embd_v_gqa=4, n_embd_k_s=4,
                                   n_embd_v_s=8)
    batch = kvcache.Batch([0, 0], [0, 1], simple_split=False)
    copies = np.zeros(0, dtype=np.int32)
    for ub in cache.ubatches(batch, 2):
        assert cache.find_slot(ub)
        copies = cache.s_copy()
        assert_type(cache.s_mask(), npt.NDArray[np.float32])
        cache.commit()
    cells = cache.cells()
    assert_type(cells["seq_id"], list[list[int]])
    assert statefile.write_sequence_file(io.BytesIO(), cache, seq_id=1, tokens=[0]) > 0
    return copies


def today_step() -> int:
    """Today's cache: UnifiedCache makes the class its semantics names; placements are final."""
    cache = kvcache.UnifiedCache(64, 1, 8, 8, n_pad=1, semantics="2026")
    assert_type(cache, kvcache.UnifiedCache2026)
    assert isinstance(cache, kvcache.UnifiedCache)
    assert cache.find_slot(kvcache.UBatch([0, 1], [0, 0]))
    slots = cache.prepare([kvcache.UBatch([2], [0])])
    assert slots is not None and slots[0][0][1].tolist() == [2]
    plan = cache.update()
    assert_type(plan, kvcache.StreamUpdate)
    seed = kvcache.UnifiedCache2025(64, 1, 8, 8)
    assert_type(seed.slot, "tuple[int, int] | None")
    return cache.pending_copies


def model_cache(n_ctx: int) -> int:
    """The cache llama.cpp would build for a GGUF model: its size in bytes."""
    cache = kvcache.from_gguf(MODEL, n_ctx=n_ctx, n_seq_max=2)
    if isinstance(cache, kvcache.UnifiedCache):
        assert cache.rope is not None and cache.n_embd_head_k is not None
        return cache.total_size
    if isinstance(cache, kvcache.ISWACache | kvcache.HybridCache):
        return cache.total_size
    assert_type(cache, kvcache.RecurrentCache)
    return cache.total_size


def main(with_gguf: bool = True) -> None:
    """Run every example."""
    cache, blob = unified_decode()
    assert isinstance(blob, bytes) and sequence_file_round_trip(cache) > len(blob)
    assert len(iswa_step()) == 2
    assert recurrent_step().shape == (2,)
    assert today_step() == 0
    if with_gguf:
        assert model_cache(128) > 0


if __name__ == "__main__":
    main()
