"""The trace ops in one table: for every op of the golden traces, how each family applies it to
a cache and what is compared.

``OPS[name][family]`` applies op ``name`` to a :class:`~conformance.Replay` (a cache of
a :class:`~conformance.Target` of that family; the ops of split and rope traces need no
cache) and returns the fields it produced, which :func:`compare_op` holds against the op's
``expect`` by the rules of :func:`conformance.common.compare_fields` and the op's entry in
:data:`FIELDS` (what a trace may leave out, what is compared within a tolerance, and the
family's cap on it). A family without an entry in OPS for an op does not have it: applying it
is a divergence. The runner (:func:`replay`), the replays against the reference models and the
property tests, which apply the same ops to a model and to a cache (:func:`apply_both`), all
go through these tables.

An op may carry what no trace line has: ``n_seq_tokens`` in a unified ubatch (equal splits;
the traces' unified ubatches are simple splits), and no ``expect`` (nothing to compare)."""
from __future__ import annotations

import hashlib
from typing import Any, Callable, Iterator

import numpy as np

from conformance import Divergence, Replay, Target, compare, unsupported
from conformance import iswa, recurrent, rope, split, unified, unified2026
from conformance.common import EXACT, Fields, blob_fields, compare_fields, read_state, replay_ops

__all__ = ["OPS", "FIELDS", "CACHE_FAMILIES", "start", "apply_op", "compare_op", "apply_both", "replay"]

#: how an op is applied: (replay, index, op) -> the fields it produced (None: nothing to compare)
Apply = Callable[[Replay, int, dict[str, Any]], dict[str, Any] | None]

#: the families whose traces replay against a cache (split and rope need none)
CACHE_FAMILIES = (unified.FAMILY, iswa.FAMILY, recurrent.FAMILY, unified2026.FAMILY)
_FORMAT_1_CACHES = (unified.FAMILY, iswa.FAMILY, recurrent.FAMILY)


# --- the ops every cache family applies the same way ---------------------------------------------

def _call(r: Replay, index: int, op: dict[str, Any]) -> dict[str, Any]:
    """commit, restore, clear, set_full: the method of that name, nothing to compare."""
    getattr(r.cache, op["op"])()
    return {}


def _seq_rm(r: Replay, index: int, op: dict[str, Any]) -> dict[str, Any]:
    return {"ret": r.cache.seq_rm(op["seq_id"], op["p0"], op["p1"])}


def _seq_cp(r: Replay, index: int, op: dict[str, Any]) -> dict[str, Any]:
    r.cache.seq_cp(op["src"], op["dst"], op["p0"], op["p1"])
    return {}


def _seq_keep(r: Replay, index: int, op: dict[str, Any]) -> dict[str, Any]:
    r.cache.seq_keep(op["seq_id"])
    return {}


def _seq_add(r: Replay, index: int, op: dict[str, Any]) -> dict[str, Any]:
    r.cache.seq_add(op["seq_id"], op["p0"], op["p1"], op["shift"])
    return {}


def _seq_div(r: Replay, index: int, op: dict[str, Any]) -> dict[str, Any]:
    r.cache.seq_div(op["seq_id"], op["p0"], op["p1"], op["d"])
    return {}


def _pos_bucket(r: Replay, index: int, op: dict[str, Any]) -> dict[str, Any]:
    """The T5 position buckets of the ubatch: shape, hash and values."""
    b = r.cache.pos_bucket(r.ubatch(op), r.config["n_rel_attn_bkts"])
    return {"rows": b.shape[0], "cols": b.shape[1],
            "sha256": hashlib.sha256(np.ascontiguousarray(b, dtype="<i4").tobytes()).hexdigest(),
            "data": b.ravel().tolist()}


def _state_write(**layout: Any) -> Apply:
    def state_write(r: Replay, index: int, op: dict[str, Any]) -> dict[str, Any]:
        """Length, hash and bytes of the blob."""
        return blob_fields(r.cache.state_write(op["seq_id"], **layout))
    return state_write


def _state_read(consumed: str, **layout: str) -> Apply:
    def state_read(r: Replay, index: int, op: dict[str, Any]) -> dict[str, Any]:
        """Whether the cache takes the blob; strictly, also the bytes a successful read
        consumed, where the trace's info records them (under the key ``consumed``)."""
        n = read_state(lambda blob, seq_id: r.cache.state_read(blob, seq_id, **layout), op)
        info = op.get("info", {})
        if r.strict and n is not None and consumed in info:
            compare(index, op, f"info.{consumed}", info[consumed], n)
        return {"ok": n is not None}
    return state_read


