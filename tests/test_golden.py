"""Every golden trace against every target that applies, and proof that the replay can fail.

- every trace file under tests/golden/ (every kind, both formats) replays through the runner
  against every target of its family: the C-backed cache, and the reference model where one
  exists (``unified``: tests/reference.py; ``unified2026``: tests/reference2026.py), also with
  the diagnostic ``info`` compared (strict);
- copies with one expected value changed diverge exactly there, for every file and target of
  every cache family and of split; strictly, a changed diagnostic diverges too; a rope op with
  other parameters falls outside the tolerances;
- an op a family does not have, a missing exception, a rejected call that changes the cache and
  a target that cannot build the cache fail the replay;
- the CLI's report and exit code; the copies in tests/golden are the recorded traces."""
import copy
import dataclasses
import hashlib
import importlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import GOLDEN, TESTS, kvcache_env
from conformance import FORMAT_2026, KINDS, KINDS_2026, Divergence, read_trace, run_file
from conformance import rope
from conformance.ops import CACHE_FAMILIES, OPS, replay
from reference import UnifiedReference

#: the trace files of each directory of tests/golden
COUNTS = {"unified": 12, "iswa": 5, "recurrent": 4, "split": 3, "rope": 8, "unified2026": 6}
FILES = sorted(GOLDEN.glob("*/*.jsonl"))

_LOADED: dict = {}


def _trace(path: Path) -> tuple[dict, list[dict]]:
    if path not in _LOADED:
        _LOADED[path] = read_trace(str(path))
    return _LOADED[path]


def _module(path: Path):
    """The module of a trace file's family."""
    header, _ = _trace(path)
    return importlib.import_module((KINDS_2026 if header["format"] == FORMAT_2026 else KINDS)[header["kind"]])


def _name(path: Path) -> str:
    return f"{path.parent.name}/{path.name}"


def _targets(path: Path):
    """(short name, target) of every target a file replays against ("auto" picks one of them)."""
    return [(key, make()) for key, make in _module(path).TARGETS.items() if key != "auto"]



def _cases(families=None):
    for path in FILES:
        for key, target in _targets(path):
            if families is None or target.family in families:
                yield pytest.param(path, target, id=f"{_name(path)}-{key}")


def _ops(ops: list[dict]):
    return iter(enumerate(ops, start=1))


def _changed(ops: list[dict], at: int) -> list[dict]:
    """The ops with a copy of op ``at``, to change (the others are shared, unchanged)."""
    ops = list(ops)
    ops[at] = copy.deepcopy(ops[at])
    return ops


def _diverges(target, header, ops, strict=False) -> Divergence:
    with pytest.raises(Divergence) as e:
        replay(target, header["config"], _ops(ops), strict=strict)
    return e.value


# --- the files ------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", sorted(COUNTS))
def test_traces_present(kind):
    assert len(list((GOLDEN / kind).glob("*.jsonl"))) == COUNTS[kind]
    assert (GOLDEN / ("FORMAT-2026.md" if kind == "unified2026" else "FORMAT.md")).is_file()


def _recorded_sums() -> dict[str, str]:
    """tests/data/golden-sha256.txt: the SHA-256 of every recorded file, as sha256sum writes it."""
    lines = (GOLDEN.parent / "data" / "golden-sha256.txt").read_text().splitlines()
    return {name: digest for digest, name in (line.split("  ", 1) for line in lines)}


def test_traces_match_their_recorded_checksums():
    """tests/golden holds exactly the recorded files, unchanged: a trace edited by hand (or one
    added or lost) fails here, wherever the suite runs."""
    ours = {p.relative_to(GOLDEN).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in GOLDEN.rglob("*") if p.is_file()}
    assert ours == _recorded_sums()


