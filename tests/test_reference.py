"""The pure-Python reference model against the unified golden traces.

Every metadata expectation of the traces (find_slot results, checks, masks, position
buckets, K-shift inputs, defrag plans, defrag scheduling, rejected calls) is compared.
K/V data is not modelled, so state_write is skipped; a state_read is applied through its
cell metadata only (the blob's cells, placed as the reference places them) when the trace
says it succeeded."""
import glob
import hashlib
import json
import os
import struct

import numpy as np
import pytest

from kvcache.reference import RefUBatch, UnifiedReference, relative_position_bucket

GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden")
TRACES = sorted(glob.glob(os.path.join(GOLDEN, "unified", "*.jsonl")))


class Mismatch(AssertionError):
    pass


def _expect(index, op, field, expected, got):
    if expected != got:
        raise Mismatch(f"op #{index} ({op['op']}): {field}: expected {expected!r:.300}, got {got!r:.300}")


def _blob_cells(blob: bytes, seq_id: int):
    """(pos, [seq ids]) of each cell listed in the first part of a unified state blob."""
    (count,), off = struct.unpack_from("<I", blob, 0), 4
    cells = []
    for _ in range(count):
        pos, n_ids = struct.unpack_from("<iI", blob, off)
        off += 8
        ids = list(struct.unpack_from(f"<{n_ids}i", blob, off))
        off += 4 * n_ids
        cells.append((pos, ids))
    return cells


def _state_read(model: UnifiedReference, seq_id: int, blob: bytes) -> None:
    """The cell effects of a successful state_read (C1b: an empty part removes the sequence)."""
    cells = _blob_cells(blob, seq_id)
    if seq_id == -1:
        model.clear()
        for i, (pos, ids) in enumerate(cells):
            model.pos[i] = pos
            model.seq[i] = set(ids)
        model.head = 0
        return
    model.seq_rm(seq_id, -1, -1)
    if cells:
        ub = RefUBatch(pos=[p for p, _ in cells], seq_id=[[seq_id]] * len(cells))
        assert model.find_slot(ub)
        model.commit()


def _ubatch(op):
    return RefUBatch(pos=op["pos"], seq_id=op["seq_id"])


def _sha(arr, dtype) -> str:
    return hashlib.sha256(np.ascontiguousarray(arr, dtype=dtype).astype(np.dtype(dtype).newbyteorder("<")).tobytes()).hexdigest()


