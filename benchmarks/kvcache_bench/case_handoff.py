"""`kvcache bench` case `handoff`: one sequence (4096 tokens, 32 layers x 1024 f16; --quick: 512
tokens, 4 layers) moved from one cache to another: in one process (export, import, memcpy of the
regions, commit), between two Ray actors (object store) and between two processes with NIXL (UCX
READ), against memcpy of its bytes and against state_write + pickle + state_read. Every move is
checked: the receiving cache's state equals the sender's. The transports' rows wait when their
library is not installed."""
from __future__ import annotations

import importlib.util
import multiprocessing as mp
import os
import pickle
import statistics
import sys
import time
from typing import Any

import numpy as np

from kvcache_bench._rows import Row, _median_range, _paired, waiting

WIDTH = 1024


def _sizes(quick: bool) -> tuple[int, int]:
    return (512, 4) if quick else (4096, 32)


def _cache(tokens: int, n_layer: int, v_trans: bool, fill: bool) -> Any:
    import kvcache

    c = kvcache.UnifiedCache(tokens, n_layer, WIDTH, WIDTH, type_k="f16", type_v="f16", v_trans=v_trans, n_seq_max=2)
    if fill:
        if not c.find_slot(kvcache.UBatch(pos=list(range(tokens)), seq_id=[0] * tokens)):
            raise AssertionError("no room for the sequence")
        c.commit()
        rng = np.random.default_rng(0)
        for il in c.layers:
            for a in (c.k(il), c.v(il)):
                raw = a.reshape(-1).view(np.uint8)
                raw[:] = np.frombuffer(rng.bytes(raw.nbytes), dtype=np.uint8)
    else:
        for il in c.layers:          # pages faulted in, as the sender's
            c.k(il)[...] = 0
            c.v(il)[...] = 0
    return c


def _label(tokens: int, n_layer: int, v_trans: bool) -> str:
    return f"{tokens} tokens, {n_layer} layers x {WIDTH} f16, v_trans={v_trans}"


def _in_process(tokens: int, n_layer: int, v_trans: bool, reps: int) -> Row:
    from kvcache.handoff import copy_regions

    src, dst = _cache(tokens, n_layer, v_trans, True), _cache(tokens, n_layer, v_trans, False)
    want = src.state_write(0)
    nbytes = src.seq_export(0).n_bytes
    a, b = np.empty(nbytes, dtype=np.uint8), np.ones(nbytes, dtype=np.uint8)

    def once() -> tuple[float, float, float, float]:
        dst.seq_rm(0)
        t0 = time.perf_counter_ns()
        exp = src.seq_export(0)
        imp = dst.seq_import_begin(exp.header)
        t1 = time.perf_counter_ns()
        copy_regions(exp.regions, imp.regions)
        imp.commit()
        t2 = time.perf_counter_ns()
        dst.seq_rm(0)
        t3 = time.perf_counter_ns()
        dst.state_read(pickle.loads(pickle.dumps(src.state_write(0))), 0)
        t4 = time.perf_counter_ns()
        np.copyto(a, b)
        t5 = time.perf_counter_ns()
        return t2 - t0, t4 - t3, t5 - t4, t1 - t0
    res = [once() for _ in range(reps)]
    if dst.state_write(0) != want:
        raise AssertionError("the imported sequence differs from the sender's")
    fast, base, mc = [r[0] for r in res], [r[1] for r in res], [r[2] for r in res]
    m, rg = _median_range(fast)
    return Row(f"handoff in one process (export, import, memcpy of the regions, commit), {_label(tokens, n_layer, v_trans)}",
               m, rg, statistics.median(base), _paired(base, fast), gbps=nbytes / m,
               yardstick="memcpy of its bytes (numpy copyto)", yardstick_gbps=nbytes / statistics.median(mc),
               yardstick_ratio=_paired(fast, mc),
               note=f"baseline: state_write + pickle + state_read; {len(src.seq_export(0).regions)} regions; "
                    f"begin (checks, placement, the copy kept for abort) {statistics.median(r[3] for r in res) / 1e6:.1f} ms")


