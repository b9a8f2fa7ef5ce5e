"""Every rope golden trace replays within its tolerances, and the replay does catch errors."""
import copy
import glob
import os

import numpy as np
import pytest

from kvcache.conformance import Divergence, read_trace, run_file
from kvcache.conformance import rope as rope_replay
from kvcache.conformance.ops import replay

HERE = os.path.dirname(os.path.abspath(__file__))
TRACES = sorted(glob.glob(os.path.join(HERE, "golden", "rope", "*.jsonl")))


def test_traces_present():
    assert len(TRACES) >= 8


@pytest.mark.parametrize("path", TRACES, ids=os.path.basename)
def test_trace_passes(path):
    res = run_file(path)
    assert res.kind == "rope"
    assert res.ok, str(res.divergence)


def first_op(name):
    header, ops = read_trace(os.path.join(HERE, "golden", "rope", name))
    return header["config"], ops[0]


def replay_one(config, op):
    replay(rope_replay.kvcache_target(), config, iter([(1, op)]))


@pytest.mark.parametrize("name", ["rp01_f32_h8x2_kv32.jsonl", "rp02_f16_h16_2l_kv32.jsonl",
                                  "rp03_q8_0_h32x2_kv32.jsonl", "rp04_q4_0_h32_2l_kv32.jsonl"])
def test_wrong_parameters_diverge(name):
    config, op = first_op(name)
    replay_one(config, op)
    bad = copy.deepcopy(op)
    bad["mode"] = 2 if op["mode"] == 0 else 0
    with pytest.raises(Divergence):
        replay_one(config, bad)
    bad = copy.deepcopy(op)
    bad["shift"] = [s + 1 for s in op["shift"]]
    with pytest.raises(Divergence):
        replay_one(config, bad)


def test_tolerance_rules():
    exp = np.array([[1.0, -0.5, 1000.0, 0.0]])
    tol = rope_replay.tolerance("f32", exp, None, 4, 1e-5)
    np.testing.assert_array_equal(tol, np.full((1, 4), 1e-5))
    tol = rope_replay.tolerance("f16", exp, None, 4, 1e-5)
    np.testing.assert_allclose(tol, 1e-5 + np.array([[2.0**-10, 2.0**-11, 0.5, 2.0**-24]]))
    # q8_0: atol + 1.1 * |d| of the expected block
    raw = np.zeros((1, 34), np.uint8)
    raw[0, :2] = np.array([-0.25], "<f2").view(np.uint8)
    tol = rope_replay.tolerance("q8_0", np.zeros((1, 32)), raw.reshape(-1), 32, 1e-4)
    np.testing.assert_allclose(tol, np.full((1, 32), 1e-4 + 1.1 * 0.25))


def test_other_ops_are_unsupported():
    config, _ = first_op("rp01_f32_h8x2_kv32.jsonl")
    with pytest.raises(Divergence, match="unsupported"):
        replay_one(config, {"op": "k_shift", "expect": {}})
