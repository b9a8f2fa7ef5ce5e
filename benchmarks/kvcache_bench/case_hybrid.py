"""`kvcache bench` case of the hybrid memory (kvcache.HybridCache, today's llama_memory_hybrid):
a decode step of N sequences (find_slot in both parts, the attention layers' KQ mask, the
recurrent layers' s_copy) against the same step driven on its two parts by hand, a
UnifiedCache(semantics="2026") and a RecurrentCache(semantics="2026") of the same geometry: the
ratio is the cost of keeping the pair together (one call placing in both or neither, one lock
for both), which should stay near 1.

The picture is case_step's busy server: every attention cell holds context of the running
sequences except the first positions of each, which a finished prefix left free, where the steps
place their tokens (the mask is rewritten in place, reuse=True, until the cells it spans grow)."""
from __future__ import annotations

import statistics
import time

import numpy as np

from kvcache_bench._rows import Row, _median_range, _paired

# LFM2-like geometry: 4 layers, attention in 1 and 3 (8 KV heads of 128), short convolutions in
# 0 and 2 (R of 2 x 1024 floats); metadata only (no buffers)
N_LAYER, RECR, N_EMBD_KV, N_EMBD_R = 4, (0, 2), 1024, 2048


def _pair(size: int, n_seqs: int, n_steps: int):
    """The hybrid memory and its two parts driven apart, both in the busy state: each sequence
    holds size // n_seqs positions, less its first n_steps in the attention cells."""
    import kvcache

    h = kvcache.HybridCache(size, N_LAYER, RECR, N_EMBD_KV, N_EMBD_KV, N_EMBD_R, n_seq_max=n_seqs, buffers=None)
    attn = kvcache.UnifiedCache(size, 2, N_EMBD_KV, N_EMBD_KV, n_seq_max=n_seqs, n_pad=1, buffers=None,
                                semantics="2026", kv_unified=True)
    recr = kvcache.RecurrentCache(n_seqs, 2, 0, 0, type_k="f32", type_v="f32", n_embd_k_s=N_EMBD_R, n_embd_v_s=0,
                                  buffers=None, semantics="2026")
    ctx = size // n_seqs
    for s in range(n_seqs):
        ub = kvcache.UBatch(list(range(ctx)), [s], n_seq_tokens=ctx)
        if not (h.find_slot(ub) and recr.find_slot(ub) and attn.find_slot(ub)):
            raise AssertionError(f"the prompt of sequence {s} found no slot")
        # the hole: the attention part forgets the first positions (the recurrent state is whole)
        h.attn.seq_rm(s, 0, n_steps)
        attn.seq_rm(s, 0, n_steps)
    steps = [kvcache.UBatch([ctx + k] * n_seqs, list(range(n_seqs))) for k in range(n_steps)]
    return h, attn, recr, steps


def _mask_into(c, attn, ub, buf: np.ndarray) -> np.ndarray:
    """c.kq_mask of a decode step as a server's loop calls it: into the previous step's buffer,
    rewriting what changed, or into a new one when the cells it spans grew (attn: the attention
    cache whose n_kv_per_stream tells)."""
    shape = (1, ub.n_tokens, attn.n_kv_per_stream[0])
    if buf.shape != shape:
        return c.kq_mask(ub, out=np.empty(shape, np.float32))
    return c.kq_mask(ub, out=buf, reuse=True)


def _hybrid_steps(h, steps) -> tuple[float, np.ndarray, np.ndarray]:
    mask = h.kq_mask(steps[0])        # the previous step's buffer (untimed, as a server keeps it)
    sc = None
    t0 = time.perf_counter_ns()
    for ub in steps:
        if not h.find_slot(ub):
            raise AssertionError("the hybrid memory found no slot")
        mask = _mask_into(h, h.attn, ub, mask)
        sc = h.s_copy()
    return time.perf_counter_ns() - t0, mask, sc