def _ray_rows(tokens: int, n_layer: int, v_trans: bool, reps: int) -> Row:
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray: Any = importlib.import_module("ray")

    from kvcache.integrations.ray import export_sequence, import_sequence

    class _Side:
        def __init__(self, fill: bool) -> None:
            self.c = _cache(tokens, n_layer, v_trans, fill)

        def export(self) -> tuple[bytes, np.ndarray]:
            return export_sequence(self.c, 0)

        def state(self) -> bytes:
            return self.c.state_write(0)

        def restore(self, header: bytes, data: np.ndarray) -> int:
            return import_sequence(self.c, header, data)

        def read_state(self, blob: bytes) -> int:
            return self.c.state_read(blob, 0)

        def reset(self) -> None:
            self.c.seq_rm(0)

    Side: Any = ray.remote(num_cpus=0)(_Side)

    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        src, dst = Side.remote(True), Side.remote(False)
        want = ray.get(src.state.remote())
        fast, base = [], []
        for _ in range(reps):
            ray.get(dst.reset.remote())
            t0 = time.perf_counter_ns()
            h, d = src.export.options(num_returns=2).remote()
            ray.get(dst.restore.remote(h, d))
            fast.append(time.perf_counter_ns() - t0)
            del h, d
            ray.get(dst.reset.remote())
            t0 = time.perf_counter_ns()
            ray.get(dst.read_state.remote(src.state.remote()))
            base.append(time.perf_counter_ns() - t0)
        if ray.get(dst.state.remote()) != want:
            raise AssertionError("the sequence Ray moved differs from the sender's")
    finally:
        if started:
            ray.shutdown()
    nbytes = len(want)
    m, rg = _median_range(fast)
    return Row(f"handoff between two Ray actors (gather, object store, scatter from the read-only view), "
               f"{_label(tokens, n_layer, v_trans)}", m, rg, statistics.median(base), _paired(base, fast),
               gbps=nbytes / m, note="baseline: state_write bytes through the object store + state_read")


def _nixl_side(role: str, conn: Any, tokens: int, n_layer: int, v_trans: bool, reps: int) -> None:
    """One process of the NIXL measurement (spawned); leaves with os._exit (nixl 1.5.1 dies in
    the interpreter's teardown)."""
    code = 0
    try:
        nixl_api: Any = importlib.import_module("nixl._api")
        nixl_agent, nixl_agent_config = nixl_api.nixl_agent, nixl_api.nixl_agent_config

        from kvcache.integrations.nixl import pull_sequence, register_cache

        c = _cache(tokens, n_layer, v_trans, role == "send")
        agent = nixl_agent(role, nixl_agent_config(backends=["UCX"]))
        reg = register_cache(agent, c)
        conn.send(agent.get_agent_metadata())
        remote = agent.add_remote_agent(conn.recv())
        if role == "send":
            exp = c.seq_export(0)
            conn.send((exp.header, np.asarray(exp.regions), c.state_write(0)))
            for k in range(reps):
                while not agent.check_remote_xfer_done("recv", b"rep-%d" % k):
                    time.sleep(0.0005)
            conn.recv()
        else:
            header, regions, want = conn.recv()
            times = []
            for k in range(reps):
                c.seq_rm(0)
                t0 = time.perf_counter_ns()
                pull_sequence(agent, remote, c, header, regions, notif=b"rep-%d" % k)
                times.append(time.perf_counter_ns() - t0)
            conn.send((times, c.state_write(0) == want, len(want), len(regions)))
        agent.remove_remote_agent(remote)
        agent.deregister_memory(reg)
    except BaseException as e:  # reported to the parent, which raises
        try:
            conn.send(("error", repr(e)))
        finally:
            code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _nixl_row(tokens: int, n_layer: int, v_trans: bool, reps: int) -> Row:
    ctx = mp.get_context("spawn")
    s_here, s_there = ctx.Pipe()
    r_here, r_there = ctx.Pipe()
    procs = [ctx.Process(target=_nixl_side, args=(role, there, tokens, n_layer, v_trans, reps))
             for role, there in (("send", s_there), ("recv", r_there))]
    for p in procs:
        p.start()
    try:
        md_s, md_r = s_here.recv(), r_here.recv()
        for md in (md_s, md_r):
            if isinstance(md, tuple):
                raise RuntimeError(f"NIXL side failed: {md[1]}")
        s_here.send(md_r)
        r_here.send(md_s)
        r_here.send(s_here.recv())
        res = r_here.recv()
        s_here.send("done")
        if isinstance(res, tuple) and res[0] == "error":
            raise RuntimeError(f"NIXL receiver failed: {res[1]}")
    finally:
        for p in procs:
            p.join(120)
    times, same, nbytes, n_regions = res
    if not same:
        raise AssertionError("the sequence NIXL moved differs from the sender's")
    m, rg = _median_range(times)
    return Row(f"handoff between two processes with NIXL (UCX READ into the reserved cells), "
               f"{_label(tokens, n_layer, v_trans)}", m, rg, gbps=nbytes / m,
               note=f"{n_regions} regions; import begin, transfer and commit")


