"""The kvcache-trace/2026 traces (golden/FORMAT-2026.md) against the reference model of today's cache.

- every trace replays without divergence, through the runner (``run_file``) and its CLI;
- the replay can fail: for every trace, copies with one expected value changed (a slot index, a
  head, a mask hash or visible list, a blob byte, a kvhash, ...) diverge exactly there;
- the diagnostic ``info`` of the traces is reproduced too: the bytes a successful read consumed,
  the error of a failed one, and whether llama.cpp's own failure path (``restored``) or its own
  undo of ``prepare`` (``undo_restored``) would have changed the cache where rules C7 / C8 keep
  it as it was."""
import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import GOLDEN, kvcache_env
from kvcache import StateError
from kvcache.conformance import Divergence, Replay, Target, run_file
from kvcache.conformance.common import compare_fields
from kvcache.conformance.ops import apply_op, replay
from kvcache.conformance.unified2026 import FAMILY, check_config, default_target, reference_target
from kvcache.statefile import _Reader

TRACES = sorted((GOLDEN / "unified2026").glob("*.jsonl"))
NAMES = [p.stem for p in TRACES]


def _load(path: Path) -> tuple[dict, list[dict]]:
    lines = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return lines[0], lines[1:]


_LOADED: dict = {}


def _trace(name: str) -> tuple[dict, list[dict]]:
    if name not in _LOADED:
        _LOADED[name] = _load(GOLDEN / "unified2026" / f"{name}.jsonl")
    return _LOADED[name]


def test_traces_present():
    assert len(TRACES) == 6
    assert (GOLDEN / "FORMAT-2026.md").is_file()


def test_traces_are_the_recorded_ones(shared_dir):
    """The copies in tests/golden are byte for byte the traces recorded from llama.cpp."""
    recorded = shared_dir / "golden"
    if not (recorded / "unified2026").is_dir():
        pytest.skip("no recorded 2026 traces beside the repository")
    for p in TRACES:
        assert p.read_bytes() == (recorded / "unified2026" / p.name).read_bytes(), p.name
    assert (GOLDEN / "FORMAT-2026.md").read_bytes() == (recorded / "FORMAT-2026.md").read_bytes()


@pytest.mark.parametrize("path", TRACES, ids=NAMES)
def test_trace_replays_against_the_reference_model(path):
    res = run_file(str(path), reference_target())
    assert res.kind == "unified" and res.target == "reference model"
    assert res.ok, str(res.divergence)


# --- the replay can fail ----------------------------------------------------------------------

def _flip_hex(h: str, at: int) -> str:
    return h[:at] + ("1" if h[at] == "0" else "0") + h[at + 1:]


def _bump_last(v: list) -> None:
    v[-1] += 1


# kind: (op name, which of its expects qualify, the field changed, how)
MUTATIONS = {
    "slot index": ("find_slot", lambda e: e["ok"], "idxs", lambda e: _bump_last(e["idxs"][-1])),
    "head": ("find_slot", lambda e: True, "heads", lambda e: _bump_last(e["heads"])),
    "used": ("find_slot", lambda e: True, "used", lambda e: _bump_last(e["used"])),
    "mask hash": ("mask", lambda e: True, "sha256", lambda e: e.update(sha256=_flip_hex(e["sha256"], 7))),
    "mask visible": ("mask", lambda e: any(e["visible"]), "visible",
                     lambda e: next(v for v in e["visible"] if v).pop()),
    "blob byte": ("state_write", lambda e: "hex" in e and e["len"] > 64, "hex",
                  lambda e: e.update(hex=_flip_hex(e["hex"], len(e["hex"]) - 3))),
    "blob length": ("state_write", lambda e: True, "len", lambda e: e.update(len=e["len"] + 1)),
    "kvhash": ("kvhash", lambda e: True, "layers", lambda e: e["layers"][-1].update(v=_flip_hex(e["layers"][-1]["v"], 0))),
    "cell": ("check", lambda e: e["cells"], "cells", lambda e: e["cells"][-1].__setitem__(2, e["cells"][-1][2] + 1)),
    "seq_pos": ("check", lambda e: any(mx >= 0 for _, _, mx in e["seq_pos"]), "seq_pos",
                lambda e: next(sp for sp in e["seq_pos"] if sp[2] >= 0).__setitem__(2, 10**6)),
    "n_kv": ("check", lambda e: True, "n_kv", lambda e: _bump_last(e["n_kv"])),
    "read ok": ("state_read", lambda e: True, "ok", lambda e: e.update(ok=not e["ok"])),
    "prepare slot": ("prepare", lambda e: e["ok"], "sinfos", lambda e: _bump_last(e["sinfos"][-1]["idxs"][-1])),
    "update shift": ("update", lambda e: e["status"] == 0, "shift", lambda e: _bump_last(e["shift"])),
    "pending copies": ("seq_cp", lambda e: True, "pending_copies",
                       lambda e: e.update(pending_copies=e["pending_copies"] + 1)),
    "bucket hash": ("pos_bucket", lambda e: True, "sha256", lambda e: e.update(sha256=_flip_hex(e["sha256"], 0))),
}


