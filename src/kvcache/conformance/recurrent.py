"""Replay of ``recurrent`` traces against :class:`kvcache.RecurrentCache`."""
from __future__ import annotations

import hashlib
import warnings
from typing import Any, Iterator

import numpy as np

from kvcache import RecurrentCache, StateError, UBatch
from kvcache.conformance import Divergence, compare, expected_exception, unsupported



def make_cache(config: dict) -> RecurrentCache:
    """The cache a trace header describes (its widths already include the state parts)."""
    return RecurrentCache(
        n_seq_max=config["n_seq_max"],
        n_layer=config["n_layer"],
        n_embd_k_gqa=config["n_embd_k_gqa"],
        n_embd_v_gqa=config["n_embd_v_gqa"],
        type_k=config["type_k"],
        type_v=config["type_v"],
        kv_size=config["kv_size"],
    )


def fill_rows(cache: RecurrentCache, ub: UBatch) -> None:
    """The traces' K/V data rule after a successful find_slot: group g of the ubatch writes
    cell head + g of every layer, from its last position and its first sequence id."""
    k_tok = ub.n_seq_tokens
    pos = ub.pos
    p = np.array([pos[k_tok * g + k_tok - 1] for g in range(ub.n_seqs)], dtype=np.int64)[:, None]
    s = np.array([ids[0] for ids in ub.seq_id], dtype=np.int64)[:, None]
    for il in range(cache.n_layer):
        ek = np.arange(cache.n_embd_k[il], dtype=np.int64)[None, :]
        ev = np.arange(cache.n_embd_v[il], dtype=np.int64)[None, :]
        k = ((il * 7 + p * 3 + s * 5 + ek) % 61 - 30) / 4.0
        v = ((il * 11 + p * 5 + s * 3 + ev * 2) % 53 - 26) / 4.0
        cache.store(il, k, v)


def check_state(cache: RecurrentCache) -> dict:
    """The ``check`` view of the cache."""
    snap = cache.cells()
    cells = []
    for i in range(cache.size):
        pos, src, tail, ids = int(snap["pos"][i]), int(snap["src"][i]), int(snap["tail"][i]), snap["seq_id"][i]
        if pos >= 0 or src >= 0 or tail >= 0 or ids:
            cells.append([i, pos, ids, src, tail])
    seq_pos = [[s, cache.seq_pos_min(s), cache.seq_pos_max(s)] for s in range(cache.n_seq_max)]
    return {"head": cache.head, "n": cache.n, "used": cache.used, "cells": cells, "seq_pos": seq_pos}


def _blob_expect(blob: bytes, exp: dict) -> dict:
    got = {"len": len(blob), "sha256": hashlib.sha256(blob).hexdigest()}
    if "hex" in exp:
        got["hex"] = blob.hex()
    return got


def _run(cache: RecurrentCache, i: int, op: dict, strict_log: bool) -> Any:
    """Perform one op; returns what its ``expect`` is compared with."""
    name = op["op"]
    exp = op["expect"]
    if name == "find_slot":
        ub = UBatch(op["pos"], op["seq_id"], n_seq_tokens=op["n_seq_tokens"])
        if ub.n_seqs != op["n_seqs"]:
            raise Divergence(i, name, "n_seqs", op["n_seqs"], ub.n_seqs)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            ok = cache.find_slot(ub)
        if strict_log:
            want = [m for m in op.get("info", {}).get("log", []) if m.startswith("find_slot:")]
            compare(i, op, "info.log", want, cache.warnings)
        if ok:
            fill_rows(cache, ub)
        return {"ok": ok, "head": cache.head, "n": cache.n, "used": cache.used}
    if name in ("commit", "restore", "clear", "set_full"):
        getattr(cache, name)()
        return {}
    if name == "defrag_sched":
        cache.defrag_sched(op["thold"])
        return {}
    if name == "seq_rm":
        return {"ret": cache.seq_rm(op["seq_id"], op["p0"], op["p1"])}
    if name == "seq_cp":
        cache.seq_cp(op["src"], op["dst"], op["p0"], op["p1"])
        return {}
    if name == "seq_keep":
        cache.seq_keep(op["seq_id"])
        return {}
    if name == "seq_add":
        cache.seq_add(op["seq_id"], op["p0"], op["p1"], op["shift"])
        return {}
    if name == "seq_div":
        cache.seq_div(op["seq_id"], op["p0"], op["p1"], op["d"])
        return {}
    if name == "check":
        return check_state(cache)
    if name == "s_copy":
        return {"values": [int(x) for x in cache.s_copy()]}
    if name == "s_mask":
        return {"values": [float(x) for x in cache.s_mask()]}
    if name == "state_write":
        return _blob_expect(cache.state_write(op["seq_id"]), exp)
    if name == "state_read":
        data = bytes.fromhex(op["hex"])
        try:
            n_read = cache.state_read(data, op["seq_id"])
        except StateError:
            return {"ok": False}
        if strict_log and "n_read" in op.get("info", {}):
            compare(i, op, "info.n_read", op["info"]["n_read"], n_read)
        return {"ok": True}
    raise unsupported(i, op)


def replay(config: dict, ops: Iterator[tuple[int, dict]], strict_log: bool = False) -> None:
    """Replay a recurrent trace; raises Divergence at the first mismatch.

    With ``strict_log`` the diagnostic ``info`` is checked too: the find_slot warnings and the
    bytes a successful state_read consumed."""
    cache = make_cache(config)
    for i, op in ops:
        exp = op["expect"]
        raises = expected_exception(i, op)
        try:
            got = _run(cache, i, op, strict_log)
        except Divergence:
            raise
        except (ValueError, TypeError, IndexError) as e:
            if raises is not None and isinstance(e, raises):
                continue
            raise Divergence(i, op.get("op", "?"), "exception", exp, f"{type(e).__name__}: {e}") from e
        if raises is not None:
            raise Divergence(i, op.get("op", "?"), "exception", exp, got)
        for key in exp:
            compare(i, op, key, exp[key], got.get(key))
        for key in got:
            if key not in exp:
                raise Divergence(i, op.get("op", "?"), key, "absent", got[key])