def _each(value: Any, *families: str) -> dict[str, Any]:
    return {family: value for family in families}


#: every trace op: name -> {family -> how it is applied}
OPS: dict[str, dict[str, Apply]] = {
    "find_slot": {unified.FAMILY: unified.find_slot, iswa.FAMILY: iswa.find_slot,
                  recurrent.FAMILY: recurrent.find_slot, unified2026.FAMILY: unified2026.find_slot},
    "prepare": {unified2026.FAMILY: unified2026.prepare},
    "sbatch_init": {iswa.FAMILY: iswa.sbatch_init},
    "commit": {unified.FAMILY: _call, iswa.FAMILY: iswa.commit, recurrent.FAMILY: _call},
    "restore": _each(_call, *_FORMAT_1_CACHES),
    "clear": {**_each(_call, *_FORMAT_1_CACHES), unified2026.FAMILY: unified2026.clear},
    "set_full": _each(_call, *_FORMAT_1_CACHES),
    "seq_rm": _each(_seq_rm, *CACHE_FAMILIES),
    "seq_cp": {**_each(_seq_cp, *_FORMAT_1_CACHES), unified2026.FAMILY: unified2026.seq_cp},
    "seq_keep": _each(_seq_keep, *CACHE_FAMILIES),
    "seq_add": _each(_seq_add, *CACHE_FAMILIES),
    "seq_div": _each(_seq_div, *CACHE_FAMILIES),
    "check": {unified.FAMILY: unified.check, iswa.FAMILY: iswa.check, recurrent.FAMILY: recurrent.check,
              unified2026.FAMILY: unified2026.check},
    "mask": {unified.FAMILY: unified.mask, iswa.FAMILY: iswa.mask, unified2026.FAMILY: unified2026.mask},
    "pos_bucket": _each(_pos_bucket, unified.FAMILY, unified2026.FAMILY),
    "k_shift": {unified.FAMILY: unified.k_shift, iswa.FAMILY: iswa.k_shift},
    "defrag": {unified.FAMILY: unified.defrag, iswa.FAMILY: iswa.defrag},
    "defrag_sched": {unified.FAMILY: unified.defrag_sched, iswa.FAMILY: iswa.defrag_sched,
                     recurrent.FAMILY: recurrent.defrag_sched},
    "update": {unified2026.FAMILY: unified2026.update},
    "s_copy": {recurrent.FAMILY: recurrent.s_copy},
    "s_mask": {recurrent.FAMILY: recurrent.s_mask},
    # kvcache-trace/1 holds the seed's bytes (layout "2025"); kvcache-trace/2026 the cache-level
    # memory state of today's layout, without the sequence-blob prefix of llama_state_seq_get_data
    "state_write": {**_each(_state_write(layout="2025"), *_FORMAT_1_CACHES),
                    unified2026.FAMILY: _state_write(layout="2026", prefix=False)},
    "state_read": {**_each(_state_read("n_read", layout="2025"), *_FORMAT_1_CACHES),
                   unified2026.FAMILY: _state_read("consumed", layout="2026")},
    "kvhash": {unified2026.FAMILY: unified2026.kvhash},
    "split": {split.FAMILY: split.split},
    "rope_shift": {rope.FAMILY: rope.rope_shift},
}

# why a trace may leave out a produced field: the formats list the values only of small results
_MASK_DATA = "listed only for masks of rows * cols <= 4096 (golden/FORMAT.md); sha256 covers every value"
_BUCKET_DATA = "listed only for rows * cols <= 4096 (golden/FORMAT.md, FORMAT-2026.md); sha256 covers every value"
_BLOB_HEX = "listed only for blobs of len <= 8192 (golden/FORMAT.md, FORMAT-2026.md); sha256 covers every byte"

