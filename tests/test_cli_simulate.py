"""kvcache simulate: the workload's accounting checked against the cache's own cells, every
failure accounted for, determinism, every option of the command, progress displays, the plot,
and bad arguments as one-line errors."""
import json
import os
import re
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import kvcache_env, need

from kvcache import cli
from kvcache.simulate import SimConfig, Simulation, format_report, simulate

ROOT = Path(__file__).resolve().parents[1]

# a small cache under pressure: find_slot fails, and each remedy (defrag, shrink, evict) is needed
PRESSURE = dict(n_ctx=256, arrival_rate=0.3, prompt_mean=20, output_mean=40, n_ubatch=64, steps=300,
                prefix_len=16, n_seq_max=8)
SMALL = ["--steps", "150", "--n-ctx", "512", "--n-seq-max", "6", "--prompt-mean", "30", "--output-mean", "20",
         "--prefix-len", "16", "--arrival-rate", "0.3", "--n-ubatch", "64", "--progress", "none"]


def run_cli(capsys, *argv):
    rc = cli.main(["simulate", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def sim_json(capsys, *argv):
    rc, out, err = run_cli(capsys, *SMALL, *argv, "--json")
    assert rc == 0, err
    return json.loads(out)


def untimed(d):
    """A report without the wall-clock figures."""
    d = dict(d)
    d.pop("seconds")
    d["summary"] = {k: v for k, v in d["summary"].items()
                    if k not in ("bookkeeping_seconds", "tokens_per_s", "find_slot_per_s", "calls_per_s")}
    return d


# --- the simulation's accounting, from the cache's own cells -------------------------------------

def check_cells(sim):
    """Every live request holds exactly its cells (plus the shared prefix), which are counted once."""
    c, cfg = sim.cache, sim.cfg
    cells = c.cells()
    used = np.flatnonzero(cells.pos != -1)
    assert len(used) == c.used
    prefix = cfg.prefix_len if cfg.sharing else 0

    def holders(s):
        return used[cells.holds(s)[used]]

    if cfg.sharing:
        p = holders(0)
        assert len(p) == prefix and sorted(cells.pos[p].tolist()) == list(range(prefix))
    own_total = 0
    for sid, r in sim.running.items():
        h = holders(sid)
        want = (prefix if r.shared else 0) + r.placed
        assert len(h) == want, (sid, len(h), want)
        # positions 0.. without gaps: the prefix (shared) then its own
        assert sorted(cells.pos[h].tolist()) == list(range(want))
        own_total += r.placed
    # cells of no live sequence would be a leak; cells of two are the shared prefix only
    live = set(sim.running) | ({0} if cfg.sharing else set())
    assert all(set(cells.seq_ids(i)) <= live for i in used)
    multi = [i for i in used if len(cells.seq_ids(i)) > 1]
    assert all(int(cells.pos[i]) < prefix for i in multi)
    assert c.used == prefix + own_total


@pytest.mark.parametrize("defrag", ["sched", "direct", "off"])
def test_accounting_every_step(defrag):
    seen = []
    sim = None

    def each(step, rep):
        if step % 7 == 0:
            check_cells(sim)
            seen.append(step)

    sim = Simulation(SimConfig(**PRESSURE, defrag=defrag), each)
    rep = sim.run()
    check_cells(sim)
    assert len(seen) == 300 // 7
    a = rep.accounting
    assert a["ok"] and a["mismatched_steps"] == 0 and a["cells_used"] == a["expected"] == sim.cache.used
    # no find_slot failure goes unaccounted: each got one remedy
    assert rep.find_slot_failures == sum(rep.failure_actions.values()) == a["failures_resolved"]
    assert all(v > 0 for v in rep.failure_actions.values()), rep.failure_actions
    # every find_slot either failed (and was remedied) or was committed
    assert rep.calls["find_slot"] == rep.find_slot_failures + rep.calls["commit"]
    # every request that arrived is in exactly one place
    assert rep.arrived == rep.rejected + rep.served + rep.running_at_end + rep.waiting_at_end
    assert rep.evicted == rep.failure_actions["evict"]
    assert rep.tokens_placed == rep.prefill_tokens + rep.decode_tokens == sum(rep.series["tokens"])
    assert rep.defrags >= rep.failure_actions["defrag"]


def test_without_sharing_every_slot_is_a_request():
    sim = Simulation(SimConfig(**{**PRESSURE, "prefix_len": 0}), None)
    rep = sim.run()
    check_cells(sim)
    assert rep.admitted_shared == 0 and rep.calls["seq_cp"] == 0
    assert rep.accounting["ok"]
    assert max(rep.series["running"]) == 8        # seq 0 serves requests too


def test_shared_prefix_is_copied_not_recomputed():
    rep = simulate(SimConfig(**{**PRESSURE, "prefix_share": 1.0}))
    assert rep.admitted_shared == rep.admitted == rep.calls["seq_cp"] > 0
    assert rep.prefix_tokens_reused == 16 * rep.admitted


def test_sched_follows_the_2048_cell_rule():
    # llama.cpp's defrag_sched never asks for a defrag below 2048 cells: only failures defragment
    small = simulate(SimConfig(**PRESSURE, defrag="sched"))
    assert small.calls["update"] == 0 and small.defrags == small.failure_actions["defrag"]
    big = simulate(SimConfig(n_ctx=4096, steps=400, arrival_rate=0.2, defrag="sched"))
    assert big.calls["update"] > 0 and big.defrags > big.failure_actions["defrag"]
    direct = simulate(SimConfig(**PRESSURE, defrag="direct"))
    assert direct.defrags > direct.failure_actions["defrag"]
    off = simulate(SimConfig(**PRESSURE, defrag="off"))
    assert off.defrags == off.failure_actions["defrag"] and off.calls["defrag_sched"] == 0


def test_fragmentation_formula():
    sim = Simulation(SimConfig(**PRESSURE), None)
    rep = sim.run()
    c = sim.cache
    assert rep.series["fragmentation"][-1] == pytest.approx(max(0.0, 1 - (c.used + c.n_pad) / c.n))
    assert rep.series["occupancy"][-1] == c.used / c.size
    assert all(0 <= f < 1 for f in rep.series["fragmentation"])


def test_deterministic():
    a = simulate(SimConfig(**PRESSURE, seed=3)).to_dict(series=True)
    b = simulate(SimConfig(**PRESSURE, seed=3)).to_dict(series=True)
    c = simulate(SimConfig(**PRESSURE, seed=4)).to_dict(series=True)
    assert untimed(a) == untimed(b)
    assert untimed(a) != untimed(c)


# --- the command ---------------------------------------------------------------------------------

def test_text_report(capsys):
    rc, out, err = run_cli(capsys, *SMALL)
    assert rc == 0 and err == ""
    for s in ("requests", "bookkeeping", "tokens placed/s", "find_slot", "occupancy (used / cells): mean",
              "fragmentation: mean", "defrag (sched, threshold 0.1)", "find_slot failures",
              "accounting", ": ok (checked every step, 0 mismatched)"):
        assert s in out, s
    assert "llama.cpp's defrag_sched" in out


def test_json_report(capsys):
    d = sim_json(capsys)
    assert d["accounting"]["ok"] is True
    assert d["config"]["steps"] == 150 and d["kv_size"] == 512 and d["n_pad"] == 32
    s = d["summary"]
    assert s["tokens_per_s"] > 0 and s["find_slot_per_s"] > 0
    assert 0 < s["occupancy_mean"] <= s["occupancy_max"] <= 1
    assert 0 <= s["fragmentation_mean"] <= s["fragmentation_max"] < 1
    assert "series" not in d and d["fragmentation_formula"].startswith("max(0, 1 - (used + n_pad) / n)")
    assert d["find_slot_failures"] == sum(d["failure_actions"].values())
    assert d["served"] > 0 and d["latency_steps"]["end_to_end"]["n"] == d["served"]
    d2 = sim_json(capsys, "--series")
    assert len(d2["series"]["occupancy"]) == len(d2["series"]["fragmentation"]) == 150
    assert untimed({**d2, "series": None}) == untimed({**d, "series": None})


def test_options(capsys):
    d = sim_json(capsys, "--defrag", "direct", "--defrag-thold", "0.05", "--mask", "--dist", "uniform",
                 "--seed", "9", "--n-layer", "2", "--n-embd", "32", "--type-k", "q8_0", "--type-v", "q8_0", "-fa",
                 "--prefix-share", "1")
    cfg = d["config"]
    assert (cfg["defrag"], cfg["defrag_thold"], cfg["mask"], cfg["dist"], cfg["seed"]) == \
        ("direct", 0.05, True, "uniform", 9)
    assert d["n_pad"] == 256 and d["kv_size"] == 512
    assert d["calls"]["kq_mask"] == d["calls"]["commit"] - 1 > 0
    assert d["admitted_shared"] == d["admitted"]
    d = sim_json(capsys, "--dist", "fixed", "--prefix-len", "0", "--defrag", "off", "--ctx", "300",
                 "--parallel", "3")
    assert d["kv_size"] == 320 and d["config"]["n_seq_max"] == 3 and d["admitted_shared"] == 0
    assert d["calls"]["defrag_sched"] == 0
    d = sim_json(capsys, "--defrag-thold", "-1", "--defrag", "direct", "--arrival-rate", "0")
    assert d["arrived"] == 0 and d["tokens_placed"] == 0 and d["defrags"] == 0


def test_help(capsys):
    assert cli.main(["simulate", "--help"]) == 0
    out = capsys.readouterr().out
    for opt in ("--arrival-rate", "--prefix-share", "--n-ubatch", "--defrag", "--plot", "--progress", "--json"):
        assert opt in out


def _importable(name):
    try:
        __import__(name)
    except ImportError:
        return False
    return True


def test_progress_plain(capsys):
    rc, out, err = run_cli(capsys, *SMALL[:-2], "--progress", "plain")
    assert rc == 0
    lines = err.strip().splitlines()
    assert len(lines) == 10
    assert lines[-1].startswith("simulate: step 150/150  occupancy ")
    assert "accounting" in out


@pytest.mark.parametrize("kind", ["tqdm", "rich"])
def test_progress_bars(capsys, kind):
    if not _importable(kind):
        rc, out, err = run_cli(capsys, *SMALL[:-2], "--progress", kind)
        assert rc == 2 and f"{kind} is not installed" in err and len(err.strip().splitlines()) == 1
        return
    rc, out, err = run_cli(capsys, *SMALL[:-2], "--progress", kind, "--json")
    assert rc == 0
    json.loads(out)           # the bar stays on stderr
    assert "simulate: step" not in err          # not the plain fallback
    if kind == "tqdm":
        assert "simulate:" in err and "step" in err
    # (rich draws nothing when stderr is not a terminal)


def test_progress_auto(capsys):
    # stderr is no terminal here: no progress, with or without --json (test_cli_conventions.py
    # runs it on a terminal)
    for extra in ([], ["--json"]):
        rc, out, err = run_cli(capsys, *SMALL[:-2], *extra)
        assert rc == 0 and err == ""


def _png_size(path):
    data = Path(path).read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert data[12:16] == b"IHDR" and data[-8:-4] == b"IEND"
    return struct.unpack(">II", data[16:24])


def test_plot(capsys, tmp_path):
    if not _importable("matplotlib"):
        need("test", "matplotlib is not installed")
    png = tmp_path / "sim.png"
    rc, out, err = run_cli(capsys, *SMALL, "--plot", str(png))
    assert rc == 0, err
    assert f"plot: {png}" in out
    w, h = _png_size(png)
    assert w > 100 and h > 100


def test_plot_without_matplotlib(capsys, tmp_path, monkeypatch):
    # an interpreter without matplotlib: importing it fails
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    png = tmp_path / "sim.png"
    rc, out, err = run_cli(capsys, *SMALL, "--plot", str(png))
    assert rc == 2 and out == "" and not png.exists()
    assert err.strip().splitlines() == ["kvcache simulate: error: --plot needs matplotlib, which is not installed "
                                        "(pip install 'kvcache[plot]')"]


def test_plot_into_missing_folder(capsys, tmp_path):
    if not _importable("matplotlib"):
        need("test", "matplotlib is not installed")
    rc, out, err = run_cli(capsys, *SMALL, "--plot", str(tmp_path / "no" / "sim.png"))
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "no such directory" in err


BAD = [
    (["--steps", "0"], "at least 1"),
    (["--steps", "x"], "whole number"),
    (["--arrival-rate", "-1"], ">= 0"),
    (["--arrival-rate", "inf"], "finite"),
    (["--arrival-rate", "1e9"], "at most 1000000 are simulated"),
    (["--arrival-rate", "2e5", "--steps", "6"], "at most 1000000 are simulated"),
    (["--prefix-share", "1.5"], "[0, 1]"),
    (["--prefix-len", "-3"], ">= 0"),
    (["--prefix-len", "600", "--n-ctx", "512"], "leaves no room"),
    (["--n-seq-max", "257"], "argument --n-seq-max/--parallel: must be at most 256, got 257"),
    (["--n-seq-max", "1"], "prefix sharing needs --n-seq-max >= 2"),
    (["--n-ubatch", "1024", "--n-ctx", "512"], "more than the cache's 512 cells"),
    (["--type-k", "q2_k"], "unknown type"),
    (["--type-v", "q8_0"], "--type-v q8_0: expected a type of one element per block without --flash-attn"),
    (["--dist", "normal"], "invalid choice"),
    (["--defrag", "always"], "invalid choice"),
    (["--defrag-thold", "nan"], "finite"),
    (["--seed", "-1"], ">= 0"),
    (["--series"], "--series goes with --json"),
    (["--progress", "fancy"], "invalid choice"),
]


@pytest.mark.parametrize("argv,msg", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_arguments(capsys, argv, msg):
    rc, out, err = run_cli(capsys, "--steps", "5", "--progress", "none", *argv)
    assert rc == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and re.match(r"kvcache simulate: error: ", lines[0]), err
    assert msg in lines[0]


def test_subprocess(tmp_path):
    env = kvcache_env()
    args = [sys.executable, "-m", "kvcache", "simulate", *SMALL, "--json"]
    r = subprocess.run(args, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["accounting"]["ok"] is True
    # the same seed in another process: the same report
    r2 = subprocess.run(args, capture_output=True, text=True, env=env, timeout=300)
    assert untimed(json.loads(r2.stdout)) == untimed(d)
    r = subprocess.run([sys.executable, "-m", "kvcache", "simulate", "--steps", "0"], capture_output=True,
                       text=True, env=env, timeout=120)
    assert r.returncode == 2 and r.stdout == "" and len(r.stderr.strip().splitlines()) == 1
    assert "Traceback" not in r.stderr


def test_semantics_2026_places_scattered_without_defrag():
    """Today's cache: placements are final (no commit), nothing is defragmented, and a failed
    find_slot means too few free cells (never "defragmented and retried")."""
    cfg = {**PRESSURE, "semantics": "2026"}
    sim = Simulation(SimConfig(**cfg), None)
    rep = sim.run()
    check_cells(sim)
    a = rep.accounting
    assert a["ok"] and a["mismatched_steps"] == 0 and a["cells_used"] == sim.cache.used
    assert sim.cache.semantics == "2026" and rep.n_pad == 1 and rep.kv_size % 256 == 0
    assert rep.calls["commit"] == 0 and rep.defrags == 0 and rep.cells_moved == 0
    assert rep.failure_actions["defrag"] == 0
    assert rep.find_slot_failures == sum(rep.failure_actions.values()) > 0
    old = simulate(SimConfig(**{**PRESSURE, "n_ctx": rep.kv_size}))
    assert old.defrags > 0 and rep.find_slot_failures <= old.find_slot_failures
    assert "semantics 2026" in format_report(rep) and "defrag: none" in format_report(rep)
    with pytest.raises(ValueError, match="semantics"):
        SimConfig(**{**PRESSURE, "semantics": "2024"}).check()


# --- prefix reuse: the chat and system workloads --------------------------------------------------

CHAT = dict(workload="chat", n_ctx=2048, n_seq_max=8, arrival_rate=0.05, prompt_mean=40, output_mean=20,
            turns=4, think_steps=5, n_ubatch=128, steps=400)
SYSTEM = dict(workload="system", n_ctx=1024, n_seq_max=8, arrival_rate=0.3, prompt_mean=30, output_mean=20,
              prefix_len=64, prefix_share=0.8, n_ubatch=128, steps=300)


def check_reuse_cells(sim):
    """Every live request holds exactly positions 0 .. placed - 1; a cell of two sequences lies in
    prefixes both attached from the index; cells only the index holds are in no sequence, and
    the index agrees with the cells."""
    c = sim.cache
    cells = c.cells()
    used = np.flatnonzero(cells.pos != -1)
    assert len(used) == c.used == sim.expected_used()
    for sid, r in sim.running.items():
        h = used[cells.holds(sid)[used]]
        assert sorted(cells.pos[h].tolist()) == list(range(r.placed)), sid
    assert all(set(cells.seq_ids(i)) <= set(sim.running) for i in used)
    for i in used:
        ids = cells.seq_ids(i)
        if len(ids) > 1:
            assert all(int(cells.pos[i]) < sim.running[s].attached for s in ids)
    c._prefix_check()


@pytest.mark.parametrize("cfg", [CHAT, SYSTEM], ids=["chat", "system"])
def test_reuse_workloads_keep_the_accounting_every_step(cfg):
    sim = None

    def each(step, rep):
        if step % 5 == 0:
            check_reuse_cells(sim)

    sim = Simulation(SimConfig(**cfg), each)
    assert sim.cache.semantics == "2026" and sim.cache.prefix_reuse
    rep = sim.run()
    check_reuse_cells(sim)
    assert rep.accounting["ok"] and rep.reuse["index_ok"]
    assert rep.arrived == rep.rejected + rep.served + rep.running_at_end + rep.waiting_at_end
    assert 0 < rep.prefix_tokens_reused < rep.prompt_tokens and 0 < rep.admitted_shared <= rep.admitted
    assert rep.calls["prefix_attach"] == rep.admitted_shared and rep.calls["prefix_release"] == rep.served
    assert rep.calls["seq_rm"] == rep.evicted and rep.calls["seq_cp"] == 0
    assert rep.summary()["prefix_hit_rate"] == rep.prefix_tokens_reused / rep.prompt_tokens
    assert rep.reuse["held_at_end"] == sim.cache.prefix_stats["cells"]


def test_chat_turns_find_the_conversation_so_far():
    rep = simulate(SimConfig(**CHAT))
    w = rep.without_reuse
    assert rep.conversations > 0 and rep.served > rep.conversations    # later turns ran
    # later turns reuse most of their prompt; without reuse every prompt token is computed
    assert rep.summary()["prefix_hit_rate"] > 0.4
    assert w["accounting_ok"] and w["prefill_tokens"] > 1.5 * rep.prefill_tokens
    assert w["served"] > 0 and w["prompt_tokens"] > 0
    text = format_report(rep)
    for s in ("workload: chat", "prefix reuse", "hit rate", "without reuse (the same requests)", "conversations"):
        assert s in text, s


def test_system_prompt_is_found_in_the_index():
    rep = simulate(SimConfig(**SYSTEM))
    # the first requests compute it; once one finished, the others attach it
    assert rep.prefix_tokens_reused >= 64 * (rep.admitted_shared - 1) > 0
    assert rep.without_reuse["prefill_tokens"] > rep.prefill_tokens
    # the same requests without reuse: no index, no hits
    off = simulate(SimConfig(**SYSTEM, reuse=False))
    assert off.reuse == {} and off.without_reuse == {} and off.prefix_tokens_reused == 0
    assert off.calls["prefix_match"] == off.calls["prefix_release"] == 0
    assert off.prefill_tokens == rep.without_reuse["prefill_tokens"]


def test_reuse_workloads_are_deterministic():
    a = simulate(SimConfig(**CHAT, seed=5)).to_dict()
    b = simulate(SimConfig(**CHAT, seed=5)).to_dict()
    for d in (a, b):
        d["without_reuse"].pop("bookkeeping_seconds")
    assert untimed(a) == untimed(b)


def test_reuse_workloads_from_the_command_line(capsys):
    argv = ["--workload", "chat", "--steps", "200", "--n-ctx", "2048", "--n-seq-max", "8", "--arrival-rate", "0.05",
            "--prompt-mean", "40", "--output-mean", "20", "--turns", "3", "--think-steps", "0", "--progress", "none"]
    rc, out, err = run_cli(capsys, *argv)
    assert rc == 0 and err == "" and "prefix reuse" in out and "semantics 2026" in out
    rc, out, err = run_cli(capsys, *argv, "--json")
    d = json.loads(out)
    assert d["config"]["semantics"] == "2026" and d["config"]["turns"] == 3 and d["config"]["think_steps"] == 0
    assert d["summary"]["prefix_hit_rate"] > 0 and d["without_reuse"]["accounting_ok"] is True
    rc, out, err = run_cli(capsys, *argv, "--no-reuse", "--json")
    d = json.loads(out)
    assert rc == 0 and d["config"]["reuse"] is False and d["reuse"] == {} and d["prefix_tokens_reused"] == 0
    rc, out, err = run_cli(capsys, *argv, "--progress", "plain")
    assert rc == 0 and "step 400/400" in err
    rc, out, err = run_cli(capsys, "--workload", "system", "--steps", "50", "--progress", "none", "--json")
    assert rc == 0 and json.loads(out)["config"]["workload"] == "system"


REUSE_BAD = [
    (["--workload", "chat", "--semantics", "2025"], "semantics must be '2026'"),
    (["--workload", "sharing"], "invalid choice"),
    (["--turns", "0"], "at least 1"),
    (["--think-steps", "-1"], ">= 0"),
    (["--workload", "system", "--prefix-len", "600", "--n-ctx", "512"], "leaves no room"),
]


@pytest.mark.parametrize("argv,msg", REUSE_BAD, ids=[" ".join(a) for a, _ in REUSE_BAD])
def test_bad_reuse_arguments(capsys, argv, msg):
    rc, out, err = run_cli(capsys, "--steps", "5", "--progress", "none", *argv)
    assert rc == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and msg in lines[0], err
