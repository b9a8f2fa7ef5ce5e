"""The ``kvcache`` command as a whole: every subcommand is listed, has --help, and runs (a short
invocation of each here; the commands' own test files go into their details), and ``bench`` —
which has no test file of its own — is checked in depth."""
import json
import subprocess
import sys

import pytest

import kvcache
from conftest import kvcache_env, need_module, needs_bench
from kvcache import cli
from test_store import store_dir


def _state_file(tmp_path):
    cache = kvcache.UnifiedCache(64, 1, 8, 8, n_seq_max=2)
    assert cache.find_slot(kvcache.UBatch([0, 1, 2], [0, 0, 1]))
    cache.commit()
    path = tmp_path / "cache.bin"
    path.write_bytes(cache.state_write())
    return path


# one short, complete run of every command (the JSON output where there is one)
RUNS = {
    "bench": lambda tmp: ["bench", "--quick", "--case", "find_slot", "--json", str(tmp / "bench.json")],
    "convert": lambda tmp: ["convert", "--json", str(_state_file(tmp)), str(tmp / "out.bin"), "--to", "2025"],
    "demo": lambda tmp: ["demo", "--steps", "4", "--json"],
    "inspect": lambda tmp: ["inspect", "--json", str(_state_file(tmp))],
    "plan": lambda tmp: ["plan", "--n-layer", "2", "--n-embd-k-gqa", "64", "--n-ctx", "256", "--json"],
    "simulate": lambda tmp: ["simulate", "--steps", "30", "--n-ctx", "512", "--progress", "none", "--json"],
    "store": lambda tmp: ["store", "--json", str(store_dir(tmp))],
}


def test_every_command_has_a_run_here():
    assert set(RUNS) == set(cli.commands()), "a command was added or removed: give it a run in RUNS"


def test_help_lists_every_command(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    for name, mod in cli.commands().items():
        assert name in out and mod.HELP.split()[0] in out


@pytest.mark.parametrize("name", sorted(RUNS))
def test_command_help(name, capsys):
    assert cli.main([name, "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: kvcache {name}") and "--help" in out


@pytest.mark.parametrize("name", [pytest.param(n, marks=needs_bench) if n == "bench" else n for n in sorted(RUNS)])
def test_command_runs(name, tmp_path, capsys):
    assert cli.main(RUNS[name](tmp_path)) == 0
    out = capsys.readouterr().out
    if name != "bench":     # bench prints its table and writes the JSON file
        assert isinstance(json.loads(out), dict)


def test_version(capsys):
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"kvcache {kvcache.__version__}"


def test_no_command_is_a_one_line_error(capsys):
    assert cli.main([]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "a command is required" in err


# --- bench ----------------------------------------------------------------------------------------

@needs_bench
def test_bench_report(tmp_path, capsys):
    path = tmp_path / "bench.json"
    assert cli.main(["bench", "--quick", "--case", "find_slot", "--case", "calls", "--json", str(path),
                     "--progress"]) == 0
    out, err = capsys.readouterr()
    # the progress goes to stderr, the table to stdout
    assert err.splitlines() == ["bench: running find_slot ...", "bench: running calls ..."]
    assert "running" not in out
    assert "| case | kvcache (median, min-max) |" in out and "Machine:" in out
    assert "kvcache/yardstick: kvcache's time over the yardstick's" in out
    rep = json.loads(path.read_text())
    assert rep["quick"] is True and rep["repetitions"] == 3
    rows = rep["rows"]
    assert rows and all(r["kvcache_ns"] > 0 for r in rows)
    lo_hi = [r["kvcache_range"] for r in rows]
    assert all(lo <= r["kvcache_ns"] <= hi for r, (lo, hi) in zip(rows, lo_hi))
    # the find_slot cases ran the baseline too (and the two agreed, or bench would have raised)
    assert any(r["case"].startswith("find_slot") and r["baseline_ns"] and r["ratio"] for r in rows)


@needs_bench
def test_bench_every_case_is_offered():
    from kvcache_bench import CASES

    assert set(CASES) == {"find_slot", "mask", "defrag", "state", "calls", "step", "scale", "2026", "serving", "torch", "handoff",
                           "attention", "hybrid", "store", "store_llama"}


@pytest.mark.parametrize("argv", [["bench", "--case", "nope"], ["bench", "--bogus"]])
def test_bench_usage_errors(argv, capsys):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "error" in err and "Traceback" not in err


@needs_bench
def test_bench_as_a_program(tmp_path):
    res = subprocess.run([sys.executable, "-m", "kvcache", "bench", "--quick", "--case", "calls"], cwd=tmp_path,
                         env=kvcache_env(), capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    # both kinds of calls were measured: from Python and from Cython through the cimport API
    for row in ("Python call: seq_pos_max", "Python call: seq_rm of an absent range",
                "Cython cimport call: seq_pos_max_c", "Cython cimport call: seq_rm_c of an absent range"):
        assert row in res.stdout, res.stdout


@needs_bench
def test_bench_plot_draws_the_scale_curves(tmp_path, capsys):
    need_module("test", "matplotlib")
    path = tmp_path / "scale.png"
    assert cli.main(["bench", "--quick", "--case", "scale", "--plot", str(path)]) == 0
    assert "scale: seq_rm of a finished request, 16384 cells" in capsys.readouterr().out
    assert path.read_bytes()[:4] == b"\x89PNG"


def test_bench_plot_needs_the_scale_case(tmp_path, capsys):
    assert cli.main(["bench", "--quick", "--case", "calls", "--plot", str(tmp_path / "x.png")]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "--plot draws the scale case: add --case scale" in err
    assert cli.main(["bench", "--quick", "--plot", "/nonexistent/x.png"]) == 2
    assert "--plot /nonexistent/x.png: no such directory" in capsys.readouterr().err
