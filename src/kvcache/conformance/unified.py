"""Replay of ``unified`` traces against :class:`kvcache.UnifiedCache` (golden/FORMAT.md)."""
from __future__ import annotations

import hashlib
import math
from typing import Any, Iterator

import numpy as np

from kvcache import StateError, UBatch, UnifiedCache
from kvcache.conformance import Divergence, compare, unsupported

#: what an op expecting {"exception": "invalid_argument"} must raise
INVALID_ARGUMENT = (ValueError, IndexError, TypeError)


def make_cache(config: dict) -> UnifiedCache:
    """The cache a trace header describes (n_embd lists are per model layer)."""
    return UnifiedCache(
        kv_size=config["kv_size"], n_layer=config["n_layer"],
        n_embd_k_gqa=config["n_embd_k_gqa"], n_embd_v_gqa=config["n_embd_v_gqa"],
        type_k=config["type_k"], type_v=config["type_v"], v_trans=config["v_trans"],
        n_seq_max=config["n_seq_max"], n_pad=config["n_pad"], n_swa=config["n_swa"],
        swa_type=config["swa_type"], layers=config["layers"])


def fill_rows(il: int, pos: np.ndarray, seq: np.ndarray, n_embd_k: int, n_embd_v: int):
    """The K and V rows the fill rule gives model layer il for tokens (pos, first seq id)."""
    ek = np.arange(n_embd_k, dtype=np.int64)
    ev = np.arange(n_embd_v, dtype=np.int64)
    bk = (il * 7 + pos * 3 + seq * 5)[:, None] + ek[None, :]
    bv = (il * 11 + pos * 5 + seq * 3)[:, None] + 2 * ev[None, :]
    k = ((bk % 61 - 30) / 4.0).astype(np.float32)
    v = ((bv % 53 - 26) / 4.0).astype(np.float32)
    return k, v


def fill(cache: UnifiedCache, config: dict, op: dict) -> None:
    """Write the fill rule's K/V rows for the ubatch the last find_slot placed."""
    pos = np.asarray(op["pos"], dtype=np.int64)
    seq = np.asarray([ids[0] for ids in op["seq_id"]], dtype=np.int64)
    for il in cache.layers:
        k, v = fill_rows(il, pos, seq, config["n_embd_k_gqa"][il], config["n_embd_v_gqa"][il])
        cache.store(il, k, v)


def _float_list(a: np.ndarray) -> list:
    return ["-inf" if math.isinf(x) and x < 0 else x for x in a.ravel().tolist()]


def _check(cache: UnifiedCache) -> dict:
    return {
        "head": cache.head, "n": cache.n, "used": cache.used,
        "cells": cache.cells().nonempty(),
        "seq_pos": [[s, cache.seq_pos_min(s), cache.seq_pos_max(s)] for s in range(cache.n_seq_max)],
        "has_shift": cache.has_shift,
    }


def _compare_fields(index: int, op: dict, expect: dict, got: dict) -> None:
    for key, want in expect.items():
        if key not in got:
            raise Divergence(index, op.get("op", "?"), key, want, "<not produced>")
        compare(index, op, key, want, got[key])


def _ubatch(op: dict) -> UBatch:
    return UBatch(op["pos"], op["seq_id"])


def _run(cache: UnifiedCache, config: dict, index: int, op: dict) -> dict | None:
    """Apply one op; return the fields to compare with its expect (None: nothing to compare)."""
    name = op["op"]
    if name == "find_slot":
        ub = _ubatch(op)
        ok = cache.find_slot(ub)
        if ok:
            fill(cache, config, op)
        return {"ok": ok, "head": cache.head, "n": cache.n, "used": cache.used}
    if name == "commit":
        cache.commit()
    elif name == "restore":
        cache.restore()
    elif name == "clear":
        cache.clear()
    elif name == "set_full":
        cache.set_full()
    elif name == "seq_rm":
        return {"ret": cache.seq_rm(op["seq_id"], op["p0"], op["p1"])}
    elif name == "seq_cp":
        cache.seq_cp(op["src"], op["dst"], op["p0"], op["p1"])
    elif name == "seq_keep":
        cache.seq_keep(op["seq_id"])
    elif name == "seq_add":
        cache.seq_add(op["seq_id"], op["p0"], op["p1"], op["shift"])
    elif name == "seq_div":
        cache.seq_div(op["seq_id"], op["p0"], op["p1"], op["d"])
    elif name == "check":
        return _check(cache)
    elif name == "mask":
        m = cache.kq_mask(_ubatch(op), causal=op["causal"], alibi=bool(config.get("use_alibi")))
        got = {"rows": m.shape[0], "cols": m.shape[1],
               "sha256": hashlib.sha256(m.astype("<f4").tobytes()).hexdigest()}
        if "data" in op["expect"]:
            got["data"] = _float_list(m)
        return got
    elif name == "pos_bucket":
        b = cache.pos_bucket(_ubatch(op), config["n_rel_attn_bkts"])
        got = {"rows": b.shape[0], "cols": b.shape[1],
               "sha256": hashlib.sha256(b.astype("<i4").tobytes()).hexdigest()}
        if "data" in op["expect"]:
            got["data"] = b.ravel().tolist()
        return got
    elif name == "k_shift":
        got = {"has_shift": cache.has_shift, "shift": cache.k_shift().tolist()}
        cache.reset_shift()
        return got
    elif name == "defrag":
        ret = cache.defrag_prepare(op["n_max_nodes"])
        got = {"ret": ret, "ids": cache.defrag_ids.tolist()}
        cache.defrag_move()
        if cache.do_defrag:
            raise Divergence(index, name, "do_defrag", False, True)
        return got
    elif name == "defrag_sched":
        cache.defrag_sched(op["thold"])
        return {"do_defrag": cache.do_defrag}
    elif name == "state_write":
        blob = cache.state_write(op["seq_id"])
        got = {"len": len(blob), "sha256": hashlib.sha256(blob).hexdigest()}
        if "hex" in op["expect"]:
            got["hex"] = blob.hex()
        return got
    elif name == "state_read":
        data = bytes.fromhex(op["hex"])
        try:
            cache.state_read(data, op["seq_id"])
            ok = True
        except StateError:
            ok = False
        return {"ok": ok}
    else:
        raise unsupported(index, op)
    return {}


def replay(config: dict, ops: Iterator[tuple[int, dict]]) -> None:
    """Replay the ops of a unified trace against a fresh cache; raise Divergence on mismatch."""
    cache = make_cache(config)
    for index, op in ops:
        expect: dict[str, Any] = op.get("expect", {})
        name = op.get("op", "?")
        if "exception" in expect:
            try:
                _run(cache, config, index, op)
            except INVALID_ARGUMENT:
                continue
            except Divergence:
                raise
            except Exception as e:  # noqa: BLE001 - any other failure is a divergence
                raise Divergence(index, name, "exception", expect["exception"], repr(e)) from e
            raise Divergence(index, name, "exception", expect["exception"], "no exception")
        try:
            got = _run(cache, config, index, op)
        except Divergence:
            raise
        except Exception as e:  # noqa: BLE001 - a crash at an op is a divergence there
            raise Divergence(index, name, "exception", None, repr(e)) from e
        _compare_fields(index, op, expect, got)
