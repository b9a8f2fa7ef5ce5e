"""kvcache-bench: the cases of `kvcache bench`, kvcache's C core against a transcription of
llama.cpp's loops, one process. `kvcache bench` imports this package (the cases are listed in
CASES, each a function of (quick, repetitions) returning rows); it is installed apart from
kvcache (`pip install ./benchmarks` from a clone).

Every case runs both implementations on the same workload (checking they agree), repeats the
measurement, and reports the median with the min-max range, the ratio baseline / kvcache and,
where data is moved, GB/s next to memset/memcpy of the same bytes measured in the same run.
Ratios matter, not absolute times: machines are noisy."""
from __future__ import annotations

import platform
import statistics
import time
from dataclasses import asdict
from typing import Callable

from kvcache_bench._rows import Row, _median_range, _paired, _paired_interval, waiting  # noqa: F401 (re-exported)


def _repeat(fn: Callable[[], tuple], reps: int) -> list[tuple]:
    return [fn() for _ in range(reps)]


def _versus(case: str, fast: list[float], base: list[float], **kw) -> Row:
    """A row of kvcache against the baseline: medians, and the ratio paired per repetition."""
    fm, fr = _median_range(fast)
    return Row(case, fm, fr, statistics.median(base), _paired(base, fast), **kw)


def memset_yardstick(nbytes: int) -> tuple[str, int]:
    """(name, index) of the floor of writing a mask of nbytes as kvcache writes it: a memset with
    non-temporal stores from KVC_STREAM_BYTES on (kvcache streams such masks), a plain memset
    below (index 0 into (memset, streaming memset))."""
    from kvcache_bench import _bench

    return ("streaming memset", 1) if nbytes >= _bench.STREAM_BYTES else ("memset", 0)


def bench_find_slot(quick: bool, reps: int) -> list[Row]:
    from kvcache_bench import _bench

    size = 8192 if quick else 32768
    rows = []
    for frag in (0.0, 0.5):
        def one():
            w = _bench.Workload(size, 32)
            if frag:
                w.fill(size)
                w.fragment(frag)
            f, b, n = w.find_slot_1tok(size)   # checks head, n, used and every cell
            return f / n, b / n
        res = _repeat(one, reps)
        name = f"find_slot+commit 1 token, 32 seqs, {size} cells" + (", 50% fragmented" if frag else ", clean")
        rows.append(_versus(name, [r[0] for r in res], [r[1] for r in res]))

    n_prompts = 20

    def prompt():
        w = _bench.Workload(size, 32)
        w.fill(size)
        # holes of 4 positions, and a few free runs of 24 positions x 32 sequences = 768 cells that
        # a 512-token prompt fits in: the search walks over the small holes to a long one
        w.fragment(0.5, 4, 4, 24)
        f, b, placed = w.prompt(512, n_prompts)   # both place the same prompts at the same cells
        return f / n_prompts, b / n_prompts, placed
    res = _repeat(prompt, reps)
    placed = min(r[2] for r in res)
    rows.append(_versus(f"find_slot 512-token prompt (+seq_rm), {size} cells 50% fragmented",
                        [r[0] for r in res], [r[1] for r in res],
                        note=f"{placed} of {n_prompts} prompts placed on both sides", extra={"placed": placed}))
    return rows


def bench_mask(quick: bool, reps: int) -> list[Row]:
    from kvcache_bench import _bench

    rows = []
    sizes = (4096,) if quick else (4096, 32768)
    for n_kv in sizes:
        for swa in (0, 1):
            w = _bench.Workload(n_kv, 8, n_swa=256 if swa else 0, swa_type=swa)
            w.fill(n_kv)
            w.fragment(0.25)
            for n_tokens in (1, 32, 512):
                for dtype, dname in ((0, "f32"), (1, "f16"), (2, "bool")):
                    if swa and dtype:
                        continue
                    inner = 3 if n_tokens == 512 else 20
                    # (kvcache, baseline, memset, streaming memset, bytes): f32 masks compared bit for bit
                    res = _repeat(lambda: w.mask(n_tokens, 8, dtype, inner), reps)
                    fast = [r[0] / inner for r in res]
                    fm, fr = _median_range(fast)
                    nbytes = res[0][4]
                    yname, k = memset_yardstick(nbytes)
                    floor = [r[2 + k] / inner for r in res]
                    other = [r[3 - k] / inner for r in res]
                    row = Row(f"kq_mask {dname} n_kv={n_kv} n_tokens={n_tokens} causal 8 seqs" + (" swa" if swa else ""),
                              fm, fr, gbps=nbytes / fm, yardstick=yname, yardstick_gbps=nbytes / statistics.median(floor),
                              yardstick_ratio=_paired(fast, floor),
                              extra={"bytes": nbytes, ("memset" if k else "streaming memset") + " GB/s":
                                     nbytes / statistics.median(other)})
                    if dtype == 0:
                        base = [r[1] / inner for r in res]
                        row.baseline_ns, row.ratio = statistics.median(base), _paired(base, fast)
                    rows.append(row)
    return rows


