"""`kvcache bench` cases timed from Python as a server calls kvcache: the decode step against the
baseline's same step and its floor, and the cost of each operation as the cache grows.

Both build the same picture of a busy server: every cell of the cache holds context of the
running sequences (so the mask spans the whole cache, as it does once a server has run for a
while) except a hole that a finished request left, where the steps place their tokens."""
from __future__ import annotations

import gc
import os
import statistics
import time
from dataclasses import dataclass

import numpy as np

from kvcache._atomic import atomic_write
from kvcache_bench._rows import Row, _median_range, _paired, waiting


@dataclass(frozen=True)
class Capabilities:
    """What this kvcache offers that the cases pick up by themselves once it exists."""

    max_seqs: int          # sequences a UnifiedCache holds (64 today, 256 once the C core holds 256)
    unpadded_mask: bool    # kq_mask(ub, pad=False, dtype=...): n_tokens rows, no padding rows
    semantics_2026: bool   # UnifiedCache(semantics="2026"): today's llama.cpp placement
    mask_reuse: bool = False   # kq_mask(ub, out=prev, reuse=True): only what changed is rewritten


_CAPS: list[Capabilities] = []


def capabilities() -> Capabilities:
    """Probe the installed kvcache once (small caches, nothing kept)."""
    if _CAPS:
        return _CAPS[0]
    import kvcache

    max_seqs = 64
    try:
        kvcache.UnifiedCache(256, 1, 8, 8, n_seq_max=256, buffers=None)
        max_seqs = 256
    except (ValueError, TypeError):
        pass
    c = kvcache.UnifiedCache(64, 1, 8, 8, buffers=None)
    ub = kvcache.UBatch([0], [0])
    c.find_slot(ub)
    try:
        unpadded = c.kq_mask(ub, pad=False, dtype="bool").shape[0] == 1   # type: ignore[call-arg,call-overload]
    except TypeError:
        unpadded = False
    try:
        kvcache.UnifiedCache(256, 1, 8, 8, buffers=None, semantics="2026")   # type: ignore[call-arg]
        semantics = True
    except TypeError:
        semantics = False
    try:
        prev = c.kq_mask(ub)
        c.kq_mask(ub, out=prev, reuse=True)   # type: ignore[call-arg,call-overload]
        reuse = True
    except TypeError:
        reuse = False
    _CAPS.append(Capabilities(max_seqs, unpadded, semantics, reuse))
    return _CAPS[0]


def kq_mask_into(c, ub, out, dtype: str, pad: bool):
    """c.kq_mask into out as a decode loop calls it (out holds the previous step's mask: reused
    where the API can), unpadded where asked (only when the API has it: see capabilities)."""
    kw = {"reuse": True} if capabilities().mask_reuse else {}
    if pad:
        return c.kq_mask(ub, out=out, dtype=dtype, **kw)
    return c.kq_mask(ub, out=out, dtype=dtype, pad=False, **kw)


def mask_rows(n_tokens: int, pad: bool) -> int:
    return (n_tokens + 63) // 64 * 64 if pad else n_tokens


