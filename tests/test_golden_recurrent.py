"""Every recurrent golden trace replays without divergence."""
import glob
import os

import pytest

from kvcache.conformance import read_trace, run_file
from kvcache.conformance import recurrent
from kvcache.conformance.ops import replay

HERE = os.path.dirname(os.path.abspath(__file__))
TRACES = sorted(glob.glob(os.path.join(HERE, "golden", "recurrent", "*.jsonl")))


def test_traces_present():
    assert len(TRACES) >= 4


@pytest.mark.parametrize("path", TRACES, ids=os.path.basename)
def test_trace(path):
    res = run_file(path)
    assert res.kind == "recurrent"
    assert res.ok, str(res.divergence)


@pytest.mark.parametrize("path", TRACES, ids=os.path.basename)
def test_trace_diagnostics(path):
    """The diagnostic info matches too: find_slot's warnings and the bytes each read consumed."""
    header, ops = read_trace(path)
    replay(recurrent.kvcache_target(), header["config"], iter(enumerate(ops, start=1)), strict=True)


def test_replay_detects_a_wrong_expectation():
    """A replay that cannot fail proves nothing: corrupt one expected value."""
    header, ops = read_trace(TRACES[0])
    for op in ops:
        if op["op"] == "find_slot" and "head" in op["expect"]:
            op["expect"]["used"] += 1
            break
    with pytest.raises(Exception) as ei:
        replay(recurrent.kvcache_target(), header["config"], iter(enumerate(ops, start=1)))
    assert "used" in str(ei.value)
