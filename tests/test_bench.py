"""``kvcache bench``'s cases in their quick sizes: every agreement check a case makes between
kvcache and the baseline (or a peer) runs here as a test. Their timings are not checked: speed
goes in the bench's table, never in a test."""
import importlib.util

import pytest

from conftest import need_module, needs_bench

pytestmark = needs_bench


def _rows(name):
    import kvcache_bench as bench

    rows = bench.CASES[name](True, 1)
    assert rows, f"the {name} case made no row"
    for r in rows:
        assert r.kvcache_ns is None or r.kvcache_ns > 0, r
    return rows


def test_find_slot_places_the_same_cells_on_both_sides():
    rows = _rows("find_slot")
    prompt = [r for r in rows if "512-token prompt" in r.case]
    # the prompts were placed (not a failed search timed on both sides), the same ones on each
    assert len(prompt) == 1 and prompt[0].extra["placed"] > 0
    assert all(r.baseline_ns and r.ratio for r in rows)


def test_the_checks_see_a_difference_in_the_cells():
    from kvcache_bench import _bench

    w = _bench.Workload(512, 4)
    w.fill(256)
    w.check()
    w._desync(1, 3, 4)            # one cell emptied on kvcache's side only
    with pytest.raises(AssertionError, match="disagree"):
        w.check()


def test_a_failed_prompt_search_is_not_timed_as_a_placement():
    from kvcache_bench import _bench

    w = _bench.Workload(1024, 32)
    w.fill(1024)
    w.fragment(0.5)               # holes of 4 positions only: no free run of 512 cells
    with pytest.raises(AssertionError, match="no prompt was placed"):
        w.prompt(512, 2)


def test_defrag_plans_are_compared_cell_by_cell():
    from kvcache_bench import _bench

    _rows("defrag")
    w = _bench.Workload(2048, 8)
    w.fill(2048)
    w.fragment(0.5)
    w._desync(0, 0, 64)           # kvcache's side has more holes: its plan differs
    with pytest.raises(AssertionError, match="defrag plan|cell"):
        w.defrag_plan(1)


def test_masks_agree():
    rows = _rows("mask")
    assert any(r.baseline_ns for r in rows)
    # the yardstick is named for what it is, and is a streaming memset where kvcache streams
    from kvcache_bench import _bench

    for r in rows:
        assert r.yardstick == ("streaming memset" if r.extra["bytes"] >= _bench.STREAM_BYTES else "memset")


def test_state_blobs_agree_and_reads_restore_them():
    rows = _rows("state")
    assert {r.case.split(",")[0] for r in rows} == {"state write", "state read", "state_write() to a fresh bytes object",
                                                     "state framing (statefile.memory_framings)"}
    for r in rows:
        if r.case.startswith("state framing"):
            assert r.baseline_ns is None and r.yardstick == "memchr over the blob's bytes (bytes.find)"
        elif r.case.startswith("state_write()"):
            assert r.baseline_ns is None and r.yardstick == "fresh numpy copy of the blob's bytes (np.copy)"
        else:
            assert r.baseline_ns and r.yardstick == "memcpy of the blob's bytes"


def test_the_baseline_state_read_clears_the_cache_as_the_seed_does():
    import numpy as np

    from kvcache_bench import _bench

    # random K/V bytes in every cell (_attach), 64 cells in use
    w = _bench.Workload(256, 4, n_layer=2, width=32, v_trans=False, buffers=True)
    w.fill(64)
    blob = bytearray(1 << 20)
    _, n = w.base_state(blob, False)
    row = 32 * 2
    assert all(np.any(b[64 * row:]) for b in w.base_layer_data(1))
    w.base_state(memoryview(blob)[:n], True)
    # the cells past the blob's 64 hold zeros, K and V of every layer; the blob reads back as is
    for il in range(2):
        for b in w.base_layer_data(il):
            assert not np.any(b[64 * row:])
    out = bytearray(1 << 20)
    assert w.base_state(out, False)[1] == n and out[:n] == blob[:n]


