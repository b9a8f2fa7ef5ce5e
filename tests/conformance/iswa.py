"""``iswa`` traces (golden/FORMAT.md) against :class:`kvcache.ISWACache`: per-cache
expectations are ``{"base": ..., "swa": ...}``; the ops only these traces have, or have per
sub-cache."""
from __future__ import annotations

import re
import warnings
from typing import Any, Callable

from kvcache import ISWACache, SWAWarning
from conformance import Divergence, Replay, Target
from conformance.common import check_fields, defrag_fields, fill, k_shift_fields, mask_fields
from conformance.unified import counters, float32_mask

__all__ = ["FAMILY", "make_cache", "kvcache_target", "default_target", "TARGETS"]

#: the family of these traces (the key of their ops in :data:`conformance.ops.OPS`)
FAMILY = "iswa"

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


def kvcache_target() -> Target:
    """The C-backed :class:`kvcache.ISWACache`."""
    from kvcache import UBatch
    return Target("kvcache.ISWACache", make_cache, UBatch, family=FAMILY)


def default_target() -> Target:
    """What ``python -m conformance`` replays iswa traces against: the C-backed cache."""
    return kvcache_target()


#: the targets of iswa traces, by short name
TARGETS: dict[str, Callable[[], Target]] = {"kvcache": kvcache_target}


def partial_pmins(messages: list[str]) -> list[int]:
    """The pmin of every partial-window report among log lines or warning messages, in order."""
    return [int(m.group(1)) for m in map(_PMIN.search, messages) if m and "partial SWA cache" in m.string]


# --- the ops (the table: conformance.ops.OPS) ------------------------------------------

def parts(cache: Any) -> tuple[tuple[str, Any], ...]:
    """The sub-caches by the keys of the expectations."""
    return (("base", cache.base), ("swa", cache.swa))


def find_slot(r: Replay, index: int, op: dict) -> dict:
    """Place the ubatch in both sub-caches; the fill rule writes every sub-cache whose own
    find_slot succeeded."""
    oks = r.cache.find_slot_each(r.ubatch(op))
    got: dict[str, Any] = {"ok": all(oks)}
    for (key, sub), ok in zip(parts(r.cache), oks):
        if ok and r.target.data:
            fill(sub, r.config, op)
        got[key] = {"ok": ok, **counters(sub)}
    return got


def sbatch_init(r: Replay, index: int, op: dict) -> dict:
    """Record a batch's pruning ranges; the pending ranges."""
    return {"pending": r.cache.sbatch_init(op["pos"], op["seq_id"])}


def commit(r: Replay, index: int, op: dict) -> dict:
    """Commit and slide the window; strictly, the partial-window reports must match the trace's
    log by pmin."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", SWAWarning)  # reported like the reference's log line
        r.cache.commit()
    if r.strict:
        # compared as multisets: the reference visits the sequences in hash-map order, and
        # pruning one sequence does not affect another
        want = sorted(partial_pmins(op.get("info", {}).get("log", [])))
        got = sorted(partial_pmins([str(w.message) for w in caught if issubclass(w.category, SWAWarning)]))
        if want != got:
            raise Divergence(index, op["op"], "info.log (partial SWA cache, pmin)", want, got)
    return {}


def check(r: Replay, index: int, op: dict) -> dict:
    """What a check shows of each sub-cache."""
    return {key: check_fields(sub) for key, sub in parts(r.cache)}


def mask(r: Replay, index: int, op: dict) -> dict:
    """The KQ mask of each sub-cache."""
    masks = r.cache.kq_mask(r.ubatch(op), causal=op["causal"], alibi=bool(r.config.get("use_alibi")))
    return {key: mask_fields(float32_mask(index, op, m)) for (key, _), m in zip(parts(r.cache), masks)}


def k_shift(r: Replay, index: int, op: dict) -> dict:
    """Read each sub-cache's K-shift input, then reset the shifts."""
    got = {key: k_shift_fields(sub, shift) for (key, sub), shift in zip(parts(r.cache), r.cache.k_shift())}
    r.cache.reset_shift()
    return got


def defrag(r: Replay, index: int, op: dict) -> dict:
    """What update() does in each sub-cache: plan a defrag and carry it out."""
    return {key: defrag_fields(index, sub, op["n_max_nodes"], r.target.data) for key, sub in parts(r.cache)}


def defrag_sched(r: Replay, index: int, op: dict) -> dict:
    """Schedule a defrag; each sub-cache's flag after it."""
    r.cache.defrag_sched(op["thold"])
    return {key: {"do_defrag": sub.do_defrag} for key, sub in parts(r.cache)}
