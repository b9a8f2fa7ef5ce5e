"""``kvcache-trace/2026`` unified traces (golden/FORMAT-2026.md, family ``unified2026``): their
targets and the ops only they have.

The replay talks to the cache through a small protocol, the API of the C-backed
``kvcache.UnifiedCache(semantics="2026")``; :class:`reference2026.UnifiedReference2026`
implements all of it, the C-backed cache all but the state blobs (until they come,
``kvcache_target(state=False)`` replays a trace's ops before its first ``state_read``). A :class:`~conformance.Target` names an implementation and makes
its caches and ubatches.

The target protocol (``cache`` made by ``Target.make_cache(config)``):

Construction
    ``make_cache(config)`` builds, from a trace header's ``config``, the cache of
    ``UnifiedCache(kv_size, n_layer, n_embd_k_gqa, n_embd_v_gqa, type_k, type_v, v_trans,
    n_seq_max, n_pad, n_swa, swa_type, layers=..., semantics="2026", kv_unified=...)`` (keyword
    arguments as :func:`cache_arguments` gives them; ``kv_size`` cells per stream, the
    ``n_embd_*`` lists per model layer). ``make_ubatch(pos, seq_id)`` builds a ubatch of one
    entry per token (``seq_id``: a list of ids per token), as the trace lists it; with several
    streams the cache takes the tokens grouped per sequence (groups in order of appearance).

Attributes
    ``n_stream`` (int), ``n_seq_max`` (int), ``layers`` (tuple of model layer indices);
    ``heads``, ``used_per_stream``, ``used_max_p1_per_stream``, ``n_kv_per_stream`` (tuples of
    int, one per stream); ``has_shift`` (bool: any stream); ``pending_copies`` (int: stream
    copies queued for the next update).

Placement
    ``find_slot(ub) -> bool`` places the ubatch for good (``find_slot(cont=false)`` +
    ``apply_ubatch``); a failed one changes nothing. ``slot_info()`` after it: a list, one entry
    per token group, of ``(stream: int, cells: int32 ndarray)`` — token ``g * n_seq_tokens + i``
    went to ``cells[i]`` of the stream. ``store(il, k_rows, v_rows)`` writes the float rows
    (``[n_tokens, n_embd]``, ubatch order) of model layer ``il`` into those cells.
    ``prepare(ubatches) -> list of slot infos | None`` is the dry run of rule C8.

Sequences
    ``clear()`` (cells and K/V data); ``seq_rm(seq_id, p0, p1) -> bool``; ``seq_cp(src, dst,
    p0, p1)``; ``seq_keep(seq_id)``; ``seq_add(seq_id, p0, p1, shift)``; ``seq_div(seq_id, p0,
    p1, d)``; ``seq_pos_min(seq_id)`` / ``seq_pos_max(seq_id) -> int``.

Update
    ``update()`` returns an object with ``status`` (int: 0 success, 1 nothing to do),
    ``had_shift`` (bool, before), ``copies`` (int, stream copies performed), ``has_shift``
    (bool, after) and ``shift`` (int32 ndarray ``[n_stream * kv_size]``, the K-shift input read
    before the update).

Attention inputs
    ``kq_mask(ub, causal=True, pad=False)`` -> float32 ndarray ``[streams, rows, n_kv]``
    (0 visible, -inf hidden); ``pos_bucket(ub, n_buckets)`` -> int32 ndarray ``[n_tokens, n_kv]``.

Data and state
    ``k(il)`` / ``v(il)`` -> ndarrays holding every byte of the layer's K / V tensor (all streams,
    llama.cpp's order: K rows ``stream * kv_size + cell``, V likewise or transposed per stream);
    ``stream_cells()`` -> one snapshot per stream whose ``nonempty()`` lists ``[cell, pos, [seq ids
    ascending], shift]`` by cell; ``state_write(seq_id, layout="2026") -> bytes`` (the cache-level
    blob, without the sequence-blob prefix); ``state_read(blob, seq_id, layout="2026") -> int``
    (bytes consumed) raising ``kvcache.StateError`` — and changing nothing — when it fails.

Derived by the replay, not asked of the target: ``s0``/``s1`` (the smallest / largest stream of the slot),
``n_kv_ubatch`` (the largest ``n_kv_per_stream`` over the slot's streams), the mask's ``visible``
lists and every hash.
"""
from __future__ import annotations