def test_calls_case_runs():
    _rows("calls")


def test_decode_steps_agree_with_the_baselines_step():
    from kvcache_bench.case_step import capabilities

    rows = _rows("step")
    timed = [r for r in rows if r.kvcache_ns is not None]
    assert timed and all(r.yardstick_ratio for r in timed)
    # up to 64 sequences the baseline ran the same step (and agreed, or the case would have raised)
    assert all(r.baseline_ns for r in timed if "256 seqs" not in r.case)
    waits = [r for r in rows if r.kvcache_ns is None]
    assert bool(waits) == (capabilities().max_seqs < 256)
    assert all("256 sequences" in r.note for r in waits)


def test_the_step_checks_see_a_wrong_mask_and_wrong_cells():
    import numpy as np

    import kvcache
    from kvcache_bench.case_step import Busy, _check_step

    busy = Busy(1024, 4, 64, 2, 16, buffers=True, baseline=True)
    c, base = busy.c, busy.base
    pos = busy.next_pos.copy()
    seq = np.arange(4, dtype=np.int32)
    ub = kvcache.UBatch(pos, seq)
    assert c.find_slot(ub)
    k = [np.ones((4, 16), np.float16) for _ in range(2)]
    for il in range(2):
        c.store(il, k[il], k[il])
    c.commit()
    ptr = np.array([a.ctypes.data for a in k], dtype=np.uint64)
    ref = np.zeros((64, c.n), np.float32)
    assert base.step(pos, seq, ptr, ptr, ref)[1]
    out = c.kq_mask(ub)
    _check_step(c, base, out, ref, "f32", True, 4, c.head, 2, 32, True)
    out[1, 5] = -out[1, 5] if out[1, 5] else -np.inf
    with pytest.raises(AssertionError, match="mask differs"):
        _check_step(c, base, out, ref, "f32", True, 4, c.head, 2, 32, True)
    busy.check_cells()
    c.seq_rm(2, 0, 1)             # kvcache's side only
    with pytest.raises(AssertionError, match="disagree|different cells"):
        busy.check_cells()


def test_scale_rows_cover_every_operation_and_size(tmp_path):
    import kvcache_bench as bench
    from kvcache_bench.case_step import SCALE_OPS, plot_scale

    rows = _rows("scale")
    assert {(r.extra["op"], r.extra["cells"]) for r in rows} == {(op, n) for op in SCALE_OPS for n in (4096, 16384)}
    report = {"rows": [bench.asdict(r) for r in rows], "machine": bench.machine()}
    need_module("test", "matplotlib")
    path = tmp_path / "scale.png"
    assert plot_scale(report, str(path)) and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_2026_cases_run_todays_loop_and_wait_for_kvcaches_side():
    from kvcache_bench.case_step import capabilities

    rows = _rows("2026")
    timed = rows[:3]
    assert all(r.baseline_ns for r in timed)     # today's loop placed every token and prompt
    if not capabilities().semantics_2026:
        assert all(r.kvcache_ns is None and "semantics=\"2026\"" in r.note for r in rows)
    else:
        # prepare timed against find_slot of the same batch (which placed it where prepare said)
        preps = [r for r in rows if "prepare" in r.case]
        assert len(preps) == 2 and "evicting" in preps[1].case
        assert all(p.kvcache_ns and p.yardstick_ratio and p.yardstick == "find_slot of the same batch" for p in preps)


def test_the_2026_comparison_of_cells_and_the_cimport_loop():
    """What the 2026 cases use on kvcache's side, on a workload where both semantics place alike
    (an empty cache filled round robin)."""
    import kvcache
    from kvcache_bench import _bench
    from kvcache_bench.case_2026 import N_SEQS, _busy_ops, _same_cells

    import random

    fill, _, _ = _busy_ops(1024, random.Random(0))
    base = _bench.Baseline2026(1024, 1, N_SEQS, 1)
    base.run(fill)
    c = kvcache.UnifiedCache(1024, 1, 8, 8, n_seq_max=N_SEQS, buffers=None)
    ns, placed = _bench.cimport_find_slot_ns(c, [kvcache.UBatch(p, s) for p, s in fill])
    assert placed == len(fill) and ns > 0
    _same_cells(c, base)
    c.seq_rm(3, 5, 6)
    with pytest.raises(AssertionError, match="different"):
        _same_cells(c, base)


