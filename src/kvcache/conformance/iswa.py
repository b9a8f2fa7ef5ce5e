"""Replay of ``iswa`` traces against :class:`kvcache.ISWACache` (golden/FORMAT.md): per-cache
expectations are ``{"base": ..., "swa": ...}``."""
from __future__ import annotations

import warnings
from typing import Iterator

from kvcache import ISWACache, SWAWarning
from kvcache.conformance import unsupported
from kvcache.conformance.common import (blob_fields, check_fields, defrag_fields, fill, k_shift_fields,
                                        mask_fields, read_ok, replay_ops, ubatch)

__all__ = ["make_cache", "replay"]


def make_cache(config: dict) -> ISWACache:
    """The cache a trace header describes."""
    cache = ISWACache(
        kv_size=config["kv_size"], n_layer=config["n_layer"],
        n_embd_k_gqa=config["n_embd_k_gqa"], n_embd_v_gqa=config["n_embd_v_gqa"],
        swa_layers=config["swa_layers"], n_swa=config["n_swa"], swa_type=config["swa_type"],
        n_batch=config["n_batch"], swa_full=config["swa_full"], type_k=config["type_k"],
        type_v=config["type_v"], v_trans=config["v_trans"], n_seq_max=config["n_seq_max"],
        n_pad=config["n_pad"])
    if (cache.size_base, cache.size_swa) != (config["size_base"], config["size_swa"]):
        raise ValueError(f"sub-cache sizes {cache.size_base}, {cache.size_swa} differ from the header's "
                         f"{config['size_base']}, {config['size_swa']}")
    return cache


def _run(cache: ISWACache, config: dict, index: int, op: dict) -> dict | None:
    """Apply one op; return the fields to compare with its expect."""
    name = op["op"]
    parts = (("base", cache.base), ("swa", cache.swa))
    if name == "find_slot":
        oks = cache.find_slot_each(ubatch(op))
        got = {"ok": all(oks)}
        for (key, sub), ok in zip(parts, oks):
            if ok:  # the fill rule: every sub-cache whose own find_slot succeeded
                fill(sub, config, op)
            got[key] = {"ok": ok, "head": sub.head, "n": sub.n, "used": sub.used}
        return got
    if name == "sbatch_init":
        return {"pending": cache.sbatch_init(op["pos"], op["seq_id"])}
    if name == "commit":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", SWAWarning)  # diagnostic, like the reference's log line
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
        return {key: check_fields(sub) for key, sub in parts}
    elif name == "mask":
        masks = cache.kq_mask(ubatch(op), causal=op["causal"], alibi=bool(config.get("use_alibi")))
        return {key: mask_fields(m, op["expect"].get(key, {})) for (key, _), m in zip(parts, masks)}
    elif name == "k_shift":
        shifts = cache.k_shift()
        got = {key: k_shift_fields(sub, shift) for (key, sub), shift in zip(parts, shifts)}
        cache.reset_shift()
        return got
    elif name == "defrag":
        # what update() does in each sub-cache
        return {key: defrag_fields(index, sub, op["n_max_nodes"]) for key, sub in parts}
    elif name == "defrag_sched":
        cache.defrag_sched(op["thold"])
        return {key: {"do_defrag": sub.do_defrag} for key, sub in parts}
    elif name == "state_write":
        return blob_fields(cache.state_write(op["seq_id"]), op["expect"])
    elif name == "state_read":
        return read_ok(cache.state_read, op)
    else:
        raise unsupported(index, op)
    return {}


def replay(config: dict, ops: Iterator[tuple[int, dict]]) -> None:
    """Replay the ops of an iswa trace against a fresh cache; raise Divergence on mismatch."""
    cache = make_cache(config)
    replay_ops(ops, lambda index, op: _run(cache, config, index, op))
