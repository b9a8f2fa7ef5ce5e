"""Every golden ``split`` trace replays without divergence; a tampered one does not."""
import glob
import json
import os

import pytest

from kvcache.conformance import run_file

HERE = os.path.dirname(os.path.abspath(__file__))
TRACES = sorted(glob.glob(os.path.join(HERE, "golden", "split", "*.jsonl")))


def test_traces_present():
    assert len(TRACES) >= 3


@pytest.mark.parametrize("path", TRACES, ids=os.path.basename)
def test_trace(path):
    res = run_file(path)
    assert res.kind == "split"
    assert res.ok, str(res.divergence)
    assert res.n_ops > 0


def _rewrite(src, dst, edit):
    with open(src, encoding="utf-8") as f:
        lines = [json.loads(line) for line in f if line.strip()]
    edit(lines)
    with open(dst, "w", encoding="utf-8") as f:
        for line in lines:
            f.write(json.dumps(line) + "\n")


@pytest.mark.parametrize("field", ["pos", "seq_id", "output", "n_seqs"])
def test_tampered_ubatch_is_caught(tmp_path, field):
    def edit(lines):
        ub = lines[1]["expect"]["ubatches"][0]
        if field == "pos":
            ub["pos"][0] += 1
        elif field == "seq_id":
            ub["seq_id"][0] = [63]
        elif field == "output":
            ub["output"][0] = 1 - ub["output"][0]
        else:
            ub["n_seqs"] += 1

    dst = tmp_path / "t.jsonl"
    _rewrite(TRACES[0], dst, edit)
    res = run_file(str(dst))
    assert not res.ok
    assert res.divergence.index == 1
    assert field in res.divergence.field


def test_tampered_out_ids_and_count_are_caught(tmp_path):
    def drop_out_id(lines):
        lines[1]["expect"]["out_ids"] = lines[1]["expect"]["out_ids"][1:]

    def drop_ubatch(lines):
        lines[2]["expect"]["ubatches"].pop()

    for edit, index, field in ((drop_out_id, 1, "out_ids"), (drop_ubatch, 2, "ubatches")):
        dst = tmp_path / f"{field}.jsonl"
        _rewrite(TRACES[0], dst, edit)
        res = run_file(str(dst))
        assert not res.ok
        assert res.divergence.index == index
        assert field in res.divergence.field


def test_unknown_op_is_a_failure(tmp_path):
    def edit(lines):
        lines.insert(1, {"op": "shuffle", "expect": {}})

    dst = tmp_path / "u.jsonl"
    _rewrite(TRACES[0], dst, edit)
    res = run_file(str(dst))
    assert not res.ok
    assert res.divergence.op == "shuffle"
