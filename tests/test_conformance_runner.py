"""The conformance runner itself: an expectation it does not know fails the trace, it never
passes as if it were a known one; and every family is compared strictly — an unknown
expectation key fails, a produced field the trace leaves out fails unless the family calls it
optional, and a trace's tolerance never loosens a comparison beyond the family's cap."""
import copy
import dataclasses
import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from conformance import Divergence, read_trace, run_file
from conformance import rope
from conformance.ops import FIELDS, replay
from conftest import GOLDEN, REPO, TESTS, kvcache_env, need_module

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


# --- strict for every family ----------------------------------------------------------------------

def _sub(e: dict, path: str):
    """The object at a dotted path of an expectation (``ubatches.0``: item 0 of a list)."""
    for part in filter(None, path.split(".")):
        e = e[int(part)] if part.isdigit() else e[part]
    return e


def _parent(e: dict, path: str):
    """The object holding the item at a dotted path, and the item's key in it."""
    *parents, last = path.split(".")
    return _sub(e, ".".join(parents)), int(last) if last.isdigit() else last


@dataclasses.dataclass(frozen=True)
class Case:
    """One family's op to change: ``path``, the first op named ``op`` there; ``listed``, a field
    it produces that the trace must list; ``value``, a number to move ``by``, named ``diverges``
    when it does (dotted paths into the expectation)."""

    path: Path
    op: str
    listed: str
    value: str
    by: float
    diverges: str


FAMILIES = {
    "unified": Case(GOLDEN / "unified" / "u01_fill_f32_small.jsonl", "find_slot", "head", "head", 1, "head"),
    "iswa": Case(GOLDEN / "iswa" / "i01_standard_nseq1.jsonl", "find_slot", "swa.used", "swa.head", 1, "swa.head"),
    "recurrent": Case(GOLDEN / "recurrent" / "r01_mamba_like.jsonl", "find_slot", "used", "used", 1, "used"),
    "split": Case(GOLDEN / "split" / "s01_mixed.jsonl", "split", "ubatches.0.n_tokens", "ubatches.0.pos.0", 1,
                  "ubatches[0].pos"),
    # the trace asks 1.9e-05 here, the cap of this op
    "rope": Case(GOLDEN / "rope" / "rp01_f32_h8x2_kv32.jsonl", "rope_shift", "after", "after.0.0", 1.0,
                 "after[0][row 0, elem 0] (tolerance 1.9e-05, 1 elements out)"),
    "unified2026": Case(GOLDEN / "unified2026" / "v05_swa_standard8.jsonl", "find_slot", "heads", "heads.0", 1,
                        "heads"),
}

# (family, file, op, an object inside its expectation, the prefix of its fields in a divergence)
NESTED = [("iswa", FAMILIES["iswa"].path, "find_slot", "swa", "swa."),
          ("split", FAMILIES["split"].path, "split", "ubatches.0", "ubatches[0]."),
          ("unified2026", FAMILIES["unified2026"].path, "kvhash", "layers.0", "layers[0].")]


def _up_to(path: Path, name: str, has: str = ""):
    """The header of a trace and its ops up to the first op named ``name`` that expects fields
    (and lists the dotted field ``has``), that op a copy to change; and its 1-based index."""
    header, ops = read_trace(str(path))

    def lists(expect):
        if not has:
            return True
        try:
            obj, key = _parent(expect, has)
            return key in obj
        except (KeyError, IndexError, TypeError):
            return False
    at = next((i for i, op in enumerate(ops) if op["op"] == name and "exception" not in op["expect"]
               and lists(op["expect"])), None)
    if at is None:
        return None
    ops = ops[:at + 1]
    ops[at] = copy.deepcopy(ops[at])
    return header, ops, at + 1


def _family_op(family: str):
    case = FAMILIES[family]
    return _up_to(case.path, case.op)


def _replay(family: str, header: dict, ops: list[dict]) -> None:
    module = importlib.import_module(f"conformance.{family}")
    replay(module.default_target(), header["config"], iter(enumerate(ops, start=1)))


def _diverges(family: str, header: dict, ops: list[dict]) -> Divergence:
    with pytest.raises(Divergence) as e:
        _replay(family, header, ops)
    return e.value


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_chosen_op_passes_as_recorded(family):
    header, ops, _ = _family_op(family)
    _replay(family, header, ops)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_an_unknown_expectation_key_fails(family):
    header, ops, index = _family_op(family)
    ops[-1]["expect"]["ubatch_count"] = 1
    err = _diverges(family, header, ops)
    assert (err.index, err.field) == (index, "ubatch_count"), str(err)
    assert f"unknown expectation key at line {index + 1}" in str(err)


