"""The rules every family is compared by (:class:`Fields`, :func:`compare_fields`), the replay
loop, and pieces shared by the ops of unified and iSWA traces: the K/V fill rule, the fields of a
unified (sub-)cache's check / mask / k_shift / defrag / state ops."""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping

import numpy as np

from kvcache import StateError, UnifiedCache
from conformance import EXCEPTION_KINDS, Divergence, _short, compare, expected_exception

#: what an op expecting {"exception": "invalid_argument"} must raise
INVALID_ARGUMENT = EXCEPTION_KINDS["invalid_argument"]


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
    """Write the fill rule's K/V rows for the ubatch the last find_slot placed in this cache
    (every layer it holds, by model layer index). A token's sequence is the first id of its
    group (of ``n_seq_tokens`` tokens, one in the traces)."""
    pos = np.asarray(op["pos"], dtype=np.int64)
    seq = np.repeat(np.asarray([ids[0] for ids in op["seq_id"]], dtype=np.int64), op.get("n_seq_tokens", 1))
    for il in cache.layers:
        k, v = fill_rows(il, pos, seq, config["n_embd_k_gqa"][il], config["n_embd_v_gqa"][il])
        cache.store(il, k, v)


def float_list(a: np.ndarray) -> list:
    """Mask values as the traces list them ("-inf" for negative infinity)."""
    values = a.ravel().astype(object)   # Python floats, made in C: masks reach millions of values
    values[np.isneginf(a.ravel())] = "-inf"
    return values.tolist()


def check_fields(cache: UnifiedCache) -> dict:
    """A `check` of one unified (sub-)cache."""
    return {
        "head": cache.head, "n": cache.n, "used": cache.used,
        "cells": cache.cells().nonempty(),
        "seq_pos": [[s, cache.seq_pos_min(s), cache.seq_pos_max(s)] for s in range(cache.n_seq_max)],
        "has_shift": cache.has_shift,
    }


def mask_fields(m: np.ndarray) -> dict:
    """Shape, hash and values of a KQ mask."""
    return {"rows": m.shape[0], "cols": m.shape[1],
            "sha256": hashlib.sha256(m.astype("<f4").tobytes()).hexdigest(), "data": float_list(m)}


def k_shift_fields(cache: UnifiedCache, shift: np.ndarray) -> dict:
    """The `k_shift` fields of one cache, given the shift input read from it."""
    return {"has_shift": cache.has_shift, "shift": shift.tolist()}


def defrag_fields(index: int, cache: Any, n_max_nodes: int, data: bool = True) -> dict:
    """Plan a defrag of one cache, move its K/V rows as planned and report the plan (a cache
    without K/V data, ``data`` false, only has its flag cleared, as update() does)."""
    ret = cache.defrag_prepare(n_max_nodes)
    got = {"ret": ret, "ids": np.asarray(cache.defrag_ids).tolist()}
    if data:
        cache.defrag_move()
    else:
        cache.do_defrag = False
    if cache.do_defrag:
        raise Divergence(index, "defrag", "do_defrag", False, True)
    return got


def blob_fields(blob: bytes) -> dict:
    """Length, hash and bytes of a state blob."""
    return {"len": len(blob), "sha256": hashlib.sha256(blob).hexdigest(), "hex": blob.hex()}


def read_state(read: Callable[[bytes, int], int], op: dict) -> int | None:
    """Run a state_read op: the bytes consumed, or None when the cache rejects the blob."""
    try:
        return read(bytes.fromhex(op["hex"]), op["seq_id"])
    except StateError:
        return None


#: compares one produced field within an absolute tolerance, raising Divergence:
#: (index, op, config, field, expected, produced, atol) -> None
Within = Callable[[int, dict, dict, str, Any, Any, float], None]


def exact(config: dict, op: dict) -> float:
    """The tolerance cap of a comparison that must be exact: 0. The cache families' fields
    (cells, counters, masks, hashes, blobs) and split's ubatches are integers or bit patterns
    computed without libm, so any tolerance would only let a real difference pass."""
    return 0.0


@dataclass(frozen=True)
class Fields:
    """How the fields one family's op produces are held against a trace's expectation.

    ``optional``: produced fields (dotted paths: ``base.data``) a trace may leave out, each with
    the reason; ``inputs``: expectation keys that are no produced field but something the
    comparison takes from the trace, each with what it is; ``within``: produced fields compared
    within the op's tolerance (every other field exactly); ``atol_cap``: ``(config, op) ->`` the
    loosest absolute tolerance a trace may ask for the op (:func:`exact` by default)."""

    optional: Mapping[str, str] = field(default_factory=dict)
    inputs: Mapping[str, str] = field(default_factory=dict)
    within: Mapping[str, Within] = field(default_factory=dict)
    atol_cap: Callable[[dict, dict], float] = exact


