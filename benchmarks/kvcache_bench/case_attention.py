"""`kvcache bench` case ``attention``: one decode step's attention (one layer, 8 heads x 128,
f32, torch on the CPU) in a 32768-cell cache whose mask spans every cell, through kvcache's
attention indices (``attention_indices`` + ``kvcache.torch_attention.attention_from_indices``,
which takes the dense path itself where the step reads most rows) against the dense path
(``kq_mask`` into a reused bool buffer + one ``scaled_dot_product_attention`` over every
cell), for 256 sequences holding 25% of the cells, 64 holding 25%, 64 holding them all, 8 holding
12% and one sequence of 4096 cells; both outputs are checked equal (1e-4). Each row's yardstick
is the byte floor: the K/V rows the step needs, read once (a sum over that many contiguous
bytes); every timed call follows such a read, the two paths taking turns. Beside them, the
build of the indices (through each sequence's own index of its cells, kept as cells are placed
and removed) against the build of the mask, and against a build from scratch (the mask, then its nonzero entries as CSR arrays: what finding a step's cells costs
without that index). torch runs on one thread and the times are that thread's CPU time (a
shared machine's other jobs weigh less).
With a CUDA GPU and FlashInfer, the same steps in f16 on the GPU: FlashInfer's paged decode
(``BatchDecodeWithPagedKVCacheWrapper``, pages of one cell, planned every step from the indices
built on the host) against the dense path (the bool mask built on the host, copied, one SDPA),
both checked equal (1e-2, f16), wall time to the end of the GPU's work; otherwise that row waits.
Quick: 4096 cells, three layouts. Without torch the rows wait."""
from __future__ import annotations

import statistics
import time
from typing import Any

from kvcache_bench._rows import Row, _median_range, _paired, waiting

HEADS, DIM = 8, 128
# (sequences, the share of the cells they hold), and the one long sequence
LAYOUTS = ((256, 0.25), (64, 0.25), (64, 1.0), (8, 0.12), (1, 4096))
QUICK_LAYOUTS = ((64, 0.25), (8, 1.0), (1, 512))


