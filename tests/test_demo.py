"""kvcache demo: the toy model, the command line, and the demo's check (which must be able to fail)."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import kvcache_env

import kvcache
from kvcache import cli
from kvcache.demo import RunConfig, ToyModel, iswa_model, reuse_run, run, run_demo

# seed 0 reaches a finished sequence, a shared prefix and a defrag within this many steps
STEPS = 20

# --- the toy model and its from-scratch reference (no cache involved) -----------------------

def test_rope_depends_on_relative_position_only():
    m = ToyModel(3)
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, m.n_embd)).astype(np.float32)
    k = rng.standard_normal((1, m.n_embd)).astype(np.float32)
    dots = [float(np.sum(m.rope(q, np.array([p + 7])) * m.rope(k, np.array([p])))) for p in (0, 5, 40)]
    assert dots == pytest.approx([dots[0]] * 3, rel=1e-5)
    # and it does depend on the distance
    assert float(np.sum(m.rope(q, np.array([8])) * m.rope(k, np.array([0])))) != pytest.approx(dots[0], rel=1e-3)


def test_reference_is_causal():
    m = ToyModel(1)
    tokens = np.random.default_rng(1).integers(0, m.n_vocab, 17).tolist()
    full = m.forward(tokens)
    part = m.forward(tokens[:9])
    assert len(full) == m.n_layer + 1
    for a, b in zip(full, part):
        np.testing.assert_allclose(a[:9], b, atol=1e-6)
    # a later token changes its own row
    other = m.forward(tokens[:8] + [(tokens[8] + 1) % m.n_vocab])
    assert np.max(np.abs(other[-1][8] - part[-1][8])) > 1e-3


def test_gqa_heads_share_kv():
    m = ToyModel(2)
    rng = np.random.default_rng(2)
    q = rng.standard_normal((3, m.n_embd)).astype(np.float32)
    k = rng.standard_normal((5, m.n_embd_kv)).astype(np.float32)
    v = rng.standard_normal((5, m.n_embd_kv)).astype(np.float32)
    mask = np.zeros((3, 5), np.float32)
    mask[0, 2:] = -np.inf
    out = m.attend(q, k, v, mask)
    d, g = m.head_dim, m.n_head // m.n_head_kv
    for h in range(m.n_head):
        kh = k[:, (h // g) * d:(h // g + 1) * d]
        vh = v[:, (h // g) * d:(h // g + 1) * d]
        s = q[:, h * d:(h + 1) * d] @ kh.T / np.sqrt(d) + mask
        p = np.exp(s - s.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        np.testing.assert_allclose(out[:, h * d:(h + 1) * d], p @ vh, atol=1e-5)


# --- the command line ----------------------------------------------------------------------

def test_help(capsys):
    assert cli.main(["--help"]) == 0
    assert "demo" in capsys.readouterr().out
    assert cli.main(["demo", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--steps" in out and "--seed" in out and "--json" in out


@pytest.mark.parametrize("argv", [[], ["nope"], ["demo", "--steps", "0"], ["demo", "--steps", "x"],
                                  ["demo", "--seed", "-1"], ["demo", "--bogus"]])
def test_usage_errors_are_one_line(argv, capsys):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert "error" in err and "Traceback" not in err


# --- the demo against the real cache -------------------------------------------------------

def test_demo_in_process(capsys):
    assert cli.main(["demo", "--steps", str(STEPS)]) == 0
    out = capsys.readouterr().out
    assert "result: ok" in out
    assert "f32 K/V, V transposed" in out and "f16 K/V, V rows" in out
    assert "iSWA (window 8 on layers [0]" in out and "SWA cache:" in out
    assert "prefix reuse (today's cache, f32 K/V): 9 chat turns" in out


def test_demo_json_report(capsys):
    assert cli.main(["demo", "--steps", str(STEPS), "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["ok"] is True and rep["seed"] == 0
    main, second, iswa = rep["runs"]
    assert (main["type_kv"], main["v_trans"], second["type_kv"], second["v_trans"]) == ("f32", True, "f16", False)
    assert main["swa"] is None and second["swa"] is None
    assert iswa["ok"] is True and iswa["tol"] == 1e-4 and iswa["steps"] == STEPS and iswa["mismatches"] == 0
    assert iswa["swa"]["n_swa"] == 8 and iswa["swa"]["swa_layers"] == [0]
    assert 0 < iswa["swa"]["max_used_swa"] <= iswa["swa"]["size_swa"] < iswa["cache_size"]
    assert main["steps"] == STEPS and main["tol"] == 1e-4
    assert main["max_abs_err"] < 1e-4 and main["mismatches"] == 0 and main["cache_errors"] == []
    # the workload exercised what the demo is about
    assert main["finished"] > 0 and main["shared_prefixes"] > 0 and main["defrags"] > 0
    assert main["tokens"] > main["steps"] and main["sequences"] > main["finished"] - 1
    assert 0 < main["cache_used"] <= main["cache_size"] and 0 < main["occupancy"] <= 1
    reuse = rep["reuse"]
    assert reuse["ok"] is True and reuse["tol"] == 1e-6 and reuse["max_abs_err"] <= 1e-6
    assert reuse["turns"] == 9 and 0 < reuse["reused_tokens"] < reuse["prompt_tokens"]


def test_demo_is_deterministic():
    a = run_demo(seed=4, steps=8).to_dict()
    b = run_demo(seed=4, steps=8).to_dict()
    assert a == b


def test_python_m_kvcache_demo():
    env = kvcache_env()
    r = subprocess.run([sys.executable, "-m", "kvcache", "demo", "--steps", "6", "--seed", "2"],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr
    assert "result: ok" in r.stdout
    r = subprocess.run([sys.executable, "-m", "kvcache", "demo", "--steps", "nan"],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1


def test_fragmented_cache_is_compacted_when_find_slot_fails():
    # no periodic defrag and big ubatches: a slot search fails among the holes, a defrag makes
    # room, and the attention is still exact afterwards
    rep = run(ToyModel(0), RunConfig(steps=60, defrag_thold=1.0, n_ubatch=48), 0)
    assert rep.ok, rep.to_dict()
    assert rep.slot_retries > 0 and rep.defrags >= rep.slot_retries and rep.cells_moved > 0


# --- sliding-window layers through ISWACache ----------------------------------------------

def test_reference_window():
    plain, swa = ToyModel(5), iswa_model(5)
    assert swa.swa_layers == (0,) and swa.n_swa == 8
    tokens = np.random.default_rng(5).integers(0, swa.n_vocab, 20).tolist()
    a, b = plain.forward(tokens), swa.forward(tokens)
    # up to n_swa tokens nothing is out of the window; after that layer 0 differs
    np.testing.assert_array_equal(a[0][:8], b[0][:8])
    assert np.max(np.abs(a[0][8:] - b[0][8:])) > 1e-3
    # a token far enough back changes nothing of layer 0 at the last position
    other = swa.forward([(tokens[0] + 1) % swa.n_vocab] + tokens[1:])
    np.testing.assert_allclose(other[0][-1], b[0][-1], atol=1e-6)
    assert np.max(np.abs(other[1][-1] - b[1][-1])) > 1e-4   # layer 1 sees it (full attention)


def test_iswa_run_matches_recomputation():
    rep = run(iswa_model(0), RunConfig(steps=STEPS, iswa=True), 2)
    assert rep.ok, rep.to_dict()
    assert rep.max_abs_err < 1e-4 and rep.finished > 0 and rep.defrags > 0
    # the SWA cache was pruned: it holds fewer cells than the base cache
    assert rep.swa["used_swa"] < rep.cache_used


def test_iswa_run_needs_a_window_model():
    with pytest.raises(ValueError):
        run(ToyModel(0), RunConfig(steps=2, iswa=True), 0)
    with pytest.raises(ValueError):
        run(iswa_model(0), RunConfig(steps=2), 0)


# --- the check can fail --------------------------------------------------------------------

def _corrupt_k(step_at):
    def tamper(c, step, il):
        if step == step_at and il == 0:
            k = c.k(il)
            k[c.head] += np.asarray(1.0, dtype=k.dtype)   # the row of the first token just stored
    return tamper


def _corrupt_v(step_at):
    def tamper(c, step, il):
        if step == step_at and il == 1:
            v = c.v(il)
            v[:, c.head + 1] *= -1   # V is transposed: one column is one cell
    return tamper


def test_corrupted_k_row_is_detected():
    rep = run(ToyModel(0), RunConfig(steps=8), 0, tamper=_corrupt_k(3))
    assert not rep.ok and rep.mismatches > 0
    assert rep.first_mismatch["step"] == 3 and rep.max_abs_err > 1e-2
    # the same run untampered passes
    assert run(ToyModel(0), RunConfig(steps=8), 0).ok


def test_corrupted_v_column_is_detected():
    rep = run(ToyModel(0), RunConfig(steps=8), 0, tamper=_corrupt_v(5))
    assert not rep.ok and rep.first_mismatch["step"] == 5


def _corrupt_swa_k(step_at):
    def tamper(c, step, il):
        if step == step_at and il in c.swa_layers:
            k = c.k(il)
            k[c.swa.head] += np.asarray(1.0, dtype=k.dtype)   # the SWA cache row just stored
    return tamper


def test_corrupted_swa_k_row_is_detected():
    rep = run(iswa_model(0), RunConfig(steps=8, iswa=True), 2, tamper=_corrupt_swa_k(4))
    assert not rep.ok and rep.mismatches > 0
    assert rep.first_mismatch["step"] == 4 and rep.max_abs_err > 1e-2
    assert run(iswa_model(0), RunConfig(steps=8, iswa=True), 2).ok


def test_demo_exit_status_on_iswa_mismatch(monkeypatch, capsys):
    import kvcache.demo as demo
    real = demo.run_demo
    monkeypatch.setattr(demo, "run_demo", lambda **kw: real(iswa_tamper=_corrupt_swa_k(3), **kw))
    assert cli.main(["demo", "--steps", "6", "--json"]) == 1
    rep = json.loads(capsys.readouterr().out)
    assert rep["ok"] is False and [r["ok"] for r in rep["runs"]] == [True, True, False]


def test_demo_exit_status_on_mismatch(monkeypatch, capsys):
    import kvcache.demo as demo
    real = demo.run_demo
    monkeypatch.setattr(demo, "run_demo", lambda **kw: real(tamper=_corrupt_k(2), **kw))
    assert cli.main(["demo", "--steps", "6"]) == 1
    assert "MISMATCH" in capsys.readouterr().out


def test_reused_prefix_matches_recomputation_and_a_corrupted_one_is_caught():
    rep = reuse_run(ToyModel(0), 3)
    assert rep.ok and rep.mismatches == 0 and rep.max_abs_err <= 1e-6
    # the later turns start from cells computed by earlier ones: most of their prompts
    assert rep.reused_tokens > rep.prompt_tokens // 2

    def tamper(c, step, il):
        if step == 6 and il == 0:
            c.k(il)[0] += np.float32(0.5)   # cell 0: a system-prompt token every later turn reuses

    bad = reuse_run(ToyModel(0), 3, tamper=tamper)
    assert not bad.ok and bad.mismatches > 0
