"""Replay of ``iswa`` traces against :class:`kvcache.ISWACache` (golden/FORMAT.md): per-cache
expectations are ``{"base": ..., "swa": ...}``."""
from __future__ import annotations

import re
import warnings
from typing import Any, Iterator

from kvcache import ISWACache, SWAWarning
from kvcache.conformance import Divergence, unsupported
from kvcache.conformance.common import (seq_op, blob_fields, check_fields, defrag_fields, fill, k_shift_fields,
                                        mask_fields, read_state, replay_ops, ubatch)

__all__ = ["make_cache", "replay"]

_PMIN = re.compile(r"pmin = (-?\d+)")


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


def _partial_pmins(messages: list[str]) -> list[int]:
    """The pmin of every partial-window report among log lines or warning messages, in order."""
    return [int(m.group(1)) for m in map(_PMIN.search, messages) if m and "partial SWA cache" in m.string]


def _run(cache: ISWACache, config: dict, index: int, op: dict, strict_info: bool) -> dict | None:
    """Apply one op; return the fields to compare with its expect. With strict_info, the
    diagnostics must match too: the partial-window reports of a commit (by pmin) and the bytes
    a successful state_read consumed."""
    name = op["op"]
    shared = seq_op(cache, op)
    if shared is not None:
        return shared
    info = op.get("info", {})
    parts = (("base", cache.base), ("swa", cache.swa))
    if name == "find_slot":
        oks = cache.find_slot_each(ubatch(op))
        got: dict[str, Any] = {"ok": all(oks)}
        for (key, sub), ok in zip(parts, oks):
            if ok:  # the fill rule: every sub-cache whose own find_slot succeeded
                fill(sub, config, op)
            got[key] = {"ok": ok, "head": sub.head, "n": sub.n, "used": sub.used}
        return got
    if name == "sbatch_init":
        return {"pending": cache.sbatch_init(op["pos"], op["seq_id"])}
    if name == "commit":
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", SWAWarning)  # reported like the reference's log line
            cache.commit()
        if strict_info:
            # compared as multisets: the reference visits the sequences in hash-map order, and
            # pruning one sequence does not affect another
            want = sorted(_partial_pmins(info.get("log", [])))
            got_pmins = sorted(_partial_pmins([str(w.message) for w in caught if issubclass(w.category, SWAWarning)]))
            if want != got_pmins:
                raise Divergence(index, name, "info.log (partial SWA cache, pmin)", want, got_pmins)
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
        consumed = read_state(cache.state_read, op)
        if strict_info and consumed is not None and consumed != info.get("n_read"):
            raise Divergence(index, name, "info.n_read", info.get("n_read"), consumed)
        return {"ok": consumed is not None}
    else:
        raise unsupported(index, op)
    return {}


def replay(config: dict, ops: Iterator[tuple[int, dict]], strict_info: bool = False) -> None:
    """Replay the ops of an iswa trace against a fresh cache; raise Divergence on mismatch.
    strict_info also compares the diagnostics (see _run)."""
    cache = make_cache(config)
    replay_ops(ops, lambda index, op: _run(cache, config, index, op, strict_info))