def _cache(n_cells: int, n_seqs: int, held: float) -> tuple[Any, Any]:
    """A cache of n_cells whose n_seqs sequences hold `held` of the cells (or, as an int, that
    many cells), each in its own block of the cells with the rest of the block free (so that the
    mask spans the whole cache while the step needs only what they hold), and the decode
    ubatch of one token per sequence, placed."""
    import numpy as np

    import kvcache

    c = kvcache.UnifiedCache(kv_size=n_cells, n_layer=1, n_embd_k_gqa=HEADS * DIM, n_embd_v_gqa=HEADS * DIM,
                             n_seq_max=n_seqs, buffers=None, semantics="2025", n_pad=256)
    cells = held if isinstance(held, int) else int(held * n_cells)
    # the last n_seqs cells stay free for the decode step
    block = (n_cells - n_seqs) // n_seqs
    keep = max(min(cells // n_seqs, block) - 1, 1)
    n = block if n_seqs > 1 else keep
    for s in range(n_seqs):
        for a in range(0, n, 4096):
            b = min(a + 4096, n)
            assert c.find_slot(kvcache.UBatch(np.arange(a, b, dtype=np.int32), np.full(b - a, s, np.int32)))
            c.commit()
    for s in range(n_seqs):
        c.seq_rm(s, keep, -1)
    ub = kvcache.UBatch([keep] * n_seqs, list(range(n_seqs)))
    assert c.find_slot(ub)
    return c, ub


def _step(torch: Any, n_cells: int, n_seqs: int, held: Any, reps: int) -> list[Row]:
    from kvcache import AttentionIndices
    import numpy as np

    from kvcache.torch_attention import attention_from_indices, takes_dense_path

    F = torch.nn.functional
    c, ub = _cache(n_cells, n_seqs, held)
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(n_cells, HEADS, DIM, generator=gen)
    v = torch.randn(n_cells, HEADS, DIM, generator=gen)
    q = torch.randn(ub.n_tokens, HEADS, DIM, generator=gen)
    mask_buf = torch.empty(ub.n_tokens, n_cells, dtype=torch.bool)
    idx_buf = AttentionIndices.buffers(ub.n_tokens, n_cells)

    def dense() -> tuple[int, int, Any]:
        t0 = time.thread_time_ns()
        m = c.kq_mask(ub, pad=False, dtype="bool", out=mask_buf)
        t1 = time.thread_time_ns()
        n = m.shape[-1]
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k[:n].transpose(0, 1)[None],
                                             v[:n].transpose(0, 1)[None], attn_mask=m)[0].transpose(0, 1)
        return time.thread_time_ns() - t0, t1 - t0, out

    def indices() -> tuple[int, int, Any]:
        t0 = time.thread_time_ns()
        idx = c.attention_indices(ub, out=idx_buf)
        t1 = time.thread_time_ns()
        out = attention_from_indices(q, k, v, idx, mask=lambda: c.kq_mask(ub, pad=False, dtype="bool", out=mask_buf))
        return time.thread_time_ns() - t0, t1 - t0, out

    def scratch() -> int:
        t0 = time.thread_time_ns()
        m = c.kq_mask(ub, pad=False, dtype="bool", out=mask_buf).numpy()
        _, cols = np.nonzero(m)
        indptr = np.zeros(m.shape[0] + 1, np.int32)
        np.cumsum(m.sum(axis=1), out=indptr[1:])
        cols.astype(np.int32)
        return time.thread_time_ns() - t0

    idx = c.attention_indices(ub)
    rows_needed = len(set(idx.kv_indices.tolist()))
    need = 2 * rows_needed * HEADS * DIM * 4
    flat = torch.randn(need // 4, generator=gen)

    def floor() -> int:
        t0 = time.thread_time_ns()
        flat.sum()
        return time.thread_time_ns() - t0

    _, _, want = dense()
    _, _, got = indices()
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    d, i, f, db, ib, sb = [], [], [], [], [], []
    for r in range(reps):
        # every timed call follows the same work, a read of the needed rows (as a step leaves the
        # caches), and the two paths take turns going first: neither is timed right after a call
        # that warmed its own code and data
        for path in (dense, indices) if r % 2 == 0 else (indices, dense):
            flush = floor()
            t, b, _ = path()
            if path is dense:
                d.append(t)
                db.append(b)
            else:
                i.append(t)
                ib.append(b)
                f.append(flush)
        floor()
        sb.append(scratch())
    nnz = len(idx.kv_indices)
    path = "dense" if takes_dense_path(idx) else "indices"
    name = f"{n_seqs} seqs, {held:.0%} of the cells" if isinstance(held, float) else f"1 seq of {held} cells"
    im, ir = _median_range(i)
    step = Row(f"attention: decode step, {name} ({n_cells} cells): indices vs dense mask", im, ir,
               statistics.median(d), _paired(d, i), gbps=need / im, yardstick="byte floor: needed K/V read once",
               yardstick_gbps=need / statistics.median(f), yardstick_ratio=_paired(i, f),
               note=f"{need / 2**20:.0f} MiB of K/V needed of {2 * n_cells * HEADS * DIM * 4 / 2**20:.0f} MiB; "
                    f"path taken: {path}")
    bm, br = _median_range(ib)
    build = Row(f"attention: build, {name} ({n_cells} cells): attention_indices vs kq_mask (bool)", bm, br,
                statistics.median(db), _paired(db, ib), note=f"{nnz} indices, mask {ub.n_tokens} x {idx.n_kv}")
    fresh = Row(f"attention: indices from scratch, {name} ({n_cells} cells): attention_indices vs kq_mask + "
                f"its nonzero entries", bm, br, statistics.median(sb), _paired(sb, ib),
                note=f"{nnz} indices, found among {ub.n_tokens} x {idx.n_kv} mask entries")
    return [step, build, fresh]


GPU_CASE = "attention (GPU): decode step, FlashInfer from the indices vs dense-mask SDPA"


def _gpu_step(torch: Any, flashinfer: Any, n_cells: int, n_seqs: int, held: Any, reps: int) -> Row:
    """One layout's decode step on the GPU: FlashInfer from kvcache's indices against the
    dense-mask SDPA, f16, each timed from the host build to the end of the GPU's work."""
    import numpy as np

    F = torch.nn.functional
    dev = torch.device("cuda")
    c, ub = _cache(n_cells, n_seqs, held)
    gen = torch.Generator(device=dev).manual_seed(0)
    k = torch.randn(n_cells, HEADS, DIM, generator=gen, device=dev, dtype=torch.float16)
    v = torch.randn(n_cells, HEADS, DIM, generator=gen, device=dev, dtype=torch.float16)
    q = torch.randn(ub.n_tokens, HEADS, DIM, generator=gen, device=dev, dtype=torch.float16)
    workspace = torch.empty(128 << 20, dtype=torch.uint8, device=dev)
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
    pages = (k[:, None], v[:, None])   # pages of one cell: [cells, 1, heads, dim]

    def on_gpu(a: Any) -> Any:
        return torch.from_numpy(np.ascontiguousarray(a)).to(dev, non_blocking=False)

    def dense() -> tuple[int, Any]:
        torch.cuda.synchronize()
        t0 = time.perf_counter_ns()
        m = on_gpu(c.kq_mask(ub, pad=False, dtype="bool").numpy())
        n = m.shape[-1]
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k[:n].transpose(0, 1)[None],
                                             v[:n].transpose(0, 1)[None], attn_mask=m)[0].transpose(0, 1)
        torch.cuda.synchronize()
        return time.perf_counter_ns() - t0, out

    def indices() -> tuple[int, Any]:
        torch.cuda.synchronize()
        t0 = time.perf_counter_ns()
        idx = c.attention_indices(ub)
        wrapper.plan(on_gpu(idx.kv_indptr), on_gpu(idx.kv_indices), on_gpu(np.ones(len(idx.causal), np.int32)),
                     HEADS, HEADS, DIM, 1, q_data_type=torch.float16, kv_data_type=torch.float16)
        out = wrapper.run(q, pages)
        torch.cuda.synchronize()
        return time.perf_counter_ns() - t0, out

    idx = c.attention_indices(ub)
    need = 2 * len(set(idx.kv_indices.tolist())) * HEADS * DIM * 2
    flat = torch.randn(need // 2, generator=gen, device=dev, dtype=torch.float16)

    def floor() -> int:
        torch.cuda.synchronize()
        t0 = time.perf_counter_ns()
        flat.sum()
        torch.cuda.synchronize()
        return time.perf_counter_ns() - t0

    _, want = dense()
    _, got = indices()
    torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=1e-2)
    d, i, f = [], [], []
    for r in range(reps):
        for path in (dense, indices) if r % 2 == 0 else (indices, dense):
            (d if path is dense else i).append(path()[0])
        f.append(floor())
    name = f"{n_seqs} seqs, {held:.0%} of the cells" if isinstance(held, float) else f"1 seq of {held} cells"
    im, ir = _median_range(i)
    return Row(f"{GPU_CASE}, {name} ({n_cells} cells)", im, ir, statistics.median(d), _paired(d, i),
               gbps=need / im, yardstick="byte floor: needed K/V read once on the GPU",
               yardstick_gbps=need / statistics.median(f), yardstick_ratio=_paired(i, f),
               note=f"{torch.cuda.get_device_name(dev)}; f16; plan + run every step")


def _gpu_rows(torch: Any, quick: bool, reps: int) -> list[Row]:
    if not torch.cuda.is_available():
        return [waiting(GPU_CASE, "a CUDA GPU")]
    try:
        import flashinfer  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        return [waiting(GPU_CASE, "FlashInfer (pip install flashinfer-python)")]
    n_cells = 4096 if quick else 32768
    return [_gpu_step(torch, flashinfer, n_cells, n_seqs, held, reps)
            for n_seqs, held in (QUICK_LAYOUTS if quick else LAYOUTS)]


def bench_attention(quick: bool, reps: int) -> list[Row]:
    """The case's rows (see the module's docstring)."""
    try:
        import torch  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        return [waiting("attention: decode step, indices vs dense mask", "torch")]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rows: list[Row] = []
        n_cells = 4096 if quick else 32768
        for n_seqs, held in QUICK_LAYOUTS if quick else LAYOUTS:
            rows += _step(torch, n_cells, n_seqs, held, reps)
        return rows + _gpu_rows(torch, quick, reps)
    finally:
        torch.set_num_threads(threads)
