"""`kvcache bench` cases of today's cache semantics: the baseline is the team's transcription of
today's llama.cpp loop (benchmarks/baseline/kvc_baseline2026.cpp, checked against
the reference model of the 2026 semantics in kvcache's tests). The kvcache side runs once ``UnifiedCache(semantics="2026")``
exists (a capability probe, kvcache_bench.case_step.capabilities); until then the baseline runs
alone and the rows say what they wait for."""
from __future__ import annotations

import random
import statistics

import numpy as np

from kvcache_bench._rows import Row, _median_range, _paired, waiting

N_SEQS = 32


def _busy_ops(size: int, rng: random.Random) -> tuple[list, list, list[int]]:
    """The ubatches that fill `size` cells round robin over N_SEQS sequences (one token of each
    per ubatch), the seq_rm calls that then free holes of 4 positions until half the cells are
    free, and the next position of each sequence."""
    steps = size // N_SEQS
    seqs = list(range(N_SEQS))
    fill = [([p] * N_SEQS, seqs) for p in range(steps)]
    removed: set[tuple[int, int]] = set()
    rms = []
    while len(removed) * 1 < size // 2:
        s, p = rng.randrange(N_SEQS), rng.randrange(steps)
        rms.append((s, p, p + 4))
        removed.update((s, q) for q in range(p, min(p + 4, steps)))
    return fill, rms, [steps] * N_SEQS


def _baseline_state(size: int, seed: int):
    from kvcache_bench import _bench

    base = _bench.Baseline2026(size, 1, N_SEQS, 1)
    fill, rms, next_pos = _busy_ops(size, random.Random(seed))
    base.run(fill)
    for s, p0, p1 in rms:
        base.seq_rm(s, p0, p1)
    return base, fill, rms, next_pos


def _kvcache_state(size: int, fill, rms):
    """kvcache's semantics="2026" cache in the same state (metadata only)."""
    import kvcache
    from kvcache_bench import _bench

    c = kvcache.UnifiedCache(size, 1, 8, 8, n_seq_max=N_SEQS, buffers=None, semantics="2026")  # type: ignore[call-arg]
    _bench.cimport_find_slot_ns(c, [kvcache.UBatch(p, s) for p, s in fill])
    for s, p0, p1 in rms:
        c.seq_rm(s, p0, p1)
    return c


def _same_cells(c, base) -> None:
    """kvcache's cells (positions and sequences) are the baseline's."""
    cells = c.cells()
    pos, seq = base.cells(0)
    if not np.array_equal(np.asarray(cells.pos), pos):
        raise AssertionError("kvcache (2026) and today's loop hold different positions")
    for i in np.flatnonzero(pos >= 0):
        ids = [64 * w + b for w in range(4) for b in range(64) if (int(seq[i, w]) >> b) & 1]
        if ids != cells.seq_ids(int(i)):
            raise AssertionError(f"kvcache (2026) and today's loop hold different sequences in cell {i}")