def bench_defrag(quick: bool, reps: int) -> list[Row]:
    from kvcache_bench import _bench

    size = 8192 if quick else 32768
    rows = []

    def plan():
        # a fresh fragmented workload per repetition: the baseline's plan cannot be undone
        w = _bench.Workload(size, 32)
        w.fill(size)
        w.fragment(0.5)
        return w.defrag_plan(3)   # checks the two plans (every cell's destination) and the cells
    res = _repeat(plan, reps)
    rows.append(_versus(f"defrag plan, {size} cells 50% fragmented", [r[0] for r in res], [r[1] for r in res]))

    cells = 1024 if quick else 4096
    n_layer = 8 if quick else 32
    for v_trans in (False, True):
        w = _bench.Workload(cells, 32, n_layer=n_layer, width=1024, v_trans=v_trans, buffers=True)
        w.fill(cells)
        w.fragment(0.5)
        w.defrag_plan(1)
        nbytes = w.defrag_move(1)[1]

        def one():
            # each repetition: the moves, then the copy of the moved bytes with the moves' threads
            # and stores, one memcpy of them (and, V transposed, the least-traffic sweep of the
            # same plan) right after, so that all see the same machine
            t = w.defrag_move(3)[0]
            ft = w.defrag_move_floor(3) if v_trans else None
            ct, n_threads, stream, mt = w.move_yardstick(3)
            return t, ct, ft, mt, n_threads, stream
        res = _repeat(one, reps)
        fast = [r[0] for r in res]
        fm, fr = _median_range(fast)
        n_threads = res[0][4]
        name = f"defrag moves, {cells} cells, {n_layer} layers x 1024 f16, v_trans={v_trans}"
        copy = [r[1] for r in res]
        yname = (f"copy of the moved bytes, {n_threads} thread{'s' if n_threads > 1 else ''}"
                 + (", non-temporal stores" if res[0][5] else ""))
        single = [r[3] for r in res]
        rows.append(Row(name, fm, fr, gbps=nbytes / fm, yardstick=yname, yardstick_gbps=nbytes / statistics.median(copy),
                        yardstick_ratio=_paired(fast, copy),
                        note=f"one memcpy of the moved bytes: {nbytes / statistics.median(single):.1f} GB/s, "
                             f"kvcache/memcpy {_paired(fast, single):.2f}",
                        extra={"threads": n_threads, "memcpy 1 thread GB/s": nbytes / statistics.median(single),
                               "kvcache / memcpy 1 thread": _paired(fast, single)}))
        if res[0][2] is not None:
            # transposed V: the same run against the least memory traffic its layout allows
            sweep = [r[2] for r in res]
            rows.append(Row(name + " (vs the least-traffic sweep)", fm, fr, gbps=nbytes / fm,
                            yardstick="least-traffic sweep of the plan", yardstick_gbps=nbytes / statistics.median(sweep),
                            yardstick_ratio=_paired(fast, sweep),
                            note="the sweep reads every line holding a moved cell and writes back those holding a "
                                 "destination, K rows copied, the moves' threads"))
    return rows


