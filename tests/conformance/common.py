"""Pieces shared by the ops of unified and iSWA traces: the K/V fill rule, the fields of a
unified (sub-)cache's check / mask / k_shift / defrag / state ops, and the replay loop."""
from __future__ import annotations

import hashlib
import math
from typing import Any, Callable, Iterator

import numpy as np

from kvcache import StateError, UnifiedCache
from conformance import EXCEPTION_KINDS, Divergence, compare, expected_exception

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
    return ["-inf" if math.isinf(x) and x < 0 else x for x in a.ravel().tolist()]


def check_fields(cache: UnifiedCache) -> dict:
    """A `check` of one unified (sub-)cache."""
    return {
        "head": cache.head, "n": cache.n, "used": cache.used,
        "cells": cache.cells().nonempty(),
        "seq_pos": [[s, cache.seq_pos_min(s), cache.seq_pos_max(s)] for s in range(cache.n_seq_max)],
        "has_shift": cache.has_shift,
    }


def mask_fields(m: np.ndarray, expect: dict) -> dict:
    """Shape and hash of a KQ mask (and its values when the expectation lists them)."""
    got = {"rows": m.shape[0], "cols": m.shape[1],
           "sha256": hashlib.sha256(m.astype("<f4").tobytes()).hexdigest()}
    if "data" in expect:
        got["data"] = float_list(m)
    return got


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


def blob_fields(blob: bytes, expect: dict) -> dict:
    """Length and hash of a state blob (and its bytes when the expectation lists them)."""
    got = {"len": len(blob), "sha256": hashlib.sha256(blob).hexdigest()}
    if "hex" in expect:
        got["hex"] = blob.hex()
    return got


def read_state(read: Callable[[bytes, int], int], op: dict) -> int | None:
    """Run a state_read op: the bytes consumed, or None when the cache rejects the blob."""
    try:
        return read(bytes.fromhex(op["hex"]), op["seq_id"])
    except StateError:
        return None


def compare_fields(index: int, op: dict, expect: dict, got: dict) -> None:
    """Compare every expected key (a missing one is a divergence too)."""
    for key, want in expect.items():
        if key not in got:
            raise Divergence(index, op.get("op", "?"), key, want, "<not produced>")
        compare(index, op, key, want, got[key])


def replay_ops(ops: Iterator[tuple[int, dict]], run: Callable[[int, dict], dict | None]) -> None:
    """Replay ops with run(index, op) -> fields to compare; an op expecting an exception must
    raise one of the exceptions of its kind (an unknown kind is a divergence), and any other
    exception is a divergence at its op."""
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
            got = run(index, op)
        except Divergence:
            raise
        except Exception as e:  # noqa: BLE001 - a crash at an op is a divergence there
            raise Divergence(index, name, "exception", None, repr(e)) from e
        compare_fields(index, op, expect, got or {})