def _parts_steps(attn, recr, steps) -> tuple[float, np.ndarray, np.ndarray]:
    mask = attn.kq_mask(steps[0])
    sc = None
    t0 = time.perf_counter_ns()
    for ub in steps:
        if not (recr.find_slot(ub) and attn.find_slot(ub)):
            raise AssertionError("the parts found no slot")
        mask = _mask_into(attn, attn, ub, mask)
        sc = recr.s_copy()
    return time.perf_counter_ns() - t0, mask, sc


def _placements(h, attn, recr, steps, hybrid_first: bool) -> tuple[float, float]:
    """find_slot alone, every step: (the hybrid memory's time, the parts' time)."""
    def pair() -> float:
        t0 = time.perf_counter_ns()
        for ub in steps:
            if not h.find_slot(ub):
                raise AssertionError("the hybrid memory found no slot")
        return time.perf_counter_ns() - t0

    def parts() -> float:
        t0 = time.perf_counter_ns()
        for ub in steps:
            if not (recr.find_slot(ub) and attn.find_slot(ub)):
                raise AssertionError("the parts found no slot")
        return time.perf_counter_ns() - t0

    if hybrid_first:
        th = pair()
        return th, parts()
    tp = parts()
    return pair(), tp


def _same(h, attn, recr, n_seqs: int) -> None:
    hr, pr = h.recr.cells(), recr.cells()
    if not (np.array_equal(h.attn.cells().pos, attn.cells().pos) and np.array_equal(hr["pos"], pr["pos"])
            and hr["seq_id"] == pr["seq_id"]):
        raise AssertionError(f"{n_seqs} sequences: the hybrid memory and its parts hold different cells")


def bench_hybrid(quick: bool, reps: int) -> list[Row]:
    """The decode step of 1 / 32 / 256 sequences (1 / 32 quick) x 1 token, 32768 attention cells
    (4096 quick), and its find_slot alone: HybridCache against its parts driven by hand, paired
    per repetition on fresh states (which side runs first alternates), the masks, state sources
    and cells of both sides compared after each run."""
    size = 4096 if quick else 32768
    rows = []
    parts_note = "baseline: the same calls on the two parts driven apart (UnifiedCache 2026 + RecurrentCache 2026)"
    for n_seqs in ((1, 32) if quick else (1, 32, 256)):
        n_steps = min(64 if not quick else 16, size // n_seqs // 2)
        hyb, parts, hyb_fs, parts_fs = [], [], [], []
        for rep in range(reps):
            h, attn, recr, steps = _pair(size, n_seqs, n_steps)
            if rep % 2:
                tp, mp, sp = _parts_steps(attn, recr, steps)
                th, mh, sh = _hybrid_steps(h, steps)
            else:
                th, mh, sh = _hybrid_steps(h, steps)
                tp, mp, sp = _parts_steps(attn, recr, steps)
            if not (np.array_equal(mh, mp) and np.array_equal(sh, sp)):
                raise AssertionError(f"{n_seqs} sequences: the hybrid memory and its parts disagree on the inputs")
            _same(h, attn, recr, n_seqs)
            hyb.append(th / n_steps)
            parts.append(tp / n_steps)
            h, attn, recr, steps = _pair(size, n_seqs, n_steps)
            th, tp = _placements(h, attn, recr, steps, rep % 2 == 0)
            _same(h, attn, recr, n_seqs)
            hyb_fs.append(th / n_steps)
            parts_fs.append(tp / n_steps)
        for what, fast, base in (("find_slot + mask f32 + s_copy", hyb, parts), ("find_slot alone", hyb_fs, parts_fs)):
            med, rng = _median_range(fast)
            rows.append(Row(f"hybrid: decode step, {n_seqs} seq x 1 token, {size} cells ({what})", med, rng,
                            statistics.median(base), _paired(base, fast), note=parts_note if n_seqs == 1 else ""))
            parts_note = ""
    return rows