def _bookkeeping(semantics: str, quick: bool, reps: int, n: int = 20) -> Row:
    """The bookkeeping of an import into a sequence that holds no cell (metadata only: no bytes to
    move), seq_import_begin + commit of 100 cells into a cache of 256 sequences (64 when quick)
    three quarters full, against find_slot of the same 100 tokens into the same sequence (the
    placement the import's commit makes); each side n times per repetition, the sequence removed
    after each (untimed), and the import's cells compared with find_slot's."""
    import kvcache

    size, n_seq = (32768, 64) if quick else (262144, 256)
    fill, s = (size // n_seq) * 3 // 4, n_seq - 1

    def cache(n_cells: int, seqs: int) -> Any:
        return kvcache.UnifiedCache(n_cells, 1, 8, 8, n_seq_max=seqs, buffers=None, semantics=semantics)

    def place(c: Any, ub: Any) -> bool:
        placed = c.find_slot(ub)
        if placed and semantics == "2025":
            c.commit()
        return placed

    dst, src = cache(size, n_seq), cache(1024, 1)
    for q in range(n_seq - 1):
        if not place(dst, kvcache.UBatch(np.arange(fill, dtype=np.int32), [q], fill)):
            raise AssertionError("no room filling the destination")
    if not place(src, kvcache.UBatch(np.arange(100, dtype=np.int32), [0], 100)):
        raise AssertionError("no room in the source")
    header = src.seq_export(0).header
    ub = kvcache.UBatch(np.arange(100, dtype=np.int32), [s], 100)
    t_imp: list[float] = []
    t_find: list[float] = []
    for _ in range(reps):
        ti = tf = 0
        for _ in range(n):
            t0 = time.perf_counter_ns()
            dst.seq_import_begin(header, s).commit()
            ti += time.perf_counter_ns() - t0
            got = dst.seq_cells(s)[0].tolist()
            dst.seq_rm(s)
            t0 = time.perf_counter_ns()
            placed = place(dst, ub)
            tf += time.perf_counter_ns() - t0
            if not placed or dst.seq_cells(s)[0].tolist() != got:
                raise AssertionError("the import took other cells than find_slot of its tokens")
            dst.seq_rm(s)
        t_imp.append(ti / n)
        t_find.append(tf / n)
    m, rg = _median_range(t_imp)
    return Row(f"handoff bookkeeping ({semantics}): import of 100 cells into an empty sequence, metadata only, "
               f"{size} cells of {n_seq} sequences 3/4 full (begin + commit)", m, rg,
               yardstick="find_slot of the same 100 tokens", yardstick_ratio=_paired(t_imp, t_find),
               note="the dry run is the slot search; the commit checks the streams' change logs, no copy of the cells")


def bench_handoff(quick: bool, reps: int) -> list[Row]:
    tokens, n_layer = _sizes(quick)
    rows = [_bookkeeping(sem, quick, reps) for sem in ("2025", "2026")]
    for v_trans in (False, True):
        rows.append(_in_process(tokens, n_layer, v_trans, reps))
    for name, fn in (("ray", _ray_rows), ("nixl", _nixl_row)):
        if importlib.util.find_spec(name) is None:
            rows.append(waiting(f"handoff through {name}", f"{name} is not installed (the {name} extra of kvcache)"))
            continue
        for v_trans in (False, True):
            rows.append(fn(tokens, n_layer, v_trans, reps))
    return rows