def bench_state(quick: bool, reps: int) -> list[Row]:
    """Whole-cache state write/read through the public API (owned buffers, state_write_into a
    preallocated buffer, state_read from it) against the baseline's per-range copies (its read
    with mid-2025 llama.cpp's clear(): every K/V buffer zeroed first), paired per repetition with a memcpy
    of the blob's bytes between memory of the kinds they copy between (a bytearray as the blob,
    huge pages as the owned K/V memory). And state_write() returning a fresh bytes object
    against a fresh numpy copy of the blob's bytes (np.copy), paired likewise. The blobs of the
    baseline, kvcache's C core and the public API are checked equal, and every read to restore
    them."""
    import numpy as np

    import kvcache
    from kvcache_bench import _bench

    cells = 1024 if quick else 4096
    n_layer = 8 if quick else 32
    rows = []
    for v_trans in (False, True):
        w = _bench.Workload(cells, 32, n_layer=n_layer, width=1024, v_trans=v_trans, buffers=True)
        w.fill(cells)
        w.state_io(1)    # kvcache's C core and the baseline write identical blobs
        c = kvcache.UnifiedCache(cells, n_layer, 1024, 1024, type_k="f16", type_v="f16", v_trans=v_trans,
                                 n_seq_max=32)
        for il in range(n_layer):
            k, v = w.layer_data(il)
            c.k(il).reshape(-1).view(np.uint8)[:] = k
            c.v(il).reshape(-1).view(np.uint8)[:] = v
        # the same cells as the workload's fill: token k of sequence k % 32 at position k // 32
        for t in range(cells):
            c.find_slot(kvcache.UBatch([t // 32], [t % 32]))
            c.commit()
        nbytes = c.state_size(layout="2025")   # the baseline writes layout 2025
        blob = bytearray(nbytes)
        blob[:] = b"\0" * nbytes   # pages faulted in, as for the memcpy yardstick
        base_blob = bytearray(nbytes + 1)
        base_blob[:] = b"\0" * len(base_blob)
        _, n_base = w.base_state(base_blob, False)
        c.state_write_into(blob, layout="2025")
        if n_base != nbytes or base_blob[:nbytes] != blob:
            raise AssertionError("the public API's state blob differs from the baseline's")
        base_view = memoryview(base_blob)[:nbytes]
        # the memcpy yardstick's two sides: memory of the blob's kind and of the K/V memory's
        yard_blob, yard_kv = bytearray(nbytes), _bench.kv_memory(nbytes)

        def write():
            _bench.scrub()   # clean caches before every timed part (the baseline's and memcpy's too)
            t = time.perf_counter_ns()
            c.state_write_into(blob, layout="2025")
            t = time.perf_counter_ns() - t
            return t, w.base_state(base_blob, False)[0], _bench.memcpy_into_ns(yard_blob, yard_kv, 2) / 2

        def read():
            _bench.scrub()
            t = time.perf_counter_ns()
            c.state_read(blob, layout="2025")
            t = time.perf_counter_ns() - t
            return t, w.base_state(base_view, True)[0], _bench.memcpy_into_ns(yard_kv, yard_blob, 2) / 2
        name = f"whole cache {cells} cells, {n_layer} layers x 1024 f16, v_trans={v_trans}"
        for what, fn in (("write", write), ("read", read)):
            # each repetition: kvcache, the baseline, memcpy of the blob's bytes, back to back
            res = [fn() for _ in range(reps)]
            fast, base, mc = [r[0] for r in res], [r[1] for r in res], [r[2] for r in res]
            rows.append(_versus(f"state {what}, {name}", fast, base, gbps=nbytes / statistics.median(fast),
                                yardstick="memcpy of the blob's bytes", yardstick_gbps=nbytes / statistics.median(mc),
                                yardstick_ratio=_paired(fast, mc)))
        rows.append(_fresh_state_write(c, yard_kv, reps, name))
        # the reads restored what was written, on both sides
        if c.state_write(layout="2025") != bytes(blob) or w.base_state(base_blob, False)[1] != nbytes or base_blob[:nbytes] != blob:
            raise AssertionError("a state read did not restore the blob it read")
    rows.append(_framing(reps))
    return rows


def _framing(reps: int) -> Row:
    """kvcache.statefile.memory_framings of an 87 KB state (a cache of 4 streams, 160 cells of 2
    layers x 64 f16, layout "2026"): every framing the bytes have, as the readers, inspect and
    convert find a layout. Paired per repetition with the floor of reading the bytes once (a
    search for a byte the blob does not hold: memchr over all of it)."""
    import kvcache
    from kvcache import statefile

    c = kvcache.UnifiedCache(256, 2, 64, 64, type_k="f16", type_v="f16", n_seq_max=4, kv_unified=False,
                             semantics="2026")
    for s in range(4):
        c.find_slot(kvcache.UBatch(list(range(40)), [s] * 40))
    blob = c.state_write()
    absent = b"\xa5"   # the K/V bytes are zeros, the cells' fields small numbers
    if absent in blob or len(statefile.memory_framings(blob)) != 1:
        raise AssertionError("the framing benchmark's blob is not one state in one framing")
    number = 200
    fast, scan = [], []
    for _ in range(reps):
        t = time.perf_counter_ns()
        for _ in range(number):
            statefile.memory_framings(blob)
        fast.append((time.perf_counter_ns() - t) / number)
        t = time.perf_counter_ns()
        for _ in range(number):
            blob.find(absent)
        scan.append((time.perf_counter_ns() - t) / number)
    m, r = _median_range(fast)
    return Row(f"state framing (statefile.memory_framings), {len(blob) / 1000:.0f} KB, 4 streams", m, r,
               gbps=len(blob) / m, yardstick="memchr over the blob's bytes (bytes.find)",
               yardstick_gbps=len(blob) / statistics.median(scan), yardstick_ratio=_paired(fast, scan))


def _fresh_state_write(c, src, reps: int, name: str) -> Row:
    """state_write() (a new bytes object each time) against np.copy of as many bytes from src, a
    uint8 array in memory of the K/V memory's kind (a new array each time), paired per
    repetition; both objects are dropped untimed."""
    import numpy as np

    from kvcache_bench import _bench

    nbytes = len(src)
    fast, npc = [], []
    for _ in range(reps):
        _bench.scrub()
        t = time.perf_counter_ns()
        out = c.state_write(layout="2025")
        fast.append(time.perf_counter_ns() - t)
        if len(out) != nbytes:
            raise AssertionError("state_write() returned a blob of another size")
        del out
        _bench.scrub()
        t = time.perf_counter_ns()
        out = np.copy(src)
        npc.append(time.perf_counter_ns() - t)
        del out
    m, r = _median_range(fast)
    return Row(f"state_write() to a fresh bytes object, {name}", m, r, gbps=nbytes / m,
               yardstick="fresh numpy copy of the blob's bytes (np.copy)", yardstick_gbps=nbytes / statistics.median(npc),
               yardstick_ratio=_paired(fast, npc))


def bench_calls(quick: bool, reps: int) -> list[Row]:
    """The per-call cost of cheap calls from Python and from Cython through the cimport API."""
    import timeit

    import kvcache
    from kvcache_bench import _bench

    c = kvcache.UnifiedCache(kv_size=4096, n_layer=1, n_embd_k_gqa=64, n_embd_v_gqa=64, n_seq_max=4)
    ub = kvcache.UBatch(list(range(100)), [0] * 100)
    c.find_slot(ub)
    c.commit()
    number = 20000 if quick else 200000
    rows = []
    for name, stmt in (("seq_pos_max", "c.seq_pos_max(0)"),
                       ("seq_rm of an absent range", "c.seq_rm(0, 2000000000, 2000000001)")):
        per = [timeit.timeit(stmt, globals={"c": c}, number=number) / number * 1e9 for _ in range(reps)]
        m, r = _median_range(per)
        rows.append(Row(f"Python call: {name} (4096 cells)", m, r))
    cy = [_bench.cimport_call_ns(c, number * 10) for _ in range(reps)]
    for k, name in ((0, "seq_pos_max_c"), (1, "seq_rm_c of an absent range")):
        m, r = _median_range([x[k] for x in cy])
        rows.append(Row(f"Cython cimport call: {name} (4096 cells)", m, r))
    return rows


def bench_step(quick: bool, reps: int) -> list[Row]:
    """The decode step from Python against the baseline's same step and the floor
    (kvcache_bench.case_step)."""
    from kvcache_bench.case_step import bench_step as case

    return case(quick, reps)


def bench_scale(quick: bool, reps: int) -> list[Row]:
    """Each operation's cost as the cache grows (kvcache_bench.case_step)."""
    from kvcache_bench.case_step import bench_scale as case

    return case(quick, reps)


def bench_2026(quick: bool, reps: int) -> list[Row]:
    """Today's semantics: scatter find_slot and the unpadded decode mask against today's loop
    (kvcache_bench.case_2026)."""
    from kvcache_bench.case_2026 import bench_2026 as case

    return case(quick, reps)


def bench_serving(quick: bool, reps: int) -> list[Row]:
    """One seeded serving workload through kvcache, vLLM and SGLang (kvcache_bench.case_serving)."""
    from kvcache_bench.case_serving import bench_serving as case

    return case(quick, reps)


def bench_torch(quick: bool, reps: int) -> list[Row]:
    """generate with the kvcache transformers Cache against DynamicCache, and kvcache's calls
    per decode step with K/V in torch tensors (kvcache_bench.case_torch)."""
    from kvcache_bench.case_torch import bench_torch as case

    return case(quick, reps)


def bench_handoff(quick: bool, reps: int) -> list[Row]:
    """A sequence moved between caches: in one process, through Ray and NIXL, against memcpy and
    state_write + pickle (kvcache_bench.case_handoff)."""
    from kvcache_bench.case_handoff import bench_handoff as case

    return case(quick, reps)


def bench_store(quick: bool, reps: int) -> list[Row]:
    """A prefix restored from the prefix store's host and disk tiers, against memcpy and a read of
    its bytes (kvcache_bench.case_store)."""
    from kvcache_bench.case_store import bench_store as case

    return case(quick, reps)


def bench_store_llama(quick: bool, reps: int) -> list[Row]:
    """llama-cpp-python's time to first token with kvcache's prompt cache, LlamaRAMCache and no
    cache (kvcache_bench.case_store)."""
    from kvcache_bench.case_store import bench_store_llama as case

    return case(quick, reps)


def bench_attention(quick: bool, reps: int) -> list[Row]:
    """A decode step's attention through kvcache's attention indices against the dense mask
    (kvcache_bench.case_attention)."""
    from kvcache_bench.case_attention import bench_attention as case

    return case(quick, reps)


def bench_hybrid(quick: bool, reps: int) -> list[Row]:
    """The hybrid memory's decode step against its two parts driven apart
    (kvcache_bench.case_hybrid)."""
    from kvcache_bench.case_hybrid import bench_hybrid as case

    return case(quick, reps)


CASES = {
    "find_slot": bench_find_slot,
    "mask": bench_mask,
    "defrag": bench_defrag,
    "state": bench_state,
    "calls": bench_calls,
    "step": bench_step,
    "scale": bench_scale,
    "2026": bench_2026,
    "serving": bench_serving,
    "torch": bench_torch,
    "handoff": bench_handoff,
    "attention": bench_attention,
    "hybrid": bench_hybrid,
    "store": bench_store,
    "store_llama": bench_store_llama,
}


def machine() -> dict:
    """The machine of a run: platform, processor, CPU count, Python, time and the load average at
    the end (this bench often runs on shared machines: a figure means little without it)."""
    import os

    load = None
    if hasattr(os, "getloadavg"):
        load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(), "python": platform.python_version(), "time": time.strftime("%Y-%m-%d %H:%M:%S"),
            "load": load}


def run(quick: bool = False, cases: list[str] | None = None, reps: int | None = None,
        progress: Callable[[str], None] | None = None) -> dict:
    """Run the benchmark cases; returns {"machine": ..., "rows": [...]}."""
    reps = reps or (3 if quick else 7)
    rows: list[Row] = []
    for name in cases or list(CASES):
        if progress:
            progress(name)
        rows += CASES[name](quick, reps)
    return {
        "machine": machine(),
        "quick": quick,
        "repetitions": reps,
        "rows": [asdict(r) for r in rows],
    }


def _fmt_ns(ns: float) -> str:
    for unit, div in (("s", 1e9), ("ms", 1e6), ("us", 1e3)):
        if ns >= div:
            return f"{ns / div:.3g} {unit}"
    return f"{ns:.3g} ns"


COLUMNS = ("case", "kvcache (median, min-max)", "baseline", "baseline/kvcache", "GB/s", "yardstick", "yardstick GB/s",
           "kvcache/yardstick")


def format_table(report: dict) -> str:
    """The report as a Markdown table (a row that waits says for what in its kvcache column)."""
    out = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in report["rows"]:
        if r["kvcache_ns"] is None:
            timing = r["note"]
        else:
            lo, hi = r["kvcache_range"]
            timing = f"{_fmt_ns(r['kvcache_ns'])} ({_fmt_ns(lo)}-{_fmt_ns(hi)})"
        out.append("| " + " | ".join((
            r["case"], timing,
            _fmt_ns(r["baseline_ns"]) if r["baseline_ns"] else "-",
            f"{r['ratio']:.1f}x" if r["ratio"] else "-",
            f"{r['gbps']:.1f}" if r["gbps"] else "-",
            r["yardstick"] or "-",
            f"{r['yardstick_gbps']:.1f}" if r["yardstick_gbps"] else "-",
            f"{r['yardstick_ratio']:.2f}" if r["yardstick_ratio"] else "-")) + " |")
    m = report["machine"]
    out.append("")
    load = f"; load average {m['load']}" if m.get("load") else ""
    out.append(f"Machine: {m['platform']}, {m['processor']}, {m.get('cpus', '?')} CPUs, Python {m['python']}; "
               f"{report['repetitions']} repetitions{' (quick)' if report['quick'] else ''}; {m['time']}{load}.")
    notes = [f"- {r['case']}: {r['note']}" for r in report["rows"] if r["note"] and r["kvcache_ns"] is not None]
    if notes:
        out += ["", "Notes:", *notes]
    from kvcache_bench.case_serving import format_serving

    serving = format_serving(report)
    if serving:
        out += ["", "Serving workload, bookkeeping cost per step from Python (CPU time of the driving thread, best "
                    "replay):", "", serving]
    return "\n".join(out)