@pytest.mark.parametrize("family,path,name,inner,prefix", NESTED, ids=[n[0] for n in NESTED])
def test_an_unknown_key_inside_an_object_fails(family, path, name, inner, prefix):
    header, ops, index = _up_to(path, name)
    _sub(ops[-1]["expect"], inner)["hidden"] = 0
    err = _diverges(family, header, ops)
    assert (err.index, err.field) == (index, prefix + "hidden"), str(err)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_produced_field_the_trace_leaves_out_fails(family):
    header, ops, index = _family_op(family)
    listed = FAMILIES[family].listed
    obj, key = _parent(ops[-1]["expect"], listed)
    del obj[key]
    err = _diverges(family, header, ops)
    assert err.index == index and "which the trace at line" in str(err), str(err)
    assert err.field == listed.replace(".0.", "[0]."), str(err)


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("atol", [None, 1e6])
def test_a_looser_tolerance_is_capped(family, atol):
    """A moved value fails whatever tolerance the trace asks: the family's cap holds (0 for
    the exact families, the format's tolerance of the op for rope)."""
    header, ops, index = _family_op(family)
    case = FAMILIES[family]
    obj, key = _parent(ops[-1]["expect"], case.value)
    obj[key] += case.by
    if atol is not None:
        ops[-1]["expect"]["atol"] = atol
    err = _diverges(family, header, ops)
    assert (err.index, err.field) == (index, case.diverges), str(err)


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("atol", [-1, float("nan"), "1e-3", True])
def test_an_atol_that_is_no_tolerance_fails(family, atol):
    header, ops, index = _family_op(family)
    ops[-1]["expect"]["atol"] = atol
    err = _diverges(family, header, ops)
    assert (err.index, err.field) == (index, "atol"), str(err)


def test_a_tighter_tolerance_holds():
    """rope: a value moved by half the op's tolerance passes, and fails once the trace asks a
    quarter of it."""
    header, ops, _ = _family_op("rope")
    expect = ops[-1]["expect"]
    expect["after"][0][0] += expect["atol"] / 2
    _replay("rope", header, ops)
    expect["atol"] /= 4
    assert _diverges("rope", header, ops).field == "after[0][row 0, elem 0] (tolerance 4.75e-06, 1 elements out)"


def test_every_recorded_rope_op_asks_the_cap():
    """The cap is the tolerance golden/FORMAT.md derives from each op's inputs: every recorded
    op asks exactly that much."""
    for path in sorted((GOLDEN / "rope").glob("*.jsonl")):
        header, ops = read_trace(str(path))
        for index, op in enumerate(ops, start=1):
            assert rope.atol_cap(header["config"], op) == op["expect"]["atol"], (path.name, index)


def _optional_cases():
    """(family, op, dotted field) of every optional field in FIELDS."""
    for name, by_family in FIELDS.items():
        for family, fields in by_family.items():
            for field in fields.optional:
                yield pytest.param(family, name, field, id=f"{family}-{name}-{field}")


@pytest.mark.parametrize("family,name,field", list(_optional_cases()))
def test_an_optional_field_may_be_left_out(family, name, field):
    assert FIELDS[name][family].optional[field]    # with its reason
    found = (_up_to(path, name, field) for path in sorted((GOLDEN / family).glob("*.jsonl")))
    header, ops, _ = next(f for f in found if f is not None)
    obj, key = _parent(ops[-1]["expect"], field)
    del obj[key]
    _replay(family, header, ops)


def test_the_report_names_the_trace_the_line_and_the_key(tmp_path):
    header, ops, index = _family_op("split")
    ops[-1]["expect"]["ubatch_count"] = 1
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(json.dumps(x) for x in [header, *ops]) + "\n")
    res = subprocess.run([sys.executable, "-m", "conformance", str(bad)], capture_output=True, text=True,
                         env=kvcache_env(), cwd=TESTS)
    assert res.returncode == 1, res.stdout + res.stderr
    assert f"FAIL {bad}: op #{index} (split): ubatch_count: unknown expectation key at line {index + 1}" in res.stdout


def test_the_sdist_ships_the_runner(monkeypatch):
    """The runner is test tooling, outside the wheel: the sdist carries it with the suite."""
    need_module("test", "setuptools")
    from setuptools.command.egg_info import FileList

    monkeypatch.chdir(REPO)     # MANIFEST.in's patterns are relative to the project root
    files = FileList()
    files.findall(".")
    for line in (REPO / "MANIFEST.in").read_text(encoding="utf-8").splitlines():
        if line.split("#", 1)[0].strip():
            files.process_template_line(line.split("#", 1)[0].strip())
    runner = {p.relative_to(REPO).as_posix() for p in (TESTS / "conformance").glob("*.py")}
    assert runner and runner <= set(files.files), sorted(runner - set(files.files))
