"""`kvcache bench`: kvcache's C core against a transcription of the seed's loops, one process.

Every case runs both implementations on the same workload (checking they agree), repeats the
measurement, and reports the median with the min-max range, the ratio baseline / kvcache and,
where data is moved, GB/s next to memset/memcpy of the same bytes measured in the same run.
Ratios matter, not absolute times: machines are noisy."""
from __future__ import annotations

import platform
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Callable


@dataclass
class Row:
    case: str
    kvcache_ns: float              # median per operation
    kvcache_range: tuple           # (min, max) per operation
    baseline_ns: float | None = None
    ratio: float | None = None     # baseline / kvcache (higher is better)
    gbps: float | None = None      # kvcache's bandwidth where data moves
    ref_gbps: float | None = None  # memcpy / memset of the same bytes
    ref_ratio: float | None = None  # kvcache time / reference time (lower is better)
    note: str = ""
    extra: dict = field(default_factory=dict)


def _median_range(values):
    return statistics.median(values), (min(values), max(values))


def _paired(a, b) -> float:
    """Median over the repetitions of a[i] / b[i]: two things timed back to back in each
    repetition, so that a slow spell of the machine slows both."""
    return statistics.median(x / y for x, y in zip(a, b))


def _repeat(fn: Callable[[], tuple], reps: int) -> list[tuple]:
    return [fn() for _ in range(reps)]


def bench_find_slot(quick: bool, reps: int) -> list[Row]:
    from kvcache import _bench

    size = 8192 if quick else 32768
    rows = []
    for frag in (0.0, 0.5):
        def one():
            w = _bench.Workload(size, 32)
            if frag:
                w.fill(size)
                w.fragment(frag)
            f, b, n = w.find_slot_1tok(size)
            return f / n, b / n
        res = _repeat(one, reps)
        fm, fr = _median_range([r[0] for r in res])
        bm, _ = _median_range([r[1] for r in res])
        name = f"find_slot+commit 1 token, 32 seqs, {size} cells" + (", 50% fragmented" if frag else ", clean")
        rows.append(Row(name, fm, fr, bm, bm / fm))

    def prompt():
        w = _bench.Workload(size, 32)
        w.fill(size)
        w.fragment(0.5)
        f, b = w.prompt(512, 20)
        return f / 20, b / 20
    res = _repeat(prompt, reps)
    fm, fr = _median_range([r[0] for r in res])
    bm, _ = _median_range([r[1] for r in res])
    rows.append(Row(f"find_slot 512-token prompt (+seq_rm), {size} cells 50% fragmented", fm, fr, bm, bm / fm))
    return rows


def bench_mask(quick: bool, reps: int) -> list[Row]:
    from kvcache import _bench

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
                    res = _repeat(lambda: w.mask(n_tokens, 8, dtype, inner), reps)
                    fm, fr = _median_range([r[0] / inner for r in res])
                    base = [r[1] / inner for r in res if r[1]]
                    bm = statistics.median(base) if base else None
                    mm = statistics.median([r[2] / inner for r in res])
                    nbytes = res[0][3]
                    rows.append(Row(
                        f"kq_mask {dname} n_kv={n_kv} n_tokens={n_tokens} causal 8 seqs" + (" swa" if swa else ""),
                        fm, fr, bm, _paired([r[1] for r in res], [r[0] for r in res]) if bm else None,
                        nbytes / fm, nbytes / mm, _paired([r[0] for r in res], [r[2] for r in res]),
                        note="reference: memset of the same bytes"))
    return rows


def bench_defrag(quick: bool, reps: int) -> list[Row]:
    from kvcache import _bench

    size = 8192 if quick else 32768
    rows = []

    def plan():
        w = _bench.Workload(size, 32)
        w.fill(size)
        w.fragment(0.5)
        return w.defrag_plan(3)
    res = _repeat(plan, reps)
    fm, fr = _median_range([r[0] for r in res])
    bm, _ = _median_range([r[1] for r in res])
    rows.append(Row(f"defrag plan, {size} cells 50% fragmented", fm, fr, bm, bm / fm))

    cells = 1024 if quick else 4096
    n_layer = 8 if quick else 32
    for v_trans in (False, True):
        w = _bench.Workload(cells, 32, n_layer=n_layer, width=1024, v_trans=v_trans, buffers=True)
        w.fill(cells)
        w.fragment(0.5)
        w.defrag_plan(1)
        nbytes = w.defrag_move(1)[1]

        def one():
            # each repetition: the moves, then memcpy of the moved bytes (and, V transposed, the
            # least-traffic sweep of the same plan) right after, so that all see the same machine
            t = w.defrag_move(3)[0]
            ft = w.defrag_move_floor(3) if v_trans else None
            return t, _bench.memcpy_ns(nbytes, 3, True) / 3, ft
        res = _repeat(one, reps)
        fm, fr = _median_range([r[0] for r in res])
        mc = statistics.median([r[1] for r in res])
        name = f"defrag moves, {cells} cells, {n_layer} layers x 1024 f16, v_trans={v_trans}"
        rows.append(Row(name, fm, fr, None, None, nbytes / fm, nbytes / mc, _paired([r[0] for r in res], [r[1] for r in res]),
                        note="reference: memcpy of the moved bytes"))
        if res[0][2] is not None:
            # transposed V: the same run against the least memory traffic its layout allows
            ft = statistics.median([r[2] for r in res])
            rows.append(Row(name + " (vs the least-traffic sweep)", fm, fr, None, None, nbytes / fm, nbytes / ft,
                            _paired([r[0] for r in res], [r[2] for r in res]),
                            note="reference: reading every line holding a moved cell and writing "
                                 "back those holding a destination, K rows copied, same threads"))
    return rows


