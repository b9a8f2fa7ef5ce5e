"""What every ``kvcache`` command does the same way: one JSON format, progress only on a terminal
unless asked for and never on stdout, errors naming the subcommand on one line without a
traceback (a matrix of bad invocations), plain messages for hostile files, words agreeing with
their numbers. The commands' own test files cover their details."""
import json
import os
import re
import subprocess
import sys
import warnings

import numpy as np
import pytest

import kvcache
from conftest import HAS_BENCH, kvcache_env, need_module, needs_bench
from interop_data import model_path
from kvcache import cli, statefile
from test_store import store_dir


def run_cli(capsys, *argv):
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def _unified_blob(tmp_path, pos=(39,)):
    c = kvcache.UnifiedCache(64, 1, 8, 8, n_seq_max=2)
    assert c.find_slot(kvcache.UBatch(list(pos), [0] * len(pos)))
    c.commit()
    path = tmp_path / "unified.bin"
    path.write_bytes(c.state_write(layout="2025"))
    return path


def _recurrent_blob(tmp_path):
    c = kvcache.RecurrentCache(n_seq_max=2, n_layer=1, n_embd_k_gqa=4, n_embd_v_gqa=4, n_embd_k_s=2, n_embd_v_s=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        assert c.find_slot(kvcache.UBatch([0, 1], [[0], [1]]))
    c.commit()
    path = tmp_path / "recurrent.bin"
    path.write_bytes(c.state_write(0, layout="2025"))   # one sequence's: its cells carry no sequence id
    return path


# --- --json ----------------------------------------------------------------------------------------

JSON_RUNS = {
    "convert": lambda tmp: ["convert", "--json", str(_unified_blob(tmp)), str(tmp / "out.bin"), "--to", "2026"],
    "demo": lambda tmp: ["demo", "--steps", "3", "--json"],
    "inspect": lambda tmp: ["inspect", "--json", str(_unified_blob(tmp))],
    "plan": lambda tmp: ["plan", "--n-layer", "2", "--n-embd-k-gqa", "64", "--n-ctx", "256", "--json"],
    "simulate": lambda tmp: ["simulate", "--steps", "20", "--n-ctx", "512", "--json"],
    "store": lambda tmp: ["store", "--json", str(store_dir(tmp))],
}


def _canonical(text: str) -> str:
    return json.dumps(json.loads(text), indent=2) + "\n"


@pytest.mark.parametrize("name", sorted(JSON_RUNS))
def test_json_output_is_one_format_and_alone_on_stdout(name, tmp_path, capsys):
    rc, out, err = run_cli(capsys, *JSON_RUNS[name](tmp_path))
    assert rc == 0
    assert out == _canonical(out)        # indented by 2, nothing else on stdout
    assert err == ""                     # no progress either: stderr is not a terminal here


@needs_bench
def test_bench_json_file_has_the_same_format(tmp_path, capsys):
    path = tmp_path / "b.json"
    rc, out, err = run_cli(capsys, "bench", "--quick", "--case", "calls", "--json", str(path))
    assert rc == 0 and err == ""
    text = path.read_text()
    assert text == _canonical(text)


def test_every_json_command_is_checked():
    has_json = {name for name, mod in cli.commands().items() if "--json" in _help(mod)}
    assert has_json == set(JSON_RUNS) | {"bench"}


def _help(mod):
    import argparse

    p = argparse.ArgumentParser()
    mod.add_arguments(p)
    return p.format_help()


# --- progress ----------------------------------------------------------------------------------------

def _on_a_terminal(argv):
    """Run kvcache with stderr on a pseudo-terminal; returns (exit status, stdout, what the terminal got)."""
    import threading

    import fcntl
    import struct
    import termios

    master, slave = os.openpty()
    # a terminal of 24 x 100 (a new one is 0 x 0, where tqdm draws a bar of no width)
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    chunks = []

    def read():
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:      # EIO: the child's side is closed
                return
            if not data:
                return
            chunks.append(data)

    reader = threading.Thread(target=read)
    reader.start()
    try:
        proc = subprocess.Popen([sys.executable, "-m", "kvcache", *argv], stdout=subprocess.PIPE, stderr=slave,
                                env=kvcache_env(), text=True)
        os.close(slave)
        out = proc.communicate(timeout=300)[0]
        reader.join(timeout=30)
    finally:
        os.close(master)
    return proc.returncode, out, b"".join(chunks).decode("utf-8", "replace")


@pytest.mark.skipif(not hasattr(os, "openpty"), reason="needs a pseudo-terminal")
def test_progress_on_a_terminal_only():
    rc, out, tty = _on_a_terminal(["simulate", "--steps", "200", "--n-ctx", "512", "--progress", "auto"])
    assert rc == 0 and "accounting" in out
    assert "simulate" in tty                           # the bar (tqdm, rich or the plain line)
    rc, out, tty = _on_a_terminal(["simulate", "--steps", "200", "--n-ctx", "512", "--json"])
    assert rc == 0 and json.loads(out) and tty == ""   # --json: no progress unless asked
    if HAS_BENCH:
        rc, out, tty = _on_a_terminal(["bench", "--quick", "--case", "calls"])
        assert rc == 0 and "bench: running calls ..." in tty and "running" not in out


def test_progress_when_asked(capsys):
    rc, out, err = run_cli(capsys, "simulate", "--steps", "20", "--n-ctx", "512", "--progress", "plain", "--json")
    assert rc == 0 and json.loads(out) and "simulate: step 20/20" in err
    rc, out, err = run_cli(capsys, "simulate", "--steps", "20", "--n-ctx", "512")
    assert rc == 0 and err == ""


# --- bench -----------------------------------------------------------------------------------------

def test_bench_checks_its_json_path_before_running(capsys, tmp_path):
    rc, out, err = run_cli(capsys, "bench", "--quick", "--json", "/nonexistent/x.json")
    assert rc == 2 and out == ""         # nothing ran
    assert err.strip().splitlines() == ["kvcache bench: error: --json /nonexistent/x.json: no such directory: "
                                        "/nonexistent"]
    rc, out, err = run_cli(capsys, "bench", "--quick", "--json", str(tmp_path))
    assert rc == 2 and out == "" and "is a directory" in err


@needs_bench
def test_bench_explains_its_columns(capsys):
    rc, out, _ = run_cli(capsys, "bench", "--help")
    assert rc == 0
    for column in ("yardstick GB/s", "kvcache/yardstick", "baseline/kvcache", "GB/s"):
        assert column in out
    rc, out, _ = run_cli(capsys, "bench", "--quick", "--case", "calls")
    assert rc == 0 and "kvcache/yardstick: kvcache's time over the yardstick's" in out


def test_bench_without_its_extension_says_how_to_get_it(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "kvcache_bench", None)   # an installation without it
    rc, out, err = run_cli(capsys, "bench", "--quick")
    assert rc == 2 and out == ""
    assert err.strip().splitlines() == [
        "kvcache bench: error: the benchmark cases (package kvcache_bench) are not installed: the kvcache wheel "
        "leaves them out; from a clone of kvcache, `pip install ./benchmarks` installs them (see benchmarks/README.md)"]


@needs_bench
def test_the_benchmark_extension_is_installed_when_expected():
    from kvcache_bench import _bench

    assert hasattr(_bench, "Workload")


# --- plan ------------------------------------------------------------------------------------------

def test_plan_of_a_model_defaults_to_its_trained_context(capsys):
    need_module("test", "gguf")
    model = str(model_path("tiny_llama.gguf"))
    trained = kvcache.read_gguf(model).n_ctx_train
    rc, out, err = run_cli(capsys, "plan", model, "--json")
    assert rc == 0 and err == "" and json.loads(out)["n_ctx"] == trained
    rc, out, err = run_cli(capsys, "plan", model, "--n-ctx", "100000", "--json")
    assert rc == 0 and json.loads(out)["n_ctx"] == 100000
    assert err.strip().splitlines() == [f"kvcache plan: warning: --n-ctx 100000 exceeds the model's trained "
                                        f"context of {trained} tokens"]
    rc, out, err = run_cli(capsys, "plan", model, "--n-ctx", str(trained))
    assert rc == 0 and err == ""


# --- inspect ---------------------------------------------------------------------------------------

def test_inspect_words_agree_with_their_numbers(capsys, tmp_path):
    rc, out, _ = run_cli(capsys, "inspect", str(_unified_blob(tmp_path)))
    assert rc == 0
    assert "cache: unified (guessed), 1 cell\n" in out and "1 cell, 1 layer," in out
    assert "seq 0: position 39\n" in out
    rc, out, _ = run_cli(capsys, "inspect", str(_unified_blob(tmp_path, pos=(3, 4))))
    assert "2 cells" in out and "seq 0: positions 3-4\n" in out


def test_inspect_refuses_a_variant_the_state_cannot_be(capsys, tmp_path):
    unified, recurrent = _unified_blob(tmp_path), _recurrent_blob(tmp_path)
    for path, variant, msg in (
            (unified, "recurrent", "not a recurrent cache state: it stores V transposed"),
            (unified, "iswa", "the SWA part is missing"),
            (recurrent, "unified", "not a unified cache state: it has cells without a sequence id"),
            (recurrent, "iswa", "not an iSWA cache state")):
        rc, out, err = run_cli(capsys, "inspect", "--variant", variant, str(path))
        assert rc == 2 and out == "", (variant, out)
        assert err.strip().splitlines() == [f"kvcache inspect: error: {path}: {err.split(': ', 3)[3].strip()}"]
        assert msg in err, (variant, err)
    for path, variant in ((unified, "unified"), (recurrent, "recurrent")):
        rc, out, err = run_cli(capsys, "inspect", "--variant", variant, "--json", str(path))
        assert rc == 0 and json.loads(out)["variant"] == variant


def test_inspect_of_a_model_points_to_plan(capsys):
    model = model_path("tiny_llama.gguf")
    rc, out, err = run_cli(capsys, "inspect", str(model))
    assert rc == 2 and out == ""
    assert err.strip() == (f"kvcache inspect: error: {model}: this is a GGUF model, not a state file: use "
                           "`kvcache plan` for the cache it needs")


def test_inspect_of_hostile_files_says_so_plainly(capsys, tmp_path):
    blob = _unified_blob(tmp_path, pos=(0, 1, 2)).read_bytes()
    seq = tmp_path / "s.ggsq"
    statefile.write_sequence_file(seq, _cache_with(blob), seq_id=0, tokens=[1, 2, 3])
    whole = seq.read_bytes()
    cases = {
        "huge cell count": b"\x88\x88\xc3\x9c" + blob[4:],
        "truncated blob": blob[:30],
        "text": b"# not a state at all\n" * 40,
        "empty": b"",
        "truncated sequence file": whole[:len(whole) - 10],
    }
    not_a_state = ("not a state file ({} bytes): it starts with no state file's magic (session file 'ggsn', sequence "
                   "file 'ggsq', 2026 sequence blob 0xaf143cd8) and does not read as a whole-context or cache state")
    for name, data in cases.items():
        p = tmp_path / name.replace(" ", "_")
        p.write_bytes(data)
        rc, out, err = run_cli(capsys, "inspect", str(p))
        assert rc == 2 and out == "", name
        lines = err.strip().splitlines()
        if name == "truncated sequence file":
            assert len(lines) == 1 and re.fullmatch(
                rf"kvcache inspect: error: {re.escape(str(p))}: a truncated sequence file: it breaks off in the part "
                rf"that starts at byte \d+ of {len(data)}", lines[0]), err
        else:
            assert lines == [f"kvcache inspect: error: {p}: {not_a_state.format(len(data))}"], (name, err)
        for internal in ("need at least", "describe_state", "remain", "while reading"):
            assert internal not in err, (name, err)


def _cache_with(blob):
    c = kvcache.UnifiedCache(64, 1, 8, 8, n_seq_max=2)
    c.state_read(blob, 0)
    return c


# --- simulate --------------------------------------------------------------------------------------

def test_simulate_plot_refuses_an_unknown_format_before_running(capsys, tmp_path):
    need_module("test", "matplotlib")
    bad = tmp_path / "x.jpgx"
    rc, out, err = run_cli(capsys, "simulate", "--steps", "5", "--plot", str(bad))
    assert rc == 2 and out == "" and not bad.exists()
    assert err.startswith(f"kvcache simulate: error: {bad}: the extension .jpgx names no image format") and \
        ".png" in err and len(err.strip().splitlines()) == 1
    rc, out, err = run_cli(capsys, "simulate", "--steps", "5", "--plot", str(tmp_path / "noext"))
    assert rc == 2 and "no extension" in err
    svg = tmp_path / "sim.svg"
    rc, out, err = run_cli(capsys, "simulate", "--steps", "5", "--plot", str(svg))
    assert rc == 0 and svg.read_text().lstrip().startswith("<?xml")


def test_simulate_and_demo_words_agree_with_their_numbers(capsys):
    rc, out, _ = run_cli(capsys, "simulate", "--steps", "1", "--n-ctx", "512", "--n-layer", "1")
    assert rc == 0 and "kvcache simulate: 1 step," in out and " 1 layer of width" in out
    rc, out, _ = run_cli(capsys, "demo", "--steps", "1")
    assert "1 step," in out and "layer(s)" not in out and " 1 steps" not in out and " 1 ubatches" not in out


# --- bad invocations -------------------------------------------------------------------------------

BAD = [
    ["plan", "--bogus"],
    ["plan", "--n-layer", "2"],
    ["plan", "--n-layer", "-1", "--n-embd-k-gqa", "8"],
    ["plan", "/nonexistent/model.gguf"],
    ["plan", "--n-layer", "2", "--n-embd-k-gqa", "8", "--type-k", "nope"],
    ["inspect"],
    ["inspect", "/nonexistent"],
    ["inspect", "/"],
    ["inspect", "--variant", "mamba", "x"],
    ["simulate", "--steps", "-5"],
    ["simulate", "--n-ctx", "99999999999999999999"],
    ["simulate", "--bogus"],
    ["simulate", "--plot", "/nonexistent/dir/x.png", "--steps", "2"],
    ["demo", "--steps", "zero"],
    ["demo", "extra"],
    ["bench", "--case", "nothing"],
    ["store"],
    ["store", "/nonexistent"],
    ["store", "/", "--gc", "lots"],
    ["store", "/", "--gc", "9" * 400],
    ["inspect", "/dev/zero"],
    ["convert", "/dev/zero", "/tmp/kvcache-never-written.bin", "--to", "2026"],
    ["convert", "/nonexistent/in.bin", "/tmp/kvcache-never-written.bin", "--to", "2026"],
    ["plan", "--n-layer", "2", "--n-embd-k-gqa", "8", "--n-ctx", "10", "--swa-layers", "0-99999999999"],
    ["simulate", "--n-embd", "2147483647", "--steps", "2"],
    ["simulate", "--n-layer", "2147483647", "--steps", "2"],
    ["simulate", "--n-ctx", "2147483647", "--steps", "2"],
    ["bench", "--json", "/nonexistent/b.json"],
    ["--bogus"],
    ["nocommand"],
    [],
]


@pytest.mark.parametrize("argv", BAD, ids=[" ".join(a) or "(none)" for a in BAD])
def test_bad_invocations_are_one_line_errors(argv, capsys):
    rc, out, err = run_cli(capsys, *argv)
    assert rc == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    known = argv and argv[0] in cli.commands()
    want = f"kvcache {argv[0]}: error: " if known else "kvcache: error: "
    assert lines[0].startswith(want), err
    assert "Traceback" not in err and "Error:" not in err     # no exception's class for a message
    assert not os.path.exists("/tmp/kvcache-never-written.bin")


def test_a_fifo_is_no_input(tmp_path):
    # opened as a file, a FIFO with no writer blocks the reader: in a process where a hang fails
    fifo = tmp_path / "in.bin"
    os.mkfifo(fifo)
    for argv in (["inspect", str(fifo)], ["convert", str(fifo), str(tmp_path / "out.bin"), "--to", "2026"]):
        r = subprocess.run([sys.executable, "-m", "kvcache", *argv], capture_output=True, text=True,
                           env=kvcache_env(), timeout=120)
        assert r.returncode == 2 and "not a regular file" in r.stderr and r.stderr.count("\n") == 1, r.stderr
    assert not (tmp_path / "out.bin").exists()


def test_bad_invocations_in_a_process():
    """The same without pytest around: no traceback reaches the terminal."""
    for argv in (["plan", "--bogus"], ["inspect", "/nonexistent"], ["simulate", "--steps", "0"]):
        r = subprocess.run([sys.executable, "-m", "kvcache", *argv], capture_output=True, text=True,
                           env=kvcache_env(), timeout=120)
        assert r.returncode == 2 and r.stdout == "" and "Traceback" not in r.stderr
        assert r.stderr.startswith(f"kvcache {argv[0]}: error: ") and r.stderr.count("\n") == 1


@needs_bench
def test_modules_run_as_programs_are_the_commands(tmp_path):
    path = _unified_blob(tmp_path)
    for mod, argv in (("kvcache.inspect", ["--json", str(path)]), ("kvcache_bench", ["--quick", "--case", "calls"])):
        r = subprocess.run([sys.executable, "-m", mod, *argv], capture_output=True, text=True, env=kvcache_env(),
                           timeout=300)
        assert r.returncode == 0, r.stderr
    r = subprocess.run([sys.executable, "-m", "kvcache.inspect", "/nonexistent"], capture_output=True, text=True,
                       env=kvcache_env(), timeout=120)
    assert r.returncode == 2 and r.stderr.startswith("kvcache inspect: error: /nonexistent: ")


# --- numeric options -------------------------------------------------------------------------------

def _numeric_options():
    """(command, option, its type) for every option of every command that takes a number."""
    import argparse

    out = []
    for name, mod in cli.commands().items():
        p = argparse.ArgumentParser()
        mod.add_arguments(p)
        for a in p._actions:
            if a.type is not None and a.option_strings:
                out.append((name, a, a.type))
    return out


def test_every_numeric_option_is_range_checked():
    """Each takes a type of kvcache.cli._argtypes, which checks its range (plan's --swa-layers
    checks each index with one); a bare int or float would let any value through."""
    for name, action, typ in _numeric_options():
        assert hasattr(typ, "bounds") or (name, action.dest) == ("plan", "swa_layers"), (name, action.option_strings)


@pytest.mark.parametrize("name,action,typ", [o for o in _numeric_options() if hasattr(o[2], "bounds")],
                         ids=lambda x: x if isinstance(x, str) else getattr(x, "dest", ""))
def test_numbers_out_of_range_name_their_option(name, action, typ, capsys):
    lo, hi = typ.bounds
    step = 1 if typ.__name__ != "number" else 0.5
    option = action.option_strings[0]
    for value, words in ((lo - step if lo is not None else None, "must be "), (hi + step if hi is not None else None,
                                                                              "must be "), ("x", "expected ")):
        if value is None:
            continue
        rc, out, err = run_cli(capsys, name, f"{option}={value}")
        assert rc == 2 and out == "", (option, value)
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"kvcache {name}: error: argument "
                                                       f"{'/'.join(action.option_strings)}: {words}"), err