#: an op compared exactly, every produced field listed by the trace
EXACT = Fields()


def tolerance(index: int, op: dict, cap: float) -> float:
    """The absolute tolerance an op's comparison uses: the ``atol`` its expectation asks for,
    never more than ``cap``; ``cap`` when it asks none. An ``atol`` that is not a finite number
    >= 0 is a divergence."""
    expect = op.get("expect", {})
    if "atol" not in expect:
        return cap
    atol = expect["atol"]
    if isinstance(atol, bool) or not isinstance(atol, (int, float)) or not math.isfinite(atol) or atol < 0:
        raise Divergence(index, op.get("op", "?"), "atol", "a finite number >= 0", atol)
    return min(float(atol), cap)


def compare_fields(index: int, op: dict, expect: dict, got: dict, fields: Fields = EXACT,
                   config: dict | None = None) -> None:
    """Hold the fields an op produced (``got``) against its expectation, by the rules every
    family shares: an expectation key the op does not produce fails (besides ``atol`` and the
    ``inputs`` of ``fields``); a produced field the expectation lacks fails unless ``fields``
    calls it optional; every other field is compared exactly, or within the op's tolerance
    (capped by ``fields.atol_cap``) when ``fields`` says so. Objects are compared key by key and
    lists of objects item by item, so a divergence names the innermost field."""
    config = config or {}
    atol = tolerance(index, op, fields.atol_cap(config, op))
    _compare_object(index, op, expect, got, "", {"atol", *fields.inputs}, fields, config, atol)


def _compare_object(index: int, op: dict, expect: dict, got: dict, path: str, known: set[str], fields: Fields,
                    config: dict, atol: float) -> None:
    name = op.get("op", "?")
    for key in expect:
        if key not in got and key not in known:
            raise Divergence(index, name, path + key, expect[key], "<not produced>",
                             reason=f"unknown expectation key at line {index + 1} "
                                    f"(the op produces {', '.join(got) or 'nothing'})")
    for key, have in got.items():
        where = path + key
        if key in expect:
            _compare_value(index, op, expect[key], have, where, fields, config, atol)
        elif where not in fields.optional:
            raise Divergence(index, name, where, "<not in the trace>", have,
                             reason=f"produced {_short(have)}, which the trace at line {index + 1} does not list")


def _compare_value(index: int, op: dict, want: Any, have: Any, where: str, fields: Fields, config: dict,
                   atol: float) -> None:
    within = fields.within.get(where)
    if within is not None:
        within(index, op, config, where, want, have, atol)
    elif isinstance(want, dict) and isinstance(have, dict):
        _compare_object(index, op, want, have, where + ".", set(), fields, config, atol)
    elif isinstance(want, list) and isinstance(have, list) and have and all(isinstance(h, dict) for h in have):
        for k, (w, h) in enumerate(zip(want, have)):
            _compare_value(index, op, w, h, f"{where}[{k}]", fields, config, atol)
        compare(index, op, f"{where} (count)", len(want), len(have))
    else:
        compare(index, op, where, want, have)


def replay_ops(ops: Iterator[tuple[int, dict]], run: Callable[[int, dict], dict | None],
               check: Callable[[int, dict, dict], None]) -> None:
    """Replay ops with run(index, op) -> the fields it produced, held against the op's
    expectation by check(index, op, fields); an op expecting an exception must raise one of the
    exceptions of its kind (an unknown kind is a divergence), and any other exception — of the
    op or of its comparison (a malformed expectation) — is a divergence at its op."""
    for index, op in ops:
        expect: dict[str, Any] = op.get("expect", {})
        name = op.get("op", "?")
        raises = expected_exception(index, op)
        if raises is not None:
            try:
                run(index, op)
            except raises:
                continue
            except Divergence:
                raise
            except Exception as e:  # noqa: BLE001 - any other failure is a divergence
                raise Divergence(index, name, "exception", expect["exception"], repr(e)) from e
            raise Divergence(index, name, "exception", expect["exception"], "no exception")
        try:
            check(index, op, run(index, op) or {})
        except Divergence:
            raise
        except Exception as e:  # noqa: BLE001 - a crash at an op is a divergence there
            raise Divergence(index, name, "exception", None, repr(e)) from e