def bench_2026(quick: bool, reps: int) -> list[Row]:
    """Scatter placement (find_slot with cont=false: any usable cells from the head on) in a cache
    with half its cells free in holes of 4 positions: 1-token ubatches of 32 sequences and a
    512-token prompt (placed, then removed), and the decode mask of 32 sequences (f32, no padding
    rows), today's loop against kvcache's semantics="2026" cache once it exists; each
    repetition on a fresh state, the two sides paired and their cells compared."""
    from kvcache_bench import _bench
    from kvcache_bench.case_step import capabilities

    size = 8192 if quick else 32768
    have = capabilities().semantics_2026
    n_ops = 512 if quick else 2048
    n_prompts = 20
    res: dict[str, list[tuple[float, float | None]]] = {"decode": [], "prompt": [], "mask": []}
    res_prepare: list[tuple[float, float]] = []
    mask_shape = None
    for rep in range(reps):
        base, fill, rms, next_pos = _baseline_state(size, rep)
        c = _kvcache_state(size, fill, rms) if have else None
        if c is not None:
            _same_cells(c, base)
        # 1-token ubatches round robin at the sequences' next positions
        decode = [([next_pos[k % N_SEQS] + k // N_SEQS], [k % N_SEQS]) for k in range(n_ops)]
        tb, placed = base.run(decode)
        if placed != n_ops:
            raise AssertionError(f"today's loop placed {placed} of {n_ops} tokens")
        tk = None
        if c is not None:
            import kvcache

            tk, placed_k = _bench.cimport_find_slot_ns(c, [kvcache.UBatch(p, s) for p, s in decode])
            if placed_k != placed:
                raise AssertionError(f"kvcache (2026) placed {placed_k} tokens, today's loop {placed}")
            _same_cells(c, base)
        res["decode"].append((tb / n_ops, None if tk is None else tk / n_ops))
        # a 512-token prompt of sequence 0 above its positions, removed after each placement
        p0 = 1 << 30
        prompt = [(list(range(p0, p0 + 512)), [0] * 512)] * n_prompts
        tb, placed = base.run(prompt, 0, p0)
        if placed != n_prompts:
            raise AssertionError(f"today's loop placed {placed} of {n_prompts} prompts")
        tk = None
        if c is not None:
            import kvcache

            tk, placed_k = _bench.cimport_find_slot_ns(c, [kvcache.UBatch(p, s) for p, s in prompt], 0, p0)
            if placed_k != placed:
                raise AssertionError(f"kvcache (2026) placed {placed_k} prompts, today's loop {placed}")
            _same_cells(c, base)
        res["prompt"].append((tb / n_prompts, None if tk is None else tk / n_prompts))
        # the decode mask of the 32 sequences at their next positions
        pos = [next_pos[s] + n_ops // N_SEQS for s in range(N_SEQS)]
        ids = list(range(N_SEQS))
        ref = base.kq_mask(pos, ids)
        mask_shape = ref.shape
        tb = base.kq_mask_ns(pos, ids, ref, 5)
        tm: float | None = None
        if c is not None:
            import time

            import kvcache

            ub = kvcache.UBatch(pos, ids)
            out = c.kq_mask(ub, dtype="f32", pad=False)   # type: ignore[call-overload]
            t0 = time.perf_counter_ns()
            for _ in range(5):
                out = c.kq_mask(ub, out=out, dtype="f32", pad=False)   # type: ignore[call-overload]
            tm = (time.perf_counter_ns() - t0) / 5
            if not np.array_equal(np.asarray(out).reshape(ref.shape).view(np.uint32), ref.view(np.uint32)):
                raise AssertionError("kvcache's (2026) decode mask differs from today's loop's")
        res["mask"].append((tb, tm))
        if c is not None:
            res_prepare.append(_prepare_against_find_slot(c, pos, ids))
    names = {"decode": f"2026: find_slot 1 token (scatter), {N_SEQS} seqs, {size} cells 50% fragmented",
             "prompt": f"2026: find_slot 512-token prompt (scatter, +seq_rm), {size} cells 50% fragmented",
             "mask": f"2026: kq_mask f32 unpadded, decode of {N_SEQS} seqs, {size} cells 50% fragmented"
                     f" ({mask_shape[1] if mask_shape else '?'} rows x {mask_shape[2] if mask_shape else '?'})"}
    rows = []
    for key, vals in res.items():
        base_t = [b for b, _ in vals]
        if vals[0][1] is None:
            bm, br = _median_range(base_t)
            rows.append(Row(names[key], None, None, bm,
                            note="waiting: UnifiedCache(semantics=\"2026\") (today's loop ran alone)",
                            extra={"baseline_range": br}))
            continue
        fast = [k for _, k in vals if k is not None]
        fm, fr = _median_range(fast)
        rows.append(Row(names[key], fm, fr, statistics.median(base_t), _paired(base_t, fast)))
    name = f"2026: prepare of a decode batch of {N_SEQS} seqs, {size} cells 50% fragmented"
    if res_prepare:
        t_prep = [p for p, _ in res_prepare]
        pm, pr = _median_range(t_prep)
        rows.append(Row(name, pm, pr, yardstick="find_slot of the same batch",
                        yardstick_ratio=_paired(t_prep, [f for _, f in res_prepare]),
                        note="the dry run costs what the batch touches, not the cache's cells"))
    else:
        rows.append(waiting(name, "UnifiedCache(semantics=\"2026\")"))
    held_size = 32768 if quick else 262144
    name = f"2026: prepare of a 512-token prompt that fits only by evicting, prefix index holding all {held_size} cells"
    if have:
        t_prep, t_find = zip(*(_prepare_evicting(held_size, rep) for rep in range(reps)))
        pm, pr = _median_range(list(t_prep))
        rows.append(Row(name, pm, pr, yardstick="find_slot of the same batch",
                        yardstick_ratio=_paired(list(t_prep), list(t_find)),
                        note="the dry run walks the eviction order, evicting nothing: it costs the cells it would "
                             "free, not the index"))
    else:
        rows.append(waiting(name, "UnifiedCache(semantics=\"2026\")"))
    rows.append(_simulate_both_semantics(have))
    return rows


def _prepare_evicting(size: int, seed: int, prompt_len: int = 1000, n: int = 10) -> tuple[float, float]:
    """ns per call of ``prepare([ub])`` for a 512-token prompt ub in a metadata-only cache of size
    cells whose prefix index holds every cell it can (prompts of prompt_len tokens, released), so
    that ub fits only by evicting; and of the ``find_slot(ub)`` that then evicts (once: it changes
    the state), which must place ub where prepare said."""
    import time

    import kvcache

    c = kvcache.UnifiedCache(size, 1, 8, 8, n_seq_max=2, buffers=None, semantics="2026")
    c.enable_prefix_reuse()
    rng = np.random.default_rng(seed)
    pos = np.arange(prompt_len, dtype=np.int32)
    for _ in range(size // prompt_len):
        if not c.find_slot(kvcache.UBatch(pos, [0], prompt_len, tokens=rng.integers(0, 32000, prompt_len, dtype=np.int32))):
            raise AssertionError("kvcache (2026): no room for a prompt in a cache the index holds nothing of")
        c.prefix_release(0)
    ub = kvcache.UBatch(np.arange(512, dtype=np.int32), [1], 512, tokens=np.ones(512, np.int32))
    want = c.prepare([ub])
    if want is None:
        raise AssertionError("kvcache (2026): prepare found no room where eviction makes it")
    t0 = time.perf_counter_ns()
    for _ in range(n):
        c.prepare([ub])
    t_prep = (time.perf_counter_ns() - t0) / n
    t0 = time.perf_counter_ns()
    placed = c.find_slot(ub)
    t_find = time.perf_counter_ns() - t0
    if not placed or _infos(c.slot_info()) != _infos(want[0]):
        raise AssertionError("kvcache (2026): find_slot placed the prompt elsewhere than prepare said")
    return t_prep, float(t_find)


def _infos(plan) -> list:
    """slot_info() (or one of prepare's) as plain lists."""
    return [(int(st), [int(x) for x in cells]) for st, cells in plan]


def _prepare_against_find_slot(c, pos: list[int], ids: list[int], n: int = 20) -> tuple[float, float]:
    """ns per call of ``prepare([ub])`` for the decode batch ub, and of ``find_slot(ub)`` of the same
    batch on the same state (each placement taken back with seq_rm, untimed), back to back."""
    import time

    import kvcache

    ub = kvcache.UBatch(pos, ids)
    want = c.prepare([ub])
    t0 = time.perf_counter_ns()
    for _ in range(n):
        c.prepare([ub])
    t_prep = (time.perf_counter_ns() - t0) / n
    t_find = 0
    for _ in range(n):
        t0 = time.perf_counter_ns()
        placed = c.find_slot(ub)
        t_find += time.perf_counter_ns() - t0
        if not placed or _infos(c.slot_info()) != _infos(want[0]):
            raise AssertionError("kvcache (2026): find_slot placed the batch elsewhere than prepare said")
        for p, s in zip(pos, ids):
            c.seq_rm(s, p, p + 1)
    return t_prep, t_find / n


def _simulate_both_semantics(have: bool) -> Row:
    """The hook for the comparison of one `kvcache simulate` workload under both semantics
    (find_slot failures, cells moved by defrag, tokens per second): it runs once kvcache has the
    2026 semantics and `kvcache.simulate.SimConfig` has a `semantics` field."""
    import dataclasses

    from kvcache import simulate

    name = "2026: one kvcache simulate workload under semantics 2025 and 2026"
    if not have or "semantics" not in {f.name for f in dataclasses.fields(simulate.SimConfig)}:
        return waiting(name, "UnifiedCache(semantics=\"2026\") and SimConfig(semantics=...)")
    out = {}
    for sem in ("2025", "2026"):
        rep = simulate.simulate(simulate.SimConfig(semantics=sem))   # type: ignore[call-arg]
        out[sem] = {"find_slot_failures": rep.find_slot_failures, "cells_moved": rep.cells_moved,
                    "defrags": rep.defrags, "tokens_placed": rep.tokens_placed,
                    "tokens_per_s": rep.summary()["tokens_per_s"]}
    return Row(name, None, None, note="ran under both: " + "; ".join(f"{k}: {v}" for k, v in out.items()),
               extra=out)