def replay(config, ops):
    """Replay one trace against a fresh model; raise Mismatch at the first difference."""
    model = UnifiedReference(kv_size=config["kv_size"], n_seq_max=config["n_seq_max"],
                             n_pad=config["n_pad"], n_swa=config["n_swa"],
                             swa_type=config["swa_type"], n_layer=len(config["layers"]))
    assert config["kq_mask_pad"] == 64
    for index, op in enumerate(ops, start=1):
        name, exp = op["op"], op["expect"]
        if name == "state_write":
            continue
        if "exception" in exp:
            _expect(index, op, "exception", "invalid_argument", exp["exception"])
            before = (list(model.pos), [set(s) for s in model.seq], list(model.shift), model.head, model.n)
            with pytest.raises(ValueError):
                if name == "find_slot":
                    model.find_slot(_ubatch(op))
                elif name in ("mask", "pos_bucket"):
                    model.kq_mask(_ubatch(op))
                elif name == "seq_rm":
                    model.seq_rm(op["seq_id"], op["p0"], op["p1"])
                elif name == "seq_cp":
                    model.seq_cp(op["src"], op["dst"], op["p0"], op["p1"])
                elif name == "seq_keep":
                    model.seq_keep(op["seq_id"])
                elif name == "seq_add":
                    model.seq_add(op["seq_id"], op["p0"], op["p1"], op["shift"])
                elif name == "seq_div":
                    model.seq_div(op["seq_id"], op["p0"], op["p1"], op["d"])
                elif name == "state_read":
                    if op["seq_id"] == -1 or 0 <= op["seq_id"] < model.n_seq_max:
                        raise Mismatch(f"op #{index}: state_read of a valid id expected to be rejected")
                    raise ValueError("invalid seq_id")
                else:
                    raise Mismatch(f"op #{index}: unexpected exception op {name}")
            after = (list(model.pos), [set(s) for s in model.seq], list(model.shift), model.head, model.n)
            _expect(index, op, "state after a rejected call", before, after)
            continue
        if name == "find_slot":
            ok = model.find_slot(_ubatch(op))
            _expect(index, op, "ok", exp["ok"], ok)
            _expect(index, op, "head/n/used", [exp["head"], exp["n"], exp["used"]],
                    [model.head, model.n, model.used])
        elif name == "commit":
            model.commit()
        elif name == "restore":
            model.restore()
        elif name == "clear":
            model.clear()
        elif name == "set_full":
            model.set_full()
        elif name == "seq_rm":
            _expect(index, op, "ret", exp["ret"], model.seq_rm(op["seq_id"], op["p0"], op["p1"]))
        elif name == "seq_cp":
            model.seq_cp(op["src"], op["dst"], op["p0"], op["p1"])
        elif name == "seq_keep":
            model.seq_keep(op["seq_id"])
        elif name == "seq_add":
            model.seq_add(op["seq_id"], op["p0"], op["p1"], op["shift"])
        elif name == "seq_div":
            model.seq_div(op["seq_id"], op["p0"], op["p1"], op["d"])
        elif name == "check":
            _expect(index, op, "head/n/used", [exp["head"], exp["n"], exp["used"]],
                    [model.head, model.n, model.used])
            _expect(index, op, "cells", exp["cells"], model.cells().nonempty())
            seq_pos = [[s, model.seq_pos_min(s), model.seq_pos_max(s)] for s in range(model.n_seq_max)]
            _expect(index, op, "seq_pos", exp["seq_pos"], seq_pos)
            _expect(index, op, "has_shift", exp["has_shift"], model.has_shift)
        elif name == "mask":
            m = model.kq_mask(_ubatch(op), causal=op["causal"], alibi=config["use_alibi"])
            _expect(index, op, "shape", [exp["rows"], exp["cols"]], list(m.shape))
            if "data" in exp:
                data = [float("-inf") if v == "-inf" else float(v) for v in exp["data"]]
                _expect(index, op, "data", data, m.ravel().tolist())
            _expect(index, op, "sha256", exp["sha256"], _sha(m, np.float32))
        elif name == "pos_bucket":
            b = model.pos_bucket(_ubatch(op), config["n_rel_attn_bkts"])
            _expect(index, op, "shape", [exp["rows"], exp["cols"]], list(b.shape))
            if "data" in exp:
                _expect(index, op, "data", exp["data"], b.ravel().tolist())
            _expect(index, op, "sha256", exp["sha256"], _sha(b, np.int32))
        elif name == "k_shift":
            _expect(index, op, "has_shift", exp["has_shift"], model.has_shift)
            _expect(index, op, "shift", exp["shift"], model.k_shift().tolist())
            model.reset_shift()
        elif name == "defrag":
            ret = model.defrag_prepare(op["n_max_nodes"])
            _expect(index, op, "ret", exp["ret"], ret)
            _expect(index, op, "ids", exp["ids"], list(model.defrag_ids))
            model.do_defrag = False
        elif name == "defrag_sched":
            model.defrag_sched(op["thold"])
            _expect(index, op, "do_defrag", exp["do_defrag"], model.do_defrag)
        elif name == "state_read":
            if exp["ok"]:
                _state_read(model, op["seq_id"], bytes.fromhex(op["hex"]))
        else:
            raise Mismatch(f"op #{index}: op {name!r} is not replayed by this test")


@pytest.mark.parametrize("path", TRACES, ids=os.path.basename)
def test_reference_model_replays_unified_trace(path):
    with open(path, encoding="utf-8") as f:
        lines = [json.loads(line) for line in f if line.strip()]
    header = lines[0]
    assert header["format"] == "kvcache-trace/1" and header["kind"] == "unified"
    replay(header["config"], lines[1:])


def test_traces_are_present():
    assert len(TRACES) >= 12


def test_replay_detects_a_wrong_expectation():
    """The replay must be able to fail: corrupt one recorded head and expect a mismatch."""
    with open(TRACES[0], encoding="utf-8") as f:
        lines = [json.loads(line) for line in f if line.strip()]
    ops = lines[1:]
    k = next(i for i, op in enumerate(ops) if op["op"] == "check")
    ops[k]["expect"]["head"] += 1
    with pytest.raises(Mismatch):
        replay(lines[0]["config"], ops)


@pytest.mark.parametrize("p0,p1,n_buckets,expected", [
    (5, 5, 32, 0), (3, 5, 32, 2), (9, 5, 32, 0), (-1, 0, 32, 1),
    (0, 15, 32, 15), (0, 16, 32, 16), (0, 1000, 32, 31), (0, 127, 32, 31),
])
def test_relative_position_bucket(p0, p1, n_buckets, expected):
    assert relative_position_bucket(p0, p1, n_buckets) == expected