import hashlib
from typing import Any, Callable, Sequence

import numpy as np

from conformance import Divergence, Replay, Target, unsupported
from conformance.common import fill
from conformance.unified import float32_mask

__all__ = ["Target", "FAMILY", "cache_arguments", "reference_target", "kvcache_target", "default_target", "TARGETS",
           "check_config"]

#: the family of these traces (the key of their ops in :data:`conformance.ops.OPS`)
FAMILY = "unified2026"


def cache_arguments(config: dict[str, Any]) -> dict[str, Any]:
    """The constructor arguments of the cache a trace header's config describes."""
    return dict(
        kv_size=config["kv_size"], n_layer=config["n_layer"],
        n_embd_k_gqa=config["n_embd_k_gqa"], n_embd_v_gqa=config["n_embd_v_gqa"],
        type_k=config["type_k"], type_v=config["type_v"], v_trans=config["v_trans"],
        n_seq_max=config["n_seq_max"], n_pad=config["n_pad"], n_swa=config["n_swa"],
        swa_type=config["swa_type"], layers=config["layers"], semantics="2026",
        kv_unified=config["kv_unified"], **{k: config[k] for k in ("cell_ext", "ple_token") if k in config})


def reference_target() -> Target:
    """The pure-Python reference model (:mod:`reference2026`)."""
    from reference import RefUBatch
    from reference2026 import UnifiedReference2026
    return Target("reference model", lambda config: UnifiedReference2026(**cache_arguments(config)), RefUBatch,
                  family=FAMILY)


def kvcache_target() -> Target:
    """The C-backed ``kvcache.UnifiedCache(semantics="2026")``."""
    from kvcache import UBatch, UnifiedCache
    return Target("kvcache.UnifiedCache", lambda config: UnifiedCache(**cache_arguments(config)), UBatch,
                  family=FAMILY)


def default_target() -> Target:
    """The C-backed cache."""
    return kvcache_target()


#: the targets ``python -m conformance --target`` names
TARGETS: dict[str, Callable[[], Target]] = {
    "auto": default_target, "reference": reference_target, "kvcache": kvcache_target,
}


def _sha256(a: np.ndarray, dtype: str) -> str:
    return hashlib.sha256(np.ascontiguousarray(a, dtype=dtype).tobytes()).hexdigest()


