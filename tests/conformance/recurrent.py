"""``recurrent`` traces (golden/FORMAT.md) against :class:`kvcache.RecurrentCache`: the K/V
fill rule of these traces, what a check shows, and the ops only they have."""
from __future__ import annotations

import warnings
from typing import Callable

import numpy as np

from kvcache import RecurrentCache, UBatch
from conformance import Replay, Target, common, compare
from conformance.unified import counters

__all__ = ["FAMILY", "make_cache", "fill_rows", "check_state", "kvcache_target", "default_target", "TARGETS"]

#: the family of these traces (the key of their ops in :data:`conformance.ops.OPS`)
FAMILY = "recurrent"


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
    cell head + g of every layer, the rows of the unified rule for its last position and its
    first sequence id (all of each layer's row: the state parts too)."""
    k_tok = ub.n_seq_tokens
    pos = ub.pos
    p = np.array([pos[k_tok * g + k_tok - 1] for g in range(ub.n_seqs)], dtype=np.int64)
    s = np.array([ids[0] for ids in ub.seq_id], dtype=np.int64)
    for il in range(cache.n_layer):
        cache.store(il, *common.fill_rows(il, p, s, cache.n_embd_k[il], cache.n_embd_v[il]))


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


def kvcache_target() -> Target:
    """The C-backed :class:`kvcache.RecurrentCache`."""
    return Target("kvcache.RecurrentCache", make_cache, UBatch, family=FAMILY)


def default_target() -> Target:
    """What ``python -m conformance`` replays recurrent traces against: the C-backed cache."""
    return kvcache_target()


#: the targets of recurrent traces, by short name
TARGETS: dict[str, Callable[[], Target]] = {"kvcache": kvcache_target}


# --- the ops (the table: conformance.ops.OPS) ------------------------------------------

def find_slot(r: Replay, index: int, op: dict) -> dict:
    """Place an equal-split ubatch (``seq_id`` per sequence), fill its states when it fits;
    strictly, the warnings must be the trace's find_slot log lines."""
    ub = r.ubatch(op)
    compare(index, op, "n_seqs", op["n_seqs"], ub.n_seqs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)   # a state that does not continue
        ok = r.cache.find_slot(ub)
    if r.strict:
        want = [m for m in op.get("info", {}).get("log", []) if m.startswith("find_slot:")]
        compare(index, op, "info.log", want, r.cache.warnings)
    if ok and r.target.data:
        fill_rows(r.cache, ub)
    return {"ok": ok, **counters(r.cache)}


def defrag_sched(r: Replay, index: int, op: dict) -> dict:
    """Schedule a defrag (a recurrent cache has no flag to show)."""
    r.cache.defrag_sched(op["thold"])
    return {}


def check(r: Replay, index: int, op: dict) -> dict:
    """What a check shows of the cache."""
    return check_state(r.cache)


def s_copy(r: Replay, index: int, op: dict) -> dict:
    """The state copy sources of cells head .. head + n - 1."""
    return {"values": [int(x) for x in r.cache.s_copy()]}


def s_mask(r: Replay, index: int, op: dict) -> dict:
    """The state masks of cells head .. head + n - 1."""
    return {"values": [float(x) for x in r.cache.s_mask()]}