def _mutation_cases():
    for name in NAMES:
        _, ops = _trace(name)
        for kind, (op_name, qualifies, _, _) in MUTATIONS.items():
            where = [i for i, op in enumerate(ops) if op["op"] == op_name and qualifies(op["expect"])]
            if where:
                yield pytest.param(name, kind, where[0], id=f"{name}-{kind.replace(' ', '_')}")


@pytest.mark.parametrize("name,kind,at", list(_mutation_cases()))
def test_a_changed_expectation_fails_the_replay(name, kind, at):
    header, ops = _trace(name)
    ops = copy.deepcopy(ops)
    _, _, field, mutate = MUTATIONS[kind]
    mutate(ops[at]["expect"])
    with pytest.raises(Divergence) as e:
        replay(reference_target(), header["config"], iter(enumerate(ops, start=1)))
    assert (e.value.index, e.value.field) == (at + 1, field), str(e.value)


def test_every_trace_has_the_required_mutations():
    """Each trace is mutated at least in a slot index, a head, a mask hash, a blob byte and a kvhash."""
    cases = {(p.values[0], p.values[1]) for p in _mutation_cases()}
    for name in NAMES:
        for kind in ("slot index", "head", "mask hash", "blob byte", "kvhash"):
            assert (name, kind) in cases, (name, kind)


def test_a_changed_input_blob_fails_at_the_next_kvhash():
    """A K/V byte of a blob that a read takes changes what the next kvhash sees."""
    header, ops = _trace("v03_multistream_nsm4")
    ops = copy.deepcopy(ops)
    at = next(i for i, op in enumerate(ops) if op["op"] == "state_read" and op["expect"]["ok"]
              and len(op["hex"]) > 1000 and any(o["op"] == "kvhash" for o in ops[i + 1:i + 4]))
    blob = ops[at]["hex"]
    # a sequence of stream 2 of 4: the blob ends with the last V element of stream 2, then the
    # cell count 0 of stream 3
    assert ops[at]["seq_id"] == 2 and blob.endswith("00000000")
    ops[at]["hex"] = _flip_hex(blob, len(blob) - 9)
    with pytest.raises(Divergence) as e:
        replay(reference_target(), header["config"], iter(enumerate(ops, start=1)))
    assert e.value.op == "kvhash" and e.value.index > at + 1


@pytest.mark.parametrize("op", [{"op": "commit"}, {"op": "restore"}, {"op": "defrag", "n_max_nodes": 64},
                                {"op": "k_shift"}, {"op": "clear", "data": False}, {"op": "teleport"}],
                         ids=["commit", "restore", "defrag", "k_shift", "clear-no-data", "unknown"])
def test_ops_kvcache_trace_2026_does_not_have_fail_the_replay(op):
    header, ops = _trace(NAMES[0])
    with pytest.raises(Divergence) as e:
        replay(reference_target(), header["config"], iter(enumerate([ops[0], {**op, "expect": {}}], start=1)))
    assert (e.value.index, e.value.field) == (2, "op")


def test_a_config_the_target_disagrees_with_fails_at_the_header():
    header, ops = _trace(NAMES[0])
    config = {**header["config"], "n_stream": 2}
    with pytest.raises(Divergence) as e:
        replay(reference_target(), config, iter(enumerate(ops[:1], start=1)))
    assert (e.value.index, e.value.field) == (0, "config.n_stream")


def test_a_target_that_cannot_build_the_cache_fails_at_the_header():
    def refuse(config):
        raise TypeError("no semantics '2026' here")
    header, ops = _trace(NAMES[0])
    with pytest.raises(Divergence) as e:
        replay(Target("refusing", refuse, reference_target().make_ubatch, family=FAMILY), header["config"],
               iter(enumerate(ops, start=1)))
    assert (e.value.index, e.value.field) == (0, "config") and "no semantics" in str(e.value)


# --- the CLI --------------------------------------------------------------------------------------

def test_cli_names_the_target_and_fails_on_a_divergence(tmp_path):
    env = kvcache_env()
    path = TRACES[0]
    good = subprocess.run([sys.executable, "-m", "kvcache.conformance", "--target", "reference", str(path)],
                          capture_output=True, text=True, env=env)
    assert good.returncode == 0, good.stdout + good.stderr
    assert f"ok   {path} " in good.stdout and "(reference model)" in good.stdout
    assert "1 passed, 0 failed" in good.stdout
    header, ops = _trace(path.stem)
    ops = copy.deepcopy(ops)
    at = next(i for i, op in enumerate(ops) if op["op"] == "find_slot")
    MUTATIONS["head"][3](ops[at]["expect"])
    bad_path = tmp_path / "bad.jsonl"
    bad_path.write_text("\n".join(json.dumps(x) for x in [header, *ops]) + "\n")
    bad = subprocess.run([sys.executable, "-m", "kvcache.conformance", "--target", "reference", str(path),
                          str(bad_path)], capture_output=True, text=True, env=env)
    assert bad.returncode == 1
    assert f"FAIL {bad_path} (reference model): op #{at + 1} (find_slot): heads" in bad.stdout
    assert "1 passed, 1 failed" in bad.stdout