class Busy:
    """A kvcache cache and (optionally) a baseline one in the same busy state.

    ``size`` cells: cells [0, hole) free (a finished request's), the rest the contexts of
    ``n_seq`` sequences in contiguous runs (sequence s at positions 0...); ``next_pos[s]`` is
    where each continues. Both sides are filled with the same ubatches and checked equal."""

    def __init__(self, size: int, n_seq: int, hole: int, n_layer: int, width: int, buffers: bool,
                 baseline: bool, n_seq_max: int | None = None):
        import kvcache

        if hole + n_seq > size:
            raise ValueError(f"{size} cells cannot hold a hole of {hole} and {n_seq} contexts")
        self.size, self.n_seq, self.hole, self.n_layer, self.width = size, n_seq, hole, n_layer, width
        self.c = kvcache.UnifiedCache(size, n_layer, width, width, type_k="f16", type_v="f16", v_trans=False,
                                      n_seq_max=n_seq_max or n_seq, buffers="owned" if buffers else None)
        self.base = None
        if baseline:
            from kvcache_bench import _bench

            self.base = _bench.Baseline(size, n_layer, width)
        ctx = size - hole
        lens = [ctx // n_seq + (1 if s < ctx % n_seq else 0) for s in range(n_seq)]
        # the finished request first (sequence 0 at positions far above its context), then the contexts
        self._place(np.arange(1 << 30, (1 << 30) + hole, dtype=np.int32), 0)
        for s, n in enumerate(lens):
            self._place(np.arange(n, dtype=np.int32), s)
        self.c.seq_rm(0, 1 << 30, -1)
        if self.base is not None:
            self.base.seq_rm(0, 1 << 30, -1)
        self.next_pos = np.array(lens, dtype=np.int32)
        assert self.c.used == ctx and (self.c.head == 0 or not hole)
        self.check_cells()

    def _place(self, pos, s: int) -> None:
        import kvcache

        if len(pos) == 0:
            return
        if not self.c.find_slot(kvcache.UBatch(pos, [s], n_seq_tokens=len(pos))):
            raise AssertionError("the busy state does not fit")
        self.c.commit()
        if self.base is not None:
            if not self.base.find_slot(pos, np.full(len(pos), s, dtype=np.int32)):
                raise AssertionError("the busy state does not fit the baseline")
            self.base.commit()

    def check_cells(self) -> None:
        """kvcache and the baseline hold the same cells, head, n and used."""
        if self.base is None:
            return
        mine, theirs = (self.c.head, self.c.n, self.c.used), self.base.counters()
        if mine != theirs:
            raise AssertionError(f"kvcache and baseline disagree: head/n/used {mine} vs {theirs}")
        cells = self.c.cells()
        pos, seq = self.base.cells()
        # the baseline holds 64 sequences (one word per cell); the step compares with it only then
        mine_seq = cells.seq_mask[:, 0]
        if not np.array_equal(cells.pos, pos) or not np.array_equal(np.where(pos >= 0, mine_seq, 0),
                                                                    np.where(pos >= 0, seq, 0)):
            raise AssertionError("kvcache and baseline hold different cells")


def _step_tokens(busy: Busy, kind: str, n_seq: int, chunk: int):
    """(pos, seq) int32 arrays of the next step: one decode token per sequence, or (mixed) one
    per sequence but the last, which gets a prefill chunk of `chunk` tokens."""
    if kind == "decode":
        pos = busy.next_pos.copy()
        seq = np.arange(n_seq, dtype=np.int32)
        busy.next_pos += 1
        return pos, seq
    d = n_seq - 1
    p = int(busy.next_pos[d])
    pos = np.concatenate([busy.next_pos[:d], np.arange(p, p + chunk, dtype=np.int32)])
    seq = np.concatenate([np.arange(d, dtype=np.int32), np.full(chunk, d, dtype=np.int32)])
    busy.next_pos[:d] += 1
    busy.next_pos[d] += chunk
    return pos, seq


def mask_variants(caps: Capabilities) -> list[tuple[str, bool]]:
    """(dtype, padded) of the masks a step asks for: unpadded bool and f32 and the padded f32
    once kq_mask(pad=False) exists; the padded f32 and bool until then."""
    if caps.unpadded_mask:
        return [("bool", False), ("f32", False), ("f32", True)]
    return [("f32", True), ("bool", True)]


def bench_step(quick: bool, reps: int) -> list[Row]:
    """The decode step of a server, timed from Python: UBatch from numpy arrays, find_slot, store
    of every layer's K and V rows, the KQ mask into a reused buffer, commit; B sequences x 1 token
    (B = 1, 32, 256) and a mixed step (a prefill chunk and 31 decode tokens), against the
    baseline's same step (one C++ call: mid-2025 llama.cpp's ubatch vectors, find_slot, cpy_k/cpy_v, the
    padded f32 mask, commit) and against the floor (the mask's bytes at memset speed, streaming
    where kvcache streams, and the K/V rows at memcpy speed), all three in every repetition.
    Every step is checked: same cells on both sides, same K/V rows, masks equal to the
    baseline's (bool: True exactly where its f32 is 0)."""
    caps = capabilities()
    sizes = (8192,) if quick else (32768, 1 << 20)
    n_layer, width, chunk = (4, 128, 128) if quick else (32, 1024, 512)
    variants = mask_variants(caps)
    rows: list[Row] = []
    for size in sizes:
        for kind, n_seq in (("decode", 1), ("decode", 32), ("decode", 256), ("mixed", 32)):
            what = (f"decode step {n_seq} seq{'s' if n_seq > 1 else ''} x 1 token" if kind == "decode"
                    else f"mixed step {chunk}-token prefill chunk + {n_seq - 1} decode tokens")
            name = f"{what}, {size} cells, {n_layer} layers x {width} f16"
            if n_seq > caps.max_seqs:
                rows.append(waiting(name, f"{n_seq} sequences need n_seq_max {n_seq} (this kvcache holds "
                                          f"{caps.max_seqs})"))
                continue
            rows += _step_case(name, size, kind, n_seq, chunk, n_layer, width, variants, reps, quick)
            gc.collect()
    return rows


def _step_case(name, size, kind, n_seq, chunk, n_layer, width, variants, reps, quick) -> list[Row]:
    import kvcache

    n_tok = n_seq if kind == "decode" else n_seq - 1 + chunk
    # mid-2025 llama.cpp's cells hold 64 sequences: beyond that there is no baseline of the same step
    with_base = n_seq <= 64
    steps = (reps + 1) * len(variants)
    busy = Busy(size, n_seq, steps * n_tok, n_layer, width, buffers=True, baseline=with_base)
    c, base = busy.c, busy.base
    row_bytes = width * 2
    # the K/V pages of the hole faulted in on both sides (a server's memory is), sources per layer
    for il in range(n_layer):
        c.k(il)[:busy.hole] = 0
        c.v(il)[:busy.hole] = 0
        if base is not None:
            for b in base.layer(il):
                b[:busy.hole * row_bytes] = 0
    rng = np.random.default_rng(0)
    k_src = [rng.standard_normal((n_tok, width)).astype(np.float16) for _ in range(n_layer)]
    v_src = [rng.standard_normal((n_tok, width)).astype(np.float16) for _ in range(n_layer)]
    k_ptr = np.array([a.ctypes.data for a in k_src], dtype=np.uint64)
    v_ptr = np.array([a.ctypes.data for a in v_src], dtype=np.uint64)
    base_mask = None
    if base is not None:
        base_mask = np.zeros((mask_rows(n_tok, True), c.n), dtype=np.float32)   # faulted in below
        base_mask.fill(0)
    from kvcache_bench import _bench

    rows = []
    for dtype, pad in variants:
        out: np.ndarray = np.empty((mask_rows(n_tok, pad), c.n), dtype=np.float32 if dtype == "f32" else np.bool_)
        out.fill(0)   # faulted in: a server reuses its mask buffer
        # the floor's memset gets a buffer of its own: out holds the previous step's mask
        floor_buf = np.zeros(out.nbytes, dtype=np.uint8)
        fast, slow, floor = [], [], []
        for rep in range(reps + 1):
            pos, seq = _step_tokens(busy, kind, n_seq, chunk)
            gc.collect()
            _bench.scrub()   # every timed part starts with clean caches (the floor and baseline's too)
            t0 = time.perf_counter_ns()
            ub = kvcache.UBatch(pos, seq)
            if not c.find_slot(ub):
                raise AssertionError("the step found no slot")
            for il in range(n_layer):
                c.store(il, k_src[il], v_src[il])
            kq_mask_into(c, ub, out, dtype, pad)
            c.commit()
            t1 = time.perf_counter_ns()
            head = c.head
            if base is not None:
                assert base_mask is not None
                tb, ok = base.step(pos, seq, k_ptr, v_ptr, base_mask)
                if not ok or base.counters()[0] != head:
                    raise AssertionError(f"the baseline placed the step elsewhere ({base.counters()[0]} / {head})")
                _check_step(c, base, out, base_mask, dtype, pad, n_tok, head, n_layer, row_bytes,
                            every_layer=quick)
            dst = np.array([c.k(il)[head:].ctypes.data for il in range(n_layer)]
                           + [c.v(il)[head:].ctypes.data for il in range(n_layer)], dtype=np.uint64)
            src = np.concatenate([k_ptr, v_ptr])
            tf = _bench.step_floor_ns(floor_buf, dst, src, n_tok * row_bytes)
            if rep:   # the first step warms up
                fast.append(t1 - t0)
                floor.append(tf)
                if base is not None:
                    slow.append(tb)
        busy.check_cells()
        fm, fr = _median_range(fast)
        mask_bytes = out.nbytes
        floor_ratio = _paired(fast, floor)
        ratio = _paired(slow, fast) if slow else None
        shape = f"mask {dtype} {'padded' if pad else 'unpadded'}"
        rows.append(Row(f"{name}, {shape}", fm, fr, statistics.median(slow) if slow else None, ratio,
                        (mask_bytes + 2 * n_layer * n_tok * row_bytes) / fm,
                        yardstick="floor: " + ("streaming memset" if mask_bytes >= _bench.STREAM_BYTES else "memset")
                                  + " of the mask + memcpy of the K/V rows",
                        yardstick_gbps=(mask_bytes + 2 * n_layer * n_tok * row_bytes) / statistics.median(floor),
                        yardstick_ratio=floor_ratio,
                        note="" if base is not None else "no baseline: mid-2025 llama.cpp's cells hold 64 sequences",
                        extra={"mask_bytes": mask_bytes, "kv_bytes": 2 * n_layer * n_tok * row_bytes,
                               "tokens": n_tok, "baseline mask": "f32 padded",
                               "mask buffer": "reused (only what changed rewritten)" if capabilities().mask_reuse
                               else "rewritten whole"}))
        del out, floor_buf
    return rows


def _check_step(c, base, out, base_mask, dtype, pad, n_tok, head, n_layer, row_bytes, every_layer) -> None:
    """One step's agreement: the mask against the baseline's (f32 equal bit for bit; bool True
    exactly where the f32 is 0; unpadded: its rows are the padded one's first), the K/V rows
    written (every layer in the quick run, the first and last otherwise)."""
    ref = base_mask[:out.shape[0]]
    if out.shape[1] != ref.shape[1]:
        raise AssertionError(f"the masks span {out.shape[1]} / {ref.shape[1]} cells")
    for r0 in range(0, out.shape[0], 64):   # in blocks of rows: no temporaries of a whole mask
        a, b = out[r0:r0 + 64], ref[r0:r0 + 64]
        same = np.array_equal(a.view(np.uint32), b.view(np.uint32)) if dtype == "f32" else np.array_equal(a, b == 0)
        if not same:
            raise AssertionError(f"kvcache's {dtype} mask differs from the baseline's in rows {r0}-{r0 + 63}")
    layers = range(n_layer) if every_layer else sorted({0, n_layer - 1})
    for il in layers:
        kb, vb = base.layer(il)
        lo, hi = head * row_bytes, (head + n_tok) * row_bytes
        if (not np.array_equal(c.k(il)[head:head + n_tok].reshape(-1).view(np.uint8), kb[lo:hi])
                or not np.array_equal(c.v(il)[head:head + n_tok].reshape(-1).view(np.uint8), vb[lo:hi])):
            raise AssertionError(f"kvcache and baseline wrote different K/V rows in layer {il}")


#: the operations of the scale case, in the order they run
SCALE_OPS = ("find_slot+commit", "decode mask", "seq_pos_min/max", "seq_rm", "seq_cp")


def bench_scale(quick: bool, reps: int) -> list[Row]:
    """What each operation of a serving step costs as the cache grows (4096 -> 2**20 cells, every
    cell holding context, 256 sequences where kvcache holds them, 64 until then), from Python on
    a metadata-only cache: find_slot+commit of a decode batch (one token per sequence), its KQ
    mask (the first of the step's mask variants), seq_pos_min/max, seq_rm of a finished request
    (a whole sequence), seq_cp of a 256-token prefix to a new request. Today most of them scan
    every cell, so they grow with the cache; the goal is that they cost what changes."""
    import kvcache

    caps = capabilities()
    n_seq = min(256, caps.max_seqs)
    dtype, pad = mask_variants(caps)[0]
    sizes = (4096, 16384) if quick else (4096, 16384, 65536, 262144, 1 << 20)
    rows: list[Row] = []
    for size in sizes:
        gc.collect()
        n = reps + 1
        busy = Busy(size, n_seq, n * n_seq, 1, 8, buffers=False, baseline=False)
        c = busy.c
        t: dict[str, list[float]] = {op: [] for op in SCALE_OPS}
        out: np.ndarray = np.empty((mask_rows(n_seq, pad), c.n), dtype=np.float32 if dtype == "f32" else np.bool_)
        out.fill(0)
        for _ in range(n):
            pos, seq = _step_tokens(busy, "decode", n_seq, 0)
            ub = kvcache.UBatch(pos, seq)
            t0 = time.perf_counter_ns()
            if not c.find_slot(ub):
                raise AssertionError("the decode batch found no slot")
            c.commit()
            t1 = time.perf_counter_ns()
            kq_mask_into(c, ub, out, dtype, pad)
            t2 = time.perf_counter_ns()
            t["find_slot+commit"].append(t1 - t0)
            t["decode mask"].append(t2 - t1)
            # the mask shows each token its own sequence's cells and nothing else
            if not np.array_equal(np.count_nonzero(out[:n_seq] == (True if dtype == "bool" else 0), axis=1),
                                  busy.next_pos):
                raise AssertionError("the decode mask does not show each token its context")
        seqs = list(range(n_seq)) * max(1, 4096 // n_seq)
        for _ in range(n):
            t0 = time.perf_counter_ns()
            for s in seqs:
                c.seq_pos_min(s)
                c.seq_pos_max(s)
            t["seq_pos_min/max"].append((time.perf_counter_ns() - t0) / (2 * len(seqs)))
        finished = list(range(n_seq - 1, n_seq - 1 - n, -1))
        for s in finished:
            t0 = time.perf_counter_ns()
            c.seq_rm(s, -1, -1)
            t["seq_rm"].append(time.perf_counter_ns() - t0)
            if c.seq_pos_max(s) != -1:
                raise AssertionError("seq_rm left cells of the finished sequence")
        prefix = min(256, int(busy.next_pos[0]))
        for s in finished:
            t0 = time.perf_counter_ns()
            c.seq_cp(0, s, 0, prefix)
            t["seq_cp"].append(time.perf_counter_ns() - t0)
            if (c.seq_pos_min(s), c.seq_pos_max(s)) != (0, prefix - 1):
                raise AssertionError("seq_cp did not copy the prefix")
        for op in SCALE_OPS:
            v = t[op][1:] if op in ("find_slot+commit", "decode mask") else t[op]
            m, r = _median_range(v)
            what = {"find_slot+commit": f"find_slot+commit of a decode batch ({n_seq} tokens)",
                    "decode mask": f"decode mask {dtype} {'padded' if pad else 'unpadded'} ({n_seq} tokens)",
                    "seq_pos_min/max": "seq_pos_min / seq_pos_max (per call)",
                    "seq_rm": "seq_rm of a finished request",
                    "seq_cp": f"seq_cp of a {prefix}-token prefix"}[op]
            rows.append(Row(f"scale: {what}, {size} cells, {n_seq} seqs", m, r,
                            extra={"op": op, "cells": size, "seqs": n_seq}))
        del out, busy, c
    return rows


def plot_scale(report: dict, path: str) -> bool:
    """Draw the scale rows of a report (cost per operation against cells, log-log) into path.
    False when there is nothing to draw or matplotlib is not installed."""
    pts: dict[str, list[tuple[int, float]]] = {}
    for r in report["rows"]:
        op = r.get("extra", {}).get("op")
        if op and r["kvcache_ns"]:
            pts.setdefault(op, []).append((r["extra"]["cells"], r["kvcache_ns"]))
    if not pts:
        return False
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for op, xy in pts.items():
        xy.sort()
        ax.plot([x for x, _ in xy], [y / 1e3 for _, y in xy], marker="o", label=op)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("cells")
    ax.set_ylabel("µs per operation (median)")
    m = report["machine"]
    ax.set_title(f"kvcache: cost per operation as the cache grows\n{m['time']}, load {m.get('load') or '?'}",
                 fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    try:
        with atomic_write(path) as f:
            # matplotlib takes the format from a path's extension, not from a file object
            fig.savefig(f, dpi=120, format=os.path.splitext(path)[1][1:] or None)
    finally:
        plt.close(fig)
    return True