def test_traces_are_the_recorded_ones(shared_dir):
    """Where the reference material lies beside the repository: the copies in tests/golden are
    byte for byte its recorded traces (the checksums above tie them everywhere else)."""
    recorded = shared_dir / "golden"
    if not recorded.is_dir():
        pytest.skip("no recorded traces beside the repository")
    ours = sorted(p.relative_to(GOLDEN) for p in GOLDEN.rglob("*") if p.is_file())
    assert ours == sorted(p.relative_to(recorded) for p in recorded.rglob("*") if p.is_file())
    for p in ours:
        assert (GOLDEN / p).read_bytes() == (recorded / p).read_bytes(), p


# --- every file against every target ------------------------------------------------------------

@pytest.mark.parametrize("path,target", list(_cases()))
def test_trace(path, target):
    header, ops = _trace(path)
    res = run_file(str(path), target)
    assert res.ok, str(res.divergence)
    assert (res.kind, res.n_ops, res.target) == (header["kind"], len(ops), target.name)
    assert res.n_ops > 0


@pytest.mark.parametrize("path,target", list(_cases(CACHE_FAMILIES)))
def test_trace_diagnostics(path, target):
    """The diagnostic info matches too: the partial-window reports of every iSWA commit, the
    warnings of every recurrent find_slot and the bytes every successful read consumed."""
    header, ops = _trace(path)
    replay(target, header["config"], _ops(ops), strict=True)


# --- the replay can fail ------------------------------------------------------------------------

def _flip_hex(h: str, at: int) -> str:
    return h[:at] + ("1" if h[at] == "0" else "0") + h[at + 1:]


def _bump_last(v: list) -> None:
    v[-1] += 1


def _flip(e: dict, key: str) -> None:
    e[key] = not e[key]