def test_cli_replays_both_formats():
    """A kvcache-trace/1 file is reported as before (no target), a 2026 one with the target that
    ran it (by default the C-backed cache once it has the 2026 semantics)."""
    old = sorted((GOLDEN / "unified").glob("*.jsonl"))[0]
    res = subprocess.run([sys.executable, "-m", "kvcache.conformance", str(old), str(TRACES[0])],
                         capture_output=True, text=True, env=kvcache_env())
    assert res.returncode == 0, res.stdout
    lines = res.stdout.strip().splitlines()
    assert lines[0].startswith(f"ok   {old} (") and lines[0].endswith(" ops)")
    assert lines[1].startswith(f"ok   {TRACES[0]} (") and lines[1].endswith(f" ops) ({default_target().name})")
    assert lines[2] == "2 passed, 0 failed"


# --- the diagnostic info ----------------------------------------------------------------------------

def _state(model) -> tuple:
    """Everything of a reference model that rules C7 / C8 keep."""
    streams = [(list(t.pos), [sorted(s) for s in t.seq], list(t.shift), t.has_shift, t.head) for t in model.streams]
    data = [(model.k(il).tobytes(), model.v(il).tobytes()) for il in model.layers]
    return streams, model.pending_copies, data


def _llama_undo_changes(model, target, ubatches) -> bool:
    """Whether llama.cpp's own undo of prepare would leave the cache changed: it puts back only
    the cells each slot listed, and the head of the stream of group g from the saved head of
    stream g."""
    m = copy.deepcopy(model)
    before = _state(m)
    undo = []
    for u in ubatches:
        pos, ids, groups = m._ubatch(target.make_ubatch(u["pos"], u["seq_id"]))
        slot = m._find_slot(groups)
        if slot is None:
            break
        saved = [[(m.streams[s].pos[i], set(m.streams[s].seq[i])) for i in idxs.tolist()] for s, idxs in slot]
        undo.append((slot, list(m.heads), saved))
        m._apply(slot, groups, pos, ids)
    for slot, heads, saved in reversed(undo):
        for g, ((strm, idxs), cells) in enumerate(zip(slot, saved)):
            t = m.streams[strm]
            for i, (p, ss) in zip(idxs.tolist(), cells):
                t.pos[i], t.seq[i] = p, ss
            t.head = heads[g]
    return _state(m) != before


def _llama_failed_read_changes(model, op) -> bool:
    """Whether llama.cpp's failure path would leave the cache changed by a failed read: nothing
    before the stream count is taken; after it, ``state_clear`` — the whole cache cleared, or
    the destination sequence removed and the K/V of the cells it had been given zeroed. (The
    traces fail only on the stream count and inside K/V sections.)"""
    assert op.get("note") == "n_stream+1" or op.get("note", "").startswith("truncated"), op.get("note")
    m = copy.deepcopy(model)
    before = _state(m)
    seq_id = op["seq_id"]
    with pytest.raises(StateError):
        m._read(_Reader(memoryview(bytes.fromhex(op["hex"])), "cache state"), seq_id)
    if op["note"] == "n_stream+1":
        assert _state(m) == before
    elif seq_id == -1:
        m.clear()
    else:
        t = m.streams[m.stream_of(seq_id)]
        given = [i for i in range(t.size) if seq_id in t.seq[i]]
        t.remove(seq_id, -1, -1)
        for il in m.layers:
            rows = [m.stream_of(seq_id) * t.size + i for i in given]
            m._k[il][rows] = 0
            if m.v_trans:
                m._v[il][m.stream_of(seq_id)][:, given] = 0
            else:
                m._v[il][rows] = 0
    return _state(m) != before


@pytest.mark.parametrize("name", NAMES)
def test_the_diagnostic_info_is_reproduced(name):
    header, ops = _trace(name)
    config = header["config"]
    target = reference_target()
    model = target.make_cache(config)
    check_config(model, config)
    r = Replay(target, config, model)
    n_read = n_prepare = 0
    for index, op in enumerate(ops, start=1):
        info = op.get("info", {})
        if op["op"] == "state_read":
            n_read += 1
            blob = bytes.fromhex(op["hex"])
            if op["expect"]["ok"]:
                trial = copy.deepcopy(model)
                assert trial.state_read(blob, op["seq_id"]) == info["consumed"], index
            else:
                assert info["restored"] == _llama_failed_read_changes(model, op), index
                with pytest.raises(StateError, match=f"^{info['error']}"):
                    copy.deepcopy(model).state_read(blob, op["seq_id"])
        elif op["op"] == "prepare":
            n_prepare += 1
            assert info.get("undo_restored", False) == _llama_undo_changes(model, target, op["ubatches"]), index
        compare_fields(index, op, op["expect"], apply_op(r, index, op) or {})
    assert n_read and n_prepare
