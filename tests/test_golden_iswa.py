"""Every iswa golden trace replays without divergence, diagnostics included."""
import glob
import os

import pytest

from kvcache.conformance import read_trace, run_file
from kvcache.conformance import iswa
from kvcache.conformance.ops import replay

HERE = os.path.dirname(os.path.abspath(__file__))
TRACES = sorted(glob.glob(os.path.join(HERE, "golden", "iswa", "*.jsonl")))


def test_traces_present():
    assert len(TRACES) >= 5


@pytest.mark.parametrize("path", TRACES, ids=os.path.basename)
def test_trace(path):
    res = run_file(path)
    assert res.kind == "iswa"
    assert res.ok, str(res.divergence)


@pytest.mark.parametrize("path", TRACES, ids=os.path.basename)
def test_trace_diagnostics(path):
    """The partial-window reports of every commit and the bytes every read consumed match too."""
    header, ops = read_trace(path)
    replay(iswa.kvcache_target(), header["config"], iter(enumerate(ops, start=1)), strict=True)


def _corrupted(path, pick, change):
    header, ops = read_trace(path)
    for op in ops:
        if pick(op):
            change(op)
            break
    else:
        raise AssertionError("no op to corrupt")
    return header, ops


def _diverges(header, ops):
    with pytest.raises(Exception) as ei:
        replay(iswa.kvcache_target(), header["config"], iter(enumerate(ops, start=1)))
    return ei.value


@pytest.mark.parametrize("pick, change, field", [
    (lambda op: op["op"] == "find_slot" and "swa" in op["expect"],
     lambda op: op["expect"]["swa"].update(head=op["expect"]["swa"]["head"] + 1), "swa"),
    (lambda op: op["op"] == "sbatch_init" and op["expect"]["pending"],
     lambda op: op["expect"]["pending"][0].__setitem__(2, op["expect"]["pending"][0][2] + 1), "pending"),
    (lambda op: op["op"] == "check",
     lambda op: op["expect"]["swa"].update(used=op["expect"]["swa"]["used"] + 1), "swa"),
    (lambda op: op["op"] == "mask",
     lambda op: op["expect"]["base"].update(sha256="0" * 64), "base"),
    (lambda op: op["op"] == "state_read",
     lambda op: op["expect"].update(ok=not op["expect"]["ok"]), "ok"),
])
def test_replay_detects_a_wrong_expectation(pick, change, field):
    """A replay that cannot fail proves nothing: corrupt one expected value of each kind."""
    header, ops = _corrupted(TRACES[0], pick, change)
    err = _diverges(header, ops)
    assert getattr(err, "field", None) == field, err


def test_strict_replay_detects_a_missing_warning():
    for path in TRACES:
        header, ops = read_trace(path)
        hit = [op for op in ops if op["op"] == "commit" and op.get("info", {}).get("log")]
        if hit:
            hit[0]["info"]["log"] = []
            with pytest.raises(Exception, match="partial SWA"):
                replay(iswa.kvcache_target(), header["config"], iter(enumerate(ops, start=1)), strict=True)
            return
    raise AssertionError("no trace reports a partial SWA cache")