# kind: (op name, which of its expects qualify, the field that must diverge, how to change it)
_STATE = {
    "seq_rm result": ("seq_rm", lambda e: "ret" in e, "ret", lambda e: _flip(e, "ret")),
    "blob length": ("state_write", lambda e: "len" in e, "len", lambda e: e.update(len=e["len"] + 1)),
    "blob byte": ("state_write", lambda e: "hex" in e and e["len"] > 64, "hex",
                  lambda e: e.update(hex=_flip_hex(e["hex"], len(e["hex"]) - 3))),
    "read ok": ("state_read", lambda e: "ok" in e, "ok", lambda e: _flip(e, "ok")),
}
_UNIFIED = {
    "find_slot ok": ("find_slot", lambda e: "ok" in e, "ok", lambda e: _flip(e, "ok")),
    "head": ("find_slot", lambda e: "head" in e, "head", lambda e: e.update(head=e["head"] + 1)),
    "used": ("check", lambda e: "used" in e, "used", lambda e: e.update(used=e["used"] + 1)),
    "cell": ("check", lambda e: e.get("cells"), "cells", lambda e: e["cells"][-1].__setitem__(1, e["cells"][-1][1] + 1)),
    "seq_pos": ("check", lambda e: any(mx >= 0 for _, _, mx in e.get("seq_pos", [])), "seq_pos",
                lambda e: next(sp for sp in e["seq_pos"] if sp[2] >= 0).__setitem__(2, 10**6)),
    "has_shift": ("check", lambda e: "has_shift" in e, "has_shift", lambda e: _flip(e, "has_shift")),
    "mask hash": ("mask", lambda e: "sha256" in e, "sha256", lambda e: e.update(sha256=_flip_hex(e["sha256"], 7))),
    "mask data": ("mask", lambda e: "data" in e, "data", lambda e: e["data"].__setitem__(0, 0.5)),
    "bucket hash": ("pos_bucket", lambda e: "sha256" in e, "sha256", lambda e: e.update(sha256=_flip_hex(e["sha256"], 0))),
    "shift": ("k_shift", lambda e: "shift" in e, "shift", lambda e: _bump_last(e["shift"])),
    "defrag result": ("defrag", lambda e: "ret" in e, "ret", lambda e: _flip(e, "ret")),
    "defrag plan": ("defrag", lambda e: e.get("ids"), "ids", lambda e: _bump_last(e["ids"])),
    "do_defrag": ("defrag_sched", lambda e: "do_defrag" in e, "do_defrag", lambda e: _flip(e, "do_defrag")),
    **_STATE,
}
_ISWA = {
    "swa head": ("find_slot", lambda e: "swa" in e, "swa.head", lambda e: e["swa"].update(head=e["swa"]["head"] + 1)),
    "base ok": ("find_slot", lambda e: "base" in e, "base.ok", lambda e: _flip(e["base"], "ok")),
    "pending": ("sbatch_init", lambda e: e.get("pending"), "pending",
                lambda e: e["pending"][0].__setitem__(2, e["pending"][0][2] + 1)),
    "swa used": ("check", lambda e: "swa" in e, "swa.used", lambda e: e["swa"].update(used=e["swa"]["used"] + 1)),
    "base cell": ("check", lambda e: "base" in e and e["base"]["cells"], "base.cells",
                  lambda e: e["base"]["cells"][-1].__setitem__(1, e["base"]["cells"][-1][1] + 1)),
    "base mask hash": ("mask", lambda e: "base" in e, "base.sha256",
                       lambda e: e["base"].update(sha256=_flip_hex(e["base"]["sha256"], 0))),
    "swa shift": ("k_shift", lambda e: "swa" in e, "swa.shift", lambda e: _bump_last(e["swa"]["shift"])),
    "base defrag plan": ("defrag", lambda e: "base" in e and e["base"]["ids"], "base.ids", lambda e: _bump_last(e["base"]["ids"])),
    "swa do_defrag": ("defrag_sched", lambda e: "swa" in e, "swa.do_defrag", lambda e: _flip(e["swa"], "do_defrag")),
    **_STATE,
}
_RECURRENT = {
    "find_slot ok": _UNIFIED["find_slot ok"],
    "used": ("find_slot", lambda e: "used" in e, "used", lambda e: e.update(used=e["used"] + 1)),
    "cell": _UNIFIED["cell"],
    "tail": ("check", lambda e: e.get("cells"), "cells", lambda e: e["cells"][-1].__setitem__(4, e["cells"][-1][4] + 1)),
    "seq_pos": _UNIFIED["seq_pos"],
    "copy source": ("s_copy", lambda e: e.get("values"), "values", lambda e: _bump_last(e["values"])),
    "state mask": ("s_mask", lambda e: e.get("values"), "values", lambda e: e["values"].__setitem__(-1, 1.0 - e["values"][-1])),
    **_STATE,
}
_SPLIT = {
    "ubatch pos": ("split", lambda e: True, "ubatches[0].pos", lambda e: e["ubatches"][0]["pos"].__setitem__(0, e["ubatches"][0]["pos"][0] + 1)),
    "ubatch seq_id": ("split", lambda e: True, "ubatches[0].seq_id", lambda e: e["ubatches"][0]["seq_id"].__setitem__(0, [63])),
    "ubatch output": ("split", lambda e: True, "ubatches[0].output",
                      lambda e: e["ubatches"][0]["output"].__setitem__(0, 1 - e["ubatches"][0]["output"][0])),
    "ubatch n_seqs": ("split", lambda e: True, "ubatches[0].n_seqs", lambda e: e["ubatches"][0].update(n_seqs=e["ubatches"][0]["n_seqs"] + 1)),
    "out_ids": ("split", lambda e: e["out_ids"], "out_ids", lambda e: e.update(out_ids=e["out_ids"][1:])),
    "ubatch count": ("split", lambda e: True, "ubatches (count)", lambda e: e["ubatches"].pop()),
}
_UNIFIED2026 = {
    "slot index": ("find_slot", lambda e: e["ok"], "idxs", lambda e: _bump_last(e["idxs"][-1])),
    "head": ("find_slot", lambda e: True, "heads", lambda e: _bump_last(e["heads"])),
    "used": ("find_slot", lambda e: True, "used", lambda e: _bump_last(e["used"])),
    "mask hash": ("mask", lambda e: True, "sha256", lambda e: e.update(sha256=_flip_hex(e["sha256"], 7))),
    "mask visible": ("mask", lambda e: any(e["visible"]), "visible",
                     lambda e: next(v for v in e["visible"] if v).pop()),
    "blob byte": _STATE["blob byte"],
    "blob length": _STATE["blob length"],
    "kvhash": ("kvhash", lambda e: True, "layers[0].v", lambda e: e["layers"][0].update(v=_flip_hex(e["layers"][0]["v"], 0))),
    "cell": ("check", lambda e: e["cells"], "cells", lambda e: e["cells"][-1].__setitem__(2, e["cells"][-1][2] + 1)),
    "seq_pos": _UNIFIED["seq_pos"],
    "n_kv": ("check", lambda e: True, "n_kv", lambda e: _bump_last(e["n_kv"])),
    "read ok": _STATE["read ok"],
    "prepare slot": ("prepare", lambda e: e["ok"], "sinfos[0].idxs", lambda e: _bump_last(e["sinfos"][0]["idxs"][-1])),
    "update shift": ("update", lambda e: e["status"] == 0, "shift", lambda e: _bump_last(e["shift"])),
    "pending copies": ("seq_cp", lambda e: True, "pending_copies",
                       lambda e: e.update(pending_copies=e["pending_copies"] + 1)),
    "bucket hash": _UNIFIED["bucket hash"],
}
MUTATIONS = {"unified": _UNIFIED, "iswa": _ISWA, "recurrent": _RECURRENT, "split": _SPLIT, "unified2026": _UNIFIED2026}

