"""Every unified golden trace replays without divergence."""
import glob
import os

import pytest

from kvcache.conformance import run_file

TRACES = sorted(glob.glob(os.path.join(os.path.dirname(__file__), "golden", "unified", "*.jsonl")))


def test_traces_present():
    assert TRACES, "no unified traces found"


@pytest.mark.parametrize("path", TRACES, ids=[os.path.basename(p) for p in TRACES])
def test_trace(path):
    res = run_file(path)
    assert res.kind == "unified"
    assert res.ok, str(res.divergence)


def _write_trace(tmp_path, lines):
    import json
    p = tmp_path / "t.jsonl"
    p.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    return str(p)


def _first_lines(n):
    with open(TRACES[0]) as f:
        import json
        return [json.loads(next(f)) for _ in range(n)]


def test_replayer_reports_a_wrong_expectation(tmp_path):
    lines = _first_lines(4)
    assert lines[1]["op"] == "find_slot"
    lines[1]["expect"]["head"] += 1
    res = run_file(_write_trace(tmp_path, lines))
    assert not res.ok and res.divergence.index == 1 and res.divergence.field == "head"


def test_replayer_rejects_unknown_ops(tmp_path):
    lines = _first_lines(1) + [{"op": "teleport", "expect": {}}]
    res = run_file(_write_trace(tmp_path, lines))
    assert not res.ok and res.divergence.field == "op"


def test_replayer_requires_the_expected_exception(tmp_path):
    header = _first_lines(1)[0]
    n_seq_max = header["config"]["n_seq_max"]
    ok = [header, {"op": "seq_keep", "seq_id": n_seq_max, "expect": {"exception": "invalid_argument"}}]
    assert run_file(_write_trace(tmp_path, ok)).ok
    bad = [header, {"op": "seq_keep", "seq_id": 0, "expect": {"exception": "invalid_argument"}}]
    res = run_file(_write_trace(tmp_path, bad))
    assert not res.ok and res.divergence.field == "exception"


def test_cli_summary(tmp_path):
    import subprocess
    import sys
    from conftest import kvcache_env
    env = kvcache_env()
    good = subprocess.run([sys.executable, "-m", "kvcache.conformance", "-q", TRACES[0]],
                          capture_output=True, text=True, env=env)
    assert good.returncode == 0 and "1 passed, 0 failed" in good.stdout
    lines = _first_lines(4)
    lines[1]["expect"]["ok"] = not lines[1]["expect"]["ok"]
    bad = subprocess.run([sys.executable, "-m", "kvcache.conformance", TRACES[0],
                          _write_trace(tmp_path, lines)], capture_output=True, text=True, env=env)
    assert bad.returncode != 0 and "1 passed, 1 failed" in bad.stdout