def _bytes_sha256(a: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()


def _slot_fields(slot: Sequence[tuple[int, np.ndarray]]) -> dict[str, Any]:
    return {"strm": [int(s) for s, _ in slot], "idxs": [[int(c) for c in cells] for _, cells in slot]}


def _stream_fields(cache: Any) -> dict[str, Any]:
    return {"heads": list(cache.heads), "used": list(cache.used_per_stream), "n_kv": list(cache.n_kv_per_stream)}


def _check_fields(cache: Any) -> dict[str, Any]:
    cells = [[s, *cell] for s, snap in enumerate(cache.stream_cells()) for cell in snap.nonempty()]
    return {
        **_stream_fields(cache),
        "used_max_p1": list(cache.used_max_p1_per_stream),
        "cells": cells,
        "seq_pos": [[s, cache.seq_pos_min(s), cache.seq_pos_max(s)] for s in range(cache.n_seq_max)],
        "has_shift": bool(cache.has_shift),
        # the per-cell extension of every non-empty cell, for a cache that has one
        **({"ext": [[s, i, *snap.ext[i].tolist()] for s, snap in enumerate(cache.stream_cells())
                    for i in np.flatnonzero(snap.pos != -1).tolist()]} if getattr(cache, "cell_ext", False) else {}),
    }


def _mask_fields(m: np.ndarray) -> dict[str, Any]:
    streams, rows, cols = m.shape
    flat = m.reshape(streams * rows, cols)
    return {"rows": rows, "cols": cols, "streams": streams, "sha256": _sha256(m, "<f4"),
            "visible": [np.flatnonzero(row == 0.0).tolist() for row in flat]}


def check_config(cache: Any, config: dict[str, Any]) -> None:
    """Raise Divergence when a trace's config asks what the replay does not do (ALiBi masks)
    or the cache disagrees with it (its stream count)."""
    if config.get("use_alibi"):
        raise Divergence(0, "header", "config.use_alibi", "supported", "ALiBi masks are not replayed")
    if cache.n_stream != config["n_stream"]:
        raise Divergence(0, "header", "config.n_stream", config["n_stream"], cache.n_stream)


# --- the ops (the table: conformance.ops.OPS) ------------------------------------------

def find_slot(r: Replay, index: int, op: dict[str, Any]) -> dict[str, Any]:
    """Place the ubatch for good and fill its K/V rows; where it went, or that it did not fit
    (a failed find_slot changes nothing)."""
    cache = r.cache
    if not cache.find_slot(r.ubatch(op)):
        return {"ok": False, **_stream_fields(cache)}
    if r.target.data:
        fill(cache, r.config, op)
    slot = cache.slot_info()
    streams = [int(s) for s, _ in slot]
    n_kv = cache.n_kv_per_stream
    return {"ok": True, **_slot_fields(slot), "s0": min(streams), "s1": max(streams),
            "n_kv_ubatch": max(n_kv[s] for s in streams), **_stream_fields(cache)}


def prepare(r: Replay, index: int, op: dict[str, Any]) -> dict[str, Any]:
    """The dry run of placing several ubatches (rule C8)."""
    slots = r.cache.prepare([r.ubatch(u) for u in op["ubatches"]])
    return {"ok": slots is not None, "sinfos": [_slot_fields(s) for s in slots or []]}


def clear(r: Replay, index: int, op: dict[str, Any]) -> dict[str, Any]:
    """Clear cells and K/V data (the traces have no clear that keeps the data)."""
    if op.get("data") is not True:
        raise unsupported(index, op)
    r.cache.clear()
    return {}


def seq_cp(r: Replay, index: int, op: dict[str, Any]) -> dict[str, Any]:
    """Copy a sequence; the stream copies now queued for the next update."""
    r.cache.seq_cp(op["src"], op["dst"], op["p0"], op["p1"])
    return {"pending_copies": r.cache.pending_copies}


def update(r: Replay, index: int, op: dict[str, Any]) -> dict[str, Any]:
    """Run the update (queued stream copies, the K-shift); what it did."""
    u = r.cache.update()
    return {"status": int(u.status), "had_shift": bool(u.had_shift), "copies": int(u.copies),
            "has_shift": bool(u.has_shift), "shift": np.asarray(u.shift).tolist()}


def check(r: Replay, index: int, op: dict[str, Any]) -> dict[str, Any]:
    """What a check shows of every stream."""
    return _check_fields(r.cache)


def mask(r: Replay, index: int, op: dict[str, Any]) -> dict[str, Any]:
    """The KQ mask of the ubatch, per stream."""
    return _mask_fields(float32_mask(index, op, r.cache.kq_mask(r.ubatch(op), causal=op["causal"])))


def kvhash(r: Replay, index: int, op: dict[str, Any]) -> dict[str, Any]:
    """The hashes of every layer's K and V tensors."""
    return {"layers": [{"il": il, "k": _bytes_sha256(r.cache.k(il)), "v": _bytes_sha256(r.cache.v(il))}
                       for il in r.cache.layers]}