#: what every file of a family is mutated in at least
REQUIRED = {
    "unified": ("head", "cell", "seq_pos", "mask hash", "shift", "defrag plan", "read ok"),
    "iswa": ("swa head", "swa used", "base mask hash", "swa shift", "read ok"),
    "recurrent": ("used", "cell", "copy source", "state mask", "read ok"),
    "split": tuple(_SPLIT),
    "unified2026": ("slot index", "head", "mask hash", "blob byte", "kvhash"),
}


def _change_cases(changes, part):
    """(file, target, kind of change, index of the op changed) for every kind of change in
    ``changes`` that a file has an op for and its target compares (``part(op)``: what a change
    qualifies by)."""
    for path in FILES:
        _, ops = _trace(path)
        for key, target in _targets(path):
            for kind, (op_name, qualifies, _, _) in changes.get(target.family, {}).items():
                at = next((i for i, op in enumerate(ops) if op["op"] == op_name and qualifies(part(op))), None)
                if at is not None and op_name not in target.instead:
                    yield pytest.param(path, target, kind, at, id=f"{_name(path)}-{key}-{kind.replace(' ', '_')}")


def _with_change(changes, part, path, target, kind, at):
    """The header and ops of a file with op ``at`` changed, and the field that must diverge."""
    header, ops = _trace(path)
    ops = _changed(ops, at)
    _, _, field, change = changes[target.family][kind]
    change(part(ops[at]))
    return header, ops, field


def _expect(op: dict) -> dict:
    return op["expect"]


MUTATION_CASES = list(_change_cases(MUTATIONS, _expect))


@pytest.mark.parametrize("path,target,kind,at", MUTATION_CASES)
def test_a_changed_expectation_fails_the_replay(path, target, kind, at):
    header, ops, field = _with_change(MUTATIONS, _expect, path, target, kind, at)
    err = _diverges(target, header, ops)
    assert (err.index, err.field) == (at + 1, field), str(err)


def test_every_trace_has_the_required_mutations():
    cases = {(p.values[0], p.values[2]) for p in MUTATION_CASES}
    for path in FILES:
        family = _module(path).FAMILY
        for kind in REQUIRED.get(family, ()):
            assert (path, kind) in cases, (_name(path), kind)