def test_the_serving_schedule_is_seeded_and_complete():
    from kvcache_bench.case_serving import CHUNK, schedule

    steps = schedule(4, 10, seed=3, system=256)
    assert steps == schedule(4, 10, seed=3, system=256)
    admitted, finished, computed = {}, [], {}
    for ev in steps:
        for e in ev:
            if e[0] == "admit":
                assert e[1] not in admitted
                admitted[e[1]] = e[2]
                computed[e[1]] = 0
            elif e[0] == "prefill":
                assert e[2] == computed[e[1]] and 0 < e[3] <= CHUNK
                computed[e[1]] += e[3]
            elif e[0] == "decode":
                assert e[2] == computed[e[1]] >= len(admitted[e[1]])
                assert e[4] is not None
                computed[e[1]] += 1
            else:
                finished.append(e[1])
        assert sum(1 for e in ev if e[0] in ("prefill", "decode")) <= 4   # at most n_slots running
    assert sorted(admitted) == sorted(finished) == list(range(10))
    # every prompt starts with the shared system prompt (a short one is a prefix of it)
    first = admitted[0]
    assert all(p[:min(256, len(p))] == first[:min(256, len(p))] for p in admitted.values())


def test_the_chat_schedule_continues_each_conversation():
    """A turn's prompt is an earlier turn's prompt, every token sampled for it, then a new message;
    each decode feeds the token sampled the step before."""
    from kvcache_bench.case_serving import TURNS, schedule

    steps = schedule(4, 32, seed=2, chat=True)
    assert steps == schedule(4, 32, seed=2, chat=True)
    prompts, sampled, done = {}, {}, []
    for ev in steps:
        for e in ev:
            if e[0] == "admit":
                prompts[e[1]], sampled[e[1]] = e[2], []
            elif e[0] == "prefill" and e[4] is not None:
                assert e[2] + e[3] == len(prompts[e[1]])
                sampled[e[1]].append(e[4])
            elif e[0] == "decode":
                assert e[3] == sampled[e[1]][-1]
                sampled[e[1]].append(e[4])
            elif e[0] == "finish":
                done.append(e[1])
    assert sorted(done) == list(range(32))
    firsts = 0
    for rid, p in prompts.items():
        before = [q for q in range(rid) if prompts[q] + sampled[q] == p[:len(prompts[q]) + len(sampled[q])]]
        if not before:
            firsts += 1
            assert 32 <= len(p) <= 256
        else:
            # the latest turn of the same conversation, then 16 to 128 new tokens
            q = before[-1]
            assert 16 <= len(p) - len(prompts[q]) - len(sampled[q]) <= 128
    assert firsts == 32 // TURNS