def bench_state(quick: bool, reps: int) -> list[Row]:
    """Whole-cache state write/read through the public API (owned buffers, state_write_into a
    preallocated buffer, state_read from it) against the baseline's per-range copies; the
    baseline and kvcache's C core are first checked to write identical blobs."""
    import numpy as np

    import kvcache
    from kvcache import _bench

    cells = 1024 if quick else 4096
    n_layer = 8 if quick else 32
    rows = []
    for v_trans in (False, True):
        w = _bench.Workload(cells, 32, n_layer=n_layer, width=1024, v_trans=v_trans, buffers=True)
        w.fill(cells)
        base = [w.state_io(1) for _ in range(reps)]   # also checks the two blobs are equal
        c = kvcache.UnifiedCache(cells, n_layer, 1024, 1024, type_k="f16", type_v="f16", v_trans=v_trans,
                                 n_seq_max=32)
        rng = np.random.default_rng(0)
        for il in range(n_layer):
            c.k(il)[:] = rng.standard_normal(c.k(il).shape, dtype=np.float32)
            c.v(il)[:] = rng.standard_normal(c.v(il).shape, dtype=np.float32)
        for k in range(cells):
            c.find_slot(kvcache.UBatch([k // 32], [k % 32]))
            c.commit()
        blob = bytearray(c.state_size())
        blob[:] = b"\0" * len(blob)   # pages faulted in, as for the memcpy yardstick

        def write():
            t = time.perf_counter_ns()
            c.state_write_into(blob)
            return time.perf_counter_ns() - t

        def read():
            t = time.perf_counter_ns()
            c.state_read(blob)
            return time.perf_counter_ns() - t
        nbytes = len(blob)
        for k, what, fn in ((1, "write", write), (3, "read", read)):
            # each repetition: the operation, then memcpy of the blob's bytes right after
            res = [(fn(), _bench.memcpy_ns(nbytes, 2) / 2) for _ in range(reps)]
            fm, fr = _median_range([r[0] for r in res])
            mc = statistics.median([r[1] for r in res])
            bm = statistics.median([r[k] for r in base])
            rows.append(Row(f"state {what}, whole cache {cells} cells, {n_layer} layers x 1024 f16, v_trans={v_trans}",
                            fm, fr, bm, bm / fm, nbytes / fm, nbytes / mc, _paired([r[0] for r in res], [r[1] for r in res]),
                            note="reference: memcpy of the blob's bytes"))
    return rows


def bench_calls(quick: bool, reps: int) -> list[Row]:
    """The per-call cost of cheap calls from Python and from Cython through the cimport API."""
    import timeit

    import kvcache
    from kvcache import _bench

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


CASES = {
    "find_slot": bench_find_slot,
    "mask": bench_mask,
    "defrag": bench_defrag,
    "state": bench_state,
    "calls": bench_calls,
}


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
        "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                    "python": platform.python_version(), "time": time.strftime("%Y-%m-%d %H:%M:%S")},
        "quick": quick,
        "repetitions": reps,
        "rows": [asdict(r) for r in rows],
    }


def _fmt_ns(ns: float) -> str:
    for unit, div in (("s", 1e9), ("ms", 1e6), ("us", 1e3)):
        if ns >= div:
            return f"{ns / div:.3g} {unit}"
    return f"{ns:.3g} ns"


def format_table(report: dict) -> str:
    """The report as a Markdown table."""
    out = ["| case | kvcache (median, min-max) | baseline | baseline/kvcache | GB/s | ref GB/s | kvcache/ref |",
           "|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        lo, hi = r["kvcache_range"]
        out.append("| {} | {} ({}-{}) | {} | {} | {} | {} | {} |".format(
            r["case"], _fmt_ns(r["kvcache_ns"]), _fmt_ns(lo), _fmt_ns(hi),
            _fmt_ns(r["baseline_ns"]) if r["baseline_ns"] else "-",
            f"{r['ratio']:.1f}x" if r["ratio"] else "-",
            f"{r['gbps']:.1f}" if r["gbps"] else "-",
            f"{r['ref_gbps']:.1f}" if r["ref_gbps"] else "-",
            f"{r['ref_ratio']:.2f}" if r["ref_ratio"] else "-"))
    m = report["machine"]
    out.append("")
    out.append(f"Machine: {m['platform']}, {m['processor']}, Python {m['python']}; {report['repetitions']} "
               f"repetitions{' (quick)' if report['quick'] else ''}; {m['time']}.")
    return "\n".join(out)


def main(argv=None) -> int:
    """``kvcache bench`` as a program (``python -m kvcache.bench``): the command line's ``bench``
    command (kvcache.cli.bench)."""
    import sys

    from kvcache.cli import main as cli_main

    return cli_main(["bench", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    raise SystemExit(main())