def _op(op: dict) -> dict:
    return op


def _read_info(key: str):
    """A change of the bytes a successful read consumed, recorded as ``info[key]``."""
    return ("state_read", lambda op: op["expect"].get("ok") and key in op.get("info", {}), f"info.{key}",
            lambda op: op["info"].update({key: op["info"][key] + 1}))


def _log(op: dict) -> list:
    return op.get("info", {}).get("log", [])


# diagnostics, compared when strict: (op name, which of its ops qualify, the field, how to change its info)
DIAGNOSTICS = {
    "unified": {"bytes read": _read_info("n_read")},
    "iswa": {"bytes read": _read_info("n_read"),
             "partial window": ("commit", lambda op: any("partial SWA cache" in m for m in _log(op)),
                                "info.log (partial SWA cache, pmin)", lambda op: op["info"].update(log=[]))},
    "recurrent": {"bytes read": _read_info("n_read"),
                  "find_slot warning": ("find_slot", lambda op: any(m.startswith("find_slot:") for m in _log(op)),
                                        "info.log", lambda op: op["info"].update(log=[]))},
    "unified2026": {"bytes read": _read_info("consumed")},
}
DIAGNOSTIC_CASES = list(_change_cases(DIAGNOSTICS, _op))


@pytest.mark.parametrize("path,target,kind,at", DIAGNOSTIC_CASES)
def test_a_changed_diagnostic_fails_the_strict_replay(path, target, kind, at):
    header, ops, field = _with_change(DIAGNOSTICS, _op, path, target, kind, at)
    replay(target, header["config"], _ops(ops))     # not compared unless strict
    err = _diverges(target, header, ops, strict=True)
    assert (err.index, err.field) == (at + 1, field), str(err)


def test_every_family_with_diagnostics_is_mutated_in_each():
    cases = {(_module(p.values[0]).FAMILY, p.values[2]) for p in DIAGNOSTIC_CASES}
    assert cases == {(family, kind) for family, kinds in DIAGNOSTICS.items() for kind in kinds}


# --- what else fails ---------------------------------------------------------------------------

def _one_per_family():
    """(family, first file, short name, target) for every target of every family."""
    seen = set()
    for path in FILES:
        for key, target in _targets(path):
            if (target.family, key) not in seen:
                seen.add((target.family, key))
                yield target.family, path, key, target


def _foreign_op_cases():
    for family, path, key, target in _one_per_family():
        names = [name for name, by_family in OPS.items() if family not in by_family] + ["teleport"]
        ops = [{"op": name, "expect": {}} for name in names]
        if family == "unified2026":
            ops.append({"op": "clear", "data": False, "expect": {}})   # the traces' clear keeps no data
        for op in ops:
            suffix = "-no-data" if "data" in op else ""
            yield pytest.param(path, target, op, id=f"{family}-{key}-{op['op']}{suffix}")


@pytest.mark.parametrize("path,target,op", list(_foreign_op_cases()))
def test_an_op_the_family_does_not_have_fails_the_replay(path, target, op):
    header, _ = _trace(path)
    err = _diverges(target, header, [op])
    assert (err.index, err.op, err.field) == (1, op["op"], "op")


def _cache_family_cases():
    for family, path, key, target in _one_per_family():
        if family in CACHE_FAMILIES:
            yield pytest.param(path, target, id=f"{family}-{key}")


@pytest.mark.parametrize("path,target", list(_cache_family_cases()))
def test_an_op_expecting_an_exception_must_raise_one(path, target):
    header, _ = _trace(path)
    invalid = {"exception": "invalid_argument"}
    n_seq_max = header["config"]["n_seq_max"]
    replay(target, header["config"], _ops([{"op": "seq_keep", "seq_id": n_seq_max, "expect": invalid}]))
    err = _diverges(target, header, [{"op": "seq_keep", "seq_id": 0, "expect": invalid}])
    assert (err.index, err.field, err.got) == (1, "exception", "no exception")