def test_the_serving_case_replays_through_kvcache_and_says_which_peers_are_missing():
    rows = [r for r in _rows("serving") if r.extra.get("serving")]
    assert {r.extra["workload"] for r in rows} == {"none", "system", "chat"}
    for r in rows:
        per = r.extra["per_step_ns"]
        assert per["kvcache"] > 0 and r.kvcache_ns == per["kvcache"]
        assert set(per) == {"kvcache"} | ({"vLLM", "SGLang"} - set(r.extra["peers_missing"]))
        if "SGLang" in per:
            assert "SGLang" in r.note
    shared = [r for r in rows if "shared system prompt" in r.case]
    assert shared and all(r.extra["prefix_hit_tokens"]["kvcache"] > 0 for r in shared)
    for r in rows:
        hits = r.extra["prefix_hit_tokens"]
        assert hits["kvcache"] <= r.extra["prompt_tokens"]
        # the prefix index finds at least what a copy from a running request found
        donor = r.extra["without_index"]
        assert (donor is None) == (r.extra["workload"] == "chat")
        if donor is not None:
            assert hits["kvcache"] >= donor["prefix_hit_tokens"]
        # and at least what SGLang's radix tree finds on the same workload and capacity
        if "SGLang" in hits:
            assert hits["kvcache"] >= hits["SGLang"], r.case
    chat = [r for r in rows if r.extra["workload"] == "chat"]
    assert chat and all(r.extra["prefix_hit_tokens"]["kvcache"] > r.extra["prompt_tokens"] // 4 for r in chat)
    import kvcache_bench as bench

    text = bench.format_table({"rows": [bench.asdict(r) for r in rows], "machine": bench.machine(),
                               "repetitions": 1, "quick": True})
    assert "| workload | steps | kvcache us/step |" in text and "kvcache without index" in text
    for peer, why in rows[0].extra["peers_missing"].items():
        assert f"{peer} not run: {why}" in text


@pytest.mark.parametrize("replay", ["replay_kvcache", "replay_kvcache_donor"])
def test_the_kvcache_replay_checks_its_bookkeeping(replay):
    from kvcache_bench import case_serving
    from kvcache_bench.case_serving import schedule

    fn = getattr(case_serving, replay)
    steps = schedule(4, 8, seed=1)
    r = fn(steps, 4, 4096, 0)
    assert len(r.cpu) == len(steps)
    # a cache too small for the workload: the replay stops instead of timing failed searches
    with pytest.raises(AssertionError, match="full"):
        fn(steps, 4, 1024, 0)


def test_the_kvcache_replay_publishes_an_unfinished_prompt_for_requests_admitted_meanwhile():
    from kvcache_bench.case_serving import replay_kvcache

    # request 1 shares the first 600 tokens of request 0's 1000-token prompt and arrives after
    # request 0's first chunk of 512: it attaches that chunk while request 0 goes on
    import numpy as np

    rng = np.random.default_rng(3)
    p0 = rng.integers(0, 32000, 1000).tolist()
    p1 = p0[:600] + rng.integers(0, 32000, 100).tolist()
    steps = [[("admit", 0, p0, 2), ("prefill", 0, 0, 512, None)],
             [("admit", 1, p1, 2), ("prefill", 0, 512, 488, 5), ("prefill", 1, 0, 512, None)],
             [("decode", 0, 1000, 5, 6), ("prefill", 1, 512, 188, 7), ("finish", 0)],
             [("decode", 1, 700, 7, 8), ("finish", 1)]]
    assert replay_kvcache(steps, 2, 4096, 0).hits == 512


def test_the_prefix_index_rows_match_whole_prompts_and_evict_what_they_ask():
    from kvcache_bench.case_serving import bench_prefix_index

    match, evict = bench_prefix_index(True, 1)
    assert match.case.startswith("prefix reuse: match + attach of a 4096-token prompt, index of 256K tokens")
    assert match.extra["index_tokens"] == {"16": 65536, "64": 262144} and match.extra["size_ratio"] > 0
    assert "index of 64K tokens" in match.note
    assert evict.case.startswith("prefix reuse: evict 16384 cells (per cell)")
    assert set(evict.extra["ns_per_cell"]) == {"4096", "16384"} and evict.extra["count_ratio"] > 0


def test_the_handoff_case_checks_every_move_and_says_which_transports_are_missing():
    import importlib.util

    rows = _rows("handoff")
    local = [r for r in rows if r.case.startswith("handoff in one process")]
    assert len(local) == 2 and all(r.baseline_ns and r.yardstick_gbps for r in local)
    # an import's bookkeeping timed against find_slot of its tokens (which took the import's cells)
    books = [r for r in rows if r.case.startswith("handoff bookkeeping")]
    assert len(books) == 2 and all(r.kvcache_ns and r.yardstick_ratio for r in books)
    for name in ("ray", "nixl"):
        if importlib.util.find_spec(name) is None:
            assert any(r.case == f"handoff through {name}" and r.note.startswith("waiting") for r in rows)


def test_the_paired_interval_holds_the_median_and_is_repeatable():
    """The interval a bench verdict is drawn from (the torch case's "no slower than"): it holds
    the paired median, the same times give the same interval, and a lower level a narrower one."""
    from kvcache_bench import _paired, _paired_interval

    a = [100 + i % 7 for i in range(25)]
    b = [98 + (i * 3) % 11 for i in range(25)]
    lo, hi = _paired_interval(a, b)
    assert lo <= _paired(a, b) <= hi and (lo, hi) == _paired_interval(a, b)
    lo50, hi50 = _paired_interval(a, b, level=0.5)
    assert lo <= lo50 <= hi50 <= hi and hi50 - lo50 < hi - lo
    assert _paired_interval([2.0] * 9, [1.0] * 9) == (2.0, 2.0)      # pairs that all agree leave no doubt


def test_the_attention_case_checks_the_indices_path_against_the_dense_mask():
    """Both paths ran the same step and agreed (the case raises otherwise), each step with its
    byte floor, its build row and the build from scratch."""
    torch = need_module("torch", "torch")
    rows = _rows("attention")
    gpu = [r for r in rows if r.case.startswith("attention (GPU)")]
    if torch.cuda.is_available() and importlib.util.find_spec("flashinfer"):
        assert len(gpu) == 3 and all(r.baseline_ns and r.ratio and r.yardstick_ratio for r in gpu)
    else:   # the GPU row says what it waits for
        assert len(gpu) == 1 and gpu[0].kvcache_ns is None and gpu[0].note.startswith("waiting: ")
    rows = [r for r in rows if r not in gpu]
    steps = [r for r in rows if "decode step" in r.case]
    builds = [r for r in rows if "build" in r.case]
    scratch = [r for r in rows if "from scratch" in r.case]
    assert len(steps) == len(builds) == len(scratch) == 3
    assert all(r.baseline_ns and r.ratio for r in builds + scratch)
    assert all(r.baseline_ns and r.yardstick_ratio and "path taken" in r.note for r in steps)


def test_the_hybrid_case_drives_the_pair_and_its_parts_alike():
    """The hybrid memory and its two parts driven apart placed the same cells and gave the same
    mask and state sources at every size (the case raises otherwise)."""
    rows = _rows("hybrid")
    assert [r.case.split(",")[1].strip() for r in rows] == ["1 seq x 1 token"] * 2 + ["32 seq x 1 token"] * 2
    assert all(r.baseline_ns and r.ratio for r in rows)


def test_the_serving_replays_count_the_same_steps_and_none_right_after_a_check():
    from kvcache_bench.case_serving import CHECK_EVERY, counted

    n = 3 * CHECK_EVERY + 5
    assert counted(n) == [i for i in range(n) if i not in (CHECK_EVERY, 2 * CHECK_EVERY, 3 * CHECK_EVERY)]
    assert counted(1) == [0]


def test_the_serving_driver_alone_runs_the_kvcache_replay_without_a_cache():
    from kvcache_bench.case_serving import replay_driver, schedule

    steps = schedule(4, 8, seed=1)
    r = replay_driver(steps, 4, 4096, 0)
    assert len(r.cpu) == len(steps) and r.hits == 0


@pytest.mark.parametrize("peer", ["vLLM", "SGLang"])
def test_a_peers_driver_alone_runs_its_replay_with_nothing_of_the_peer(peer):
    import sys

    from kvcache_bench.case_serving import replay_peer_driver, schedule

    before = {m for m in sys.modules if m.split(".")[0] in ("vllm", "sglang")}
    steps = schedule(4, 8, seed=1, system=32)
    r = replay_peer_driver(peer, steps, 4, 4096, 32)
    # every step timed, nothing found cached (no chunk skipped), no module of the peer imported
    assert len(r.cpu) == len(steps) and r.hits == 0
    assert {m for m in sys.modules if m.split(".")[0] in ("vllm", "sglang")} == before