#: how the fields of an op are held against a trace beyond the rules every family shares (every
#: produced field listed, compared exactly, no unknown expectation key): name -> {family ->
#: Fields}; an op of a family without an entry here is compared by those rules alone
FIELDS: dict[str, dict[str, Fields]] = {
    "mask": {unified.FAMILY: Fields(optional={"data": _MASK_DATA}),
             iswa.FAMILY: Fields(optional={"base.data": _MASK_DATA, "swa.data": _MASK_DATA})},
    "pos_bucket": _each(Fields(optional={"data": _BUCKET_DATA}), unified.FAMILY, unified2026.FAMILY),
    "state_write": _each(Fields(optional={"hex": _BLOB_HEX}), *CACHE_FAMILIES),
    "rope_shift": {rope.FAMILY: rope.FIELDS},
}

# what a family checks of a header's config beyond building the cache
_CONFIG_CHECKS: dict[str, Callable[[Any, dict[str, Any]], None]] = {unified2026.FAMILY: unified2026.check_config}


def start(target: Target, config: dict[str, Any], strict: bool = False) -> Replay:
    """A fresh cache of ``target`` for a trace header's config, under replay (``strict``: the
    diagnostic info is compared too). A target that cannot build the cache, or a cache that
    disagrees with the config, fails the trace at its header."""
    try:
        cache = target.make_cache(config)
    except Exception as e:  # noqa: BLE001 - a target that cannot build the cache fails the trace
        raise Divergence(0, "header", "config", f"a cache of {target.name}", repr(e)) from e
    check = _CONFIG_CHECKS.get(target.family)
    if check is not None:
        check(cache, config)
    return Replay(target, config, cache, strict)


def _shown(r: Replay) -> Any:
    """What a check shows of the cache (None for families without check)."""
    check = OPS["check"].get(r.target.family)
    return None if check is None else check(r, 0, {"op": "check"})


def apply_op(r: Replay, index: int, op: dict[str, Any]) -> dict[str, Any] | None:
    """Apply op number ``index`` of a trace to the replay's cache; return the fields to compare
    with its ``expect``. Raises Divergence for an op the family does not have, and when an op
    expecting an exception raises one but leaves the cache changed (rule C5: a rejected call
    changes nothing that a check shows)."""
    apply = OPS.get(op.get("op", "?"), {}).get(r.target.family)
    if apply is None:
        raise unsupported(index, op)
    if "exception" not in op.get("expect", {}):
        return apply(r, index, op)
    before = _shown(r)
    try:
        return apply(r, index, op)
    except Exception:
        after = _shown(r)
        if after != before:
            raise Divergence(index, op["op"], "state after a rejected call", before, after) from None
        raise


def compare_op(r: Replay, index: int, op: dict[str, Any], got: dict[str, Any] | None) -> None:
    """Hold the fields op number ``index`` produced against its ``expect`` (Divergence at the
    first difference), by the rules every family shares and the op's entry in :data:`FIELDS`."""
    fields = FIELDS.get(op.get("op", "?"), {}).get(r.target.family, EXACT)
    compare_fields(index, op, op.get("expect", {}), got or {}, fields, r.config)


def apply_both(model: Replay, cache: Replay, op: dict[str, Any], index: int = 0) -> dict[str, Any]:
    """Apply one op to a model and to a cache: the model's fields are what the cache's must be,
    all of them, exactly (Divergence at the first difference). Returns the model's fields."""
    want = apply_op(model, index, op) or {}
    compare_fields(index, op, want, apply_op(cache, index, op) or {})
    return want


def _modelled(r: Replay, ops: Iterator[tuple[int, dict[str, Any]]]) -> Iterator[tuple[int, dict[str, Any]]]:
    """The ops the target models; each other op is replaced as the target says, in order."""
    for index, op in ops:
        instead = r.target.instead.get(op.get("op", "?"))
        if instead is None:
            yield index, op
            continue
        try:
            instead(r.cache, op)
        except Exception as e:  # noqa: BLE001 - a crash at an op is a divergence there
            raise Divergence(index, op["op"], "exception", None, repr(e)) from e


def replay(target: Target, config: dict[str, Any], ops: Iterator[tuple[int, dict[str, Any]]],
           strict: bool = False) -> None:
    """Replay the ops of a trace, ``(index, op)`` pairs, against a fresh cache of ``target``;
    raise Divergence at the first mismatch. ``strict``: the diagnostic info is compared too."""
    r = start(target, config, strict)
    replay_ops(_modelled(r, ops), lambda index, op: apply_op(r, index, op),
               lambda index, op, got: compare_op(r, index, op, got))