@pytest.mark.parametrize("path,target", list(_cache_family_cases()))
def test_a_target_that_cannot_build_the_cache_fails_at_the_header(path, target):
    def refuse(config):
        raise TypeError("no such cache here")
    header, ops = _trace(path)
    err = _diverges(dataclasses.replace(target, name="refusing", make_cache=refuse), header, ops)
    assert (err.index, err.field) == (0, "config") and "no such cache" in str(err)


class _ClearingReference(UnifiedReference):
    """A model that empties the cache before it rejects a sequence id (a plausible slip)."""

    def seq_keep(self, seq_id):
        self.clear()
        super().seq_keep(seq_id)


def test_a_rejected_call_that_changes_the_cache_fails_the_replay():
    from conformance.unified import reference_arguments, reference_target
    path = GOLDEN / "unified" / "u01_fill_f32_small.jsonl"
    header, ops = _trace(path)
    at = next(i for i, op in enumerate(ops) if op["op"] == "seq_keep" and "exception" in op["expect"])
    assert any(op["op"] == "find_slot" and op["expect"].get("ok") for op in ops[:at])
    model = dataclasses.replace(reference_target(),
                                make_cache=lambda config: _ClearingReference(**reference_arguments(config)))
    err = _diverges(model, header, ops)
    assert (err.index, err.op, err.field) == (at + 1, "seq_keep", "state after a rejected call")


def test_a_config_the_2026_target_disagrees_with_fails_at_the_header():
    from conformance.unified2026 import reference_target
    header, ops = _trace(GOLDEN / "unified2026" / "p01_unified_pos_bucket_384.jsonl")
    err = _diverges(reference_target(), {"config": {**header["config"], "n_stream": 2}}, ops[:1])
    assert (err.index, err.field) == (0, "config.n_stream")


def test_a_changed_input_blob_fails_at_the_next_kvhash():
    """A K/V byte of a blob that a read takes changes what the next kvhash sees."""
    from conformance.unified2026 import reference_target
    header, ops = _trace(GOLDEN / "unified2026" / "v03_multistream_nsm4.jsonl")
    at = next(i for i, op in enumerate(ops) if op["op"] == "state_read" and op["expect"]["ok"]
              and len(op["hex"]) > 1000 and any(o["op"] == "kvhash" for o in ops[i + 1:i + 4]))
    ops = _changed(ops, at)
    blob = ops[at]["hex"]
    # a sequence of stream 2 of 4: the blob ends with the last V element of stream 2, then the
    # cell count 0 of stream 3
    assert ops[at]["seq_id"] == 2 and blob.endswith("00000000")
    ops[at]["hex"] = _flip_hex(blob, len(blob) - 9)
    err = _diverges(reference_target(), header, ops)
    assert err.op == "kvhash" and err.index > at + 1


# --- rope: tolerances ------------------------------------------------------------------------------

def _rope_op(name: str) -> tuple[dict, dict]:
    header, ops = _trace(GOLDEN / "rope" / name)
    return header, ops[0]


@pytest.mark.parametrize("name", ["rp01_f32_h8x2_kv32.jsonl", "rp02_f16_h16_2l_kv32.jsonl",
                                  "rp03_q8_0_h32x2_kv32.jsonl", "rp04_q4_0_h32_2l_kv32.jsonl"])
def test_rope_wrong_parameters_diverge(name):
    header, op = _rope_op(name)
    target = rope.kvcache_target()
    replay(target, header["config"], _ops([op]))
    bad = copy.deepcopy(op)
    bad["mode"] = 2 if op["mode"] == 0 else 0
    assert _diverges(target, header, [bad]).field.startswith("after[")
    bad = copy.deepcopy(op)
    bad["shift"] = [s + 1 for s in op["shift"]]
    assert _diverges(target, header, [bad]).field.startswith("after[")


