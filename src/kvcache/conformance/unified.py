"""Replay of ``unified`` traces against :class:`kvcache.UnifiedCache` (golden/FORMAT.md)."""
from __future__ import annotations

import hashlib
from typing import Iterator

from kvcache import UnifiedCache
from kvcache.conformance import unsupported
from kvcache.conformance.common import (seq_op, INVALID_ARGUMENT, blob_fields, check_fields, defrag_fields, fill,
                                        fill_rows, k_shift_fields, mask_fields, read_state, replay_ops, ubatch)

__all__ = ["INVALID_ARGUMENT", "fill", "fill_rows", "make_cache", "replay"]


def make_cache(config: dict) -> UnifiedCache:
    """The cache a trace header describes (n_embd lists are per model layer)."""
    return UnifiedCache(
        kv_size=config["kv_size"], n_layer=config["n_layer"],
        n_embd_k_gqa=config["n_embd_k_gqa"], n_embd_v_gqa=config["n_embd_v_gqa"],
        type_k=config["type_k"], type_v=config["type_v"], v_trans=config["v_trans"],
        n_seq_max=config["n_seq_max"], n_pad=config["n_pad"], n_swa=config["n_swa"],
        swa_type=config["swa_type"], layers=config["layers"])


def _run(cache: UnifiedCache, config: dict, index: int, op: dict) -> dict | None:
    """Apply one op; return the fields to compare with its expect (None: nothing to compare)."""
    name = op["op"]
    shared = seq_op(cache, op)
    if shared is not None:
        return shared
    if name == "find_slot":
        ok = cache.find_slot(ubatch(op))
        if ok:
            fill(cache, config, op)
        return {"ok": ok, "head": cache.head, "n": cache.n, "used": cache.used}
    if name == "commit":
        cache.commit()
    elif name == "check":
        return check_fields(cache)
    elif name == "mask":
        m = cache.kq_mask(ubatch(op), causal=op["causal"], alibi=bool(config.get("use_alibi")))
        return mask_fields(m, op["expect"])
    elif name == "pos_bucket":
        b = cache.pos_bucket(ubatch(op), config["n_rel_attn_bkts"])
        got = {"rows": b.shape[0], "cols": b.shape[1],
               "sha256": hashlib.sha256(b.astype("<i4").tobytes()).hexdigest()}
        if "data" in op["expect"]:
            got["data"] = b.ravel().tolist()
        return got
    elif name == "k_shift":
        got = k_shift_fields(cache, cache.k_shift())
        cache.reset_shift()
        return got
    elif name == "defrag":
        return defrag_fields(index, cache, op["n_max_nodes"])
    elif name == "defrag_sched":
        cache.defrag_sched(op["thold"])
        return {"do_defrag": cache.do_defrag}
    elif name == "state_write":
        return blob_fields(cache.state_write(op["seq_id"]), op["expect"])
    elif name == "state_read":
        return {"ok": read_state(cache.state_read, op) is not None}
    else:
        raise unsupported(index, op)
    return {}


def replay(config: dict, ops: Iterator[tuple[int, dict]]) -> None:
    """Replay the ops of a unified trace against a fresh cache; raise Divergence on mismatch."""
    cache = make_cache(config)
    replay_ops(ops, lambda index, op: _run(cache, config, index, op))
