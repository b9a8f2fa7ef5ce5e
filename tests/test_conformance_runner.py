"""The conformance runner itself: an expectation it does not know fails the trace, it never
passes as if it were a known one."""
import json

import pytest

from conftest import GOLDEN
from conformance import run_file

TRACES = {"unified": GOLDEN / "unified" / "u01_fill_f32_small.jsonl",
          "iswa": GOLDEN / "iswa" / "i01_standard_nseq1.jsonl",
          "recurrent": GOLDEN / "recurrent" / "r01_mamba_like.jsonl"}


def _with_expectation(src, dst, expect):
    """src with the first op expecting invalid_argument changed to expect."""
    lines = src.read_text().splitlines()
    for i, line in enumerate(lines[1:], start=1):
        op = json.loads(line)
        if op.get("expect") == {"exception": "invalid_argument"}:
            op["expect"] = expect
            lines[i] = json.dumps(op)
            dst.write_text("\n".join(lines) + "\n")
            return i
    raise AssertionError(f"{src} has no op expecting invalid_argument")


@pytest.mark.parametrize("kind", sorted(TRACES))
def test_the_traces_pass_as_they_are(kind):
    assert run_file(str(TRACES[kind])).ok


@pytest.mark.parametrize("kind", sorted(TRACES))
@pytest.mark.parametrize("expect", [{"exception": "out_of_memory"}, {"exception": "Invalid_Argument"},
                                    {"exception": None}, {"exception": ["invalid_argument"]},
                                    {"exception": "invalid_argument", "ret": True}])
def test_an_unknown_exception_expectation_fails(kind, expect, tmp_path):
    path = tmp_path / "t.jsonl"
    index = _with_expectation(TRACES[kind], path, expect)
    res = run_file(str(path))
    assert not res.ok
    assert res.divergence.index == index