def test_rope_tolerance_rules():
    exp = np.array([[1.0, -0.5, 1000.0, 0.0]])
    tol = rope.tolerance("f32", exp, None, 4, 1e-5)
    np.testing.assert_array_equal(tol, np.full((1, 4), 1e-5))
    tol = rope.tolerance("f16", exp, None, 4, 1e-5)
    np.testing.assert_allclose(tol, 1e-5 + np.array([[2.0**-10, 2.0**-11, 0.5, 2.0**-24]]))
    # q8_0: atol + 1.1 * |d| of the expected block
    raw = np.zeros((1, 34), np.uint8)
    raw[0, :2] = np.array([-0.25], "<f2").view(np.uint8)
    tol = rope.tolerance("q8_0", np.zeros((1, 32)), raw.reshape(-1), 32, 1e-4)
    np.testing.assert_allclose(tol, np.full((1, 32), 1e-4 + 1.1 * 0.25))


# --- the CLI ---------------------------------------------------------------------------------------

def _write(path: Path, header: dict, ops: list[dict]) -> Path:
    path.write_text("\n".join(json.dumps(x) for x in [header, *ops]) + "\n")
    return path


def _cli(*args) -> subprocess.CompletedProcess:
    # run as documented: from tests/, where the runner and the reference models are importable
    return subprocess.run([sys.executable, "-m", "conformance", *map(str, args)],
                          capture_output=True, text=True, env=kvcache_env(), cwd=TESTS)


def test_cli_summary(tmp_path):
    path = GOLDEN / "unified" / "u01_fill_f32_small.jsonl"
    good = _cli("-q", path)
    assert good.returncode == 0 and "1 passed, 0 failed" in good.stdout
    header, ops = _trace(path)
    ops = _changed(ops, 0)
    ops[0]["expect"]["ok"] = not ops[0]["expect"]["ok"]
    bad = _cli(path, _write(tmp_path / "t.jsonl", header, ops))
    assert bad.returncode != 0 and "1 passed, 1 failed" in bad.stdout


def test_cli_names_the_target_and_fails_on_a_divergence(tmp_path):
    path = GOLDEN / "unified2026" / "p01_unified_pos_bucket_384.jsonl"
    good = _cli("--target", "reference", path)
    assert good.returncode == 0, good.stdout + good.stderr
    assert f"ok   {path} " in good.stdout and "(reference model)" in good.stdout
    assert "1 passed, 0 failed" in good.stdout
    header, ops = _trace(path)
    at = next(i for i, op in enumerate(ops) if op["op"] == "find_slot")
    ops = _changed(ops, at)
    _UNIFIED2026["head"][3](ops[at]["expect"])
    bad_path = _write(tmp_path / "bad.jsonl", header, ops)
    bad = _cli("--target", "reference", path, bad_path)
    assert bad.returncode == 1
    assert f"FAIL {bad_path} (reference model): op #{at + 1} (find_slot): heads" in bad.stdout
    assert "1 passed, 1 failed" in bad.stdout


def test_cli_replays_both_formats():
    """A kvcache-trace/1 file is reported as before (no target), a 2026 one with the target that
    ran it (by default the C-backed cache)."""
    old, new = GOLDEN / "unified" / "u01_fill_f32_small.jsonl", GOLDEN / "unified2026" / "p01_unified_pos_bucket_384.jsonl"
    res = _cli(old, new)
    assert res.returncode == 0, res.stdout
    lines = res.stdout.strip().splitlines()
    assert lines[0].startswith(f"ok   {old} (") and lines[0].endswith(" ops)")
    assert lines[1].startswith(f"ok   {new} (") and lines[1].endswith(" ops) (kvcache.UnifiedCache)")
    assert lines[2] == "2 passed, 0 failed"
