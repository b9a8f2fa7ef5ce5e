"""``unified`` traces (golden/FORMAT.md): their targets — :class:`kvcache.UnifiedCache` and the
reference model :class:`reference.UnifiedReference` — and the ops only they have."""
from __future__ import annotations

from typing import Any, Callable

from kvcache import UnifiedCache
from conformance import Replay, Target, compare
from conformance.common import INVALID_ARGUMENT, check_fields, defrag_fields, fill, fill_rows, mask_fields
from conformance.common import k_shift_fields

__all__ = ["INVALID_ARGUMENT", "FAMILY", "fill", "fill_rows", "make_cache", "reference_arguments", "kvcache_target",
           "reference_target", "default_target", "TARGETS"]

#: the family of these traces (the key of their ops in :data:`conformance.ops.OPS`)
FAMILY = "unified"


def make_cache(config: dict) -> UnifiedCache:
    """The cache a trace header describes (n_embd lists are per model layer)."""
    return UnifiedCache(
        kv_size=config["kv_size"], n_layer=config["n_layer"],
        n_embd_k_gqa=config["n_embd_k_gqa"], n_embd_v_gqa=config["n_embd_v_gqa"],
        type_k=config["type_k"], type_v=config["type_v"], v_trans=config["v_trans"],
        n_seq_max=config["n_seq_max"], n_pad=config["n_pad"], n_swa=config["n_swa"],
        swa_type=config["swa_type"], layers=config["layers"])


def reference_arguments(config: dict) -> dict[str, Any]:
    """The arguments of the reference model of the cache a trace header describes (the model
    keeps cells only: no widths, types or layer filter)."""
    from reference import KQ_MASK_PAD
    if config.get("kq_mask_pad", KQ_MASK_PAD) != KQ_MASK_PAD:
        raise ValueError(f"the reference model pads mask rows to {KQ_MASK_PAD}, the trace to {config['kq_mask_pad']}")
    return dict(kv_size=config["kv_size"], n_seq_max=config["n_seq_max"], n_pad=config["n_pad"],
                n_swa=config["n_swa"], swa_type=config["swa_type"], n_layer=len(config["layers"]))


def _no_state(cache: Any, op: dict) -> None:
    """What the reference model does for a state_write: nothing (it holds no K/V data)."""


def _read_cells(cache: Any, op: dict) -> None:
    """What the reference model does for a state_read the trace says succeeded: take the cells
    the blob lists, as the cache would (a whole-cache read puts cell k of the blob into cell k;
    a single-sequence read replaces the sequence with the blob's cells placed as one ubatch, and
    an empty part removes it, rule C1b). A failed read changes nothing (rule C1)."""
    from reference import RefUBatch
    from kvcache.statefile import _Reader
    if not op["expect"].get("ok"):
        return
    seq_id = op["seq_id"]
    r = _Reader(memoryview(bytes.fromhex(op["hex"])), "cache state")
    cells = []
    for _ in range(r.u32("cell_count")):
        pos, n_ids = r.i32("pos"), r.u32("n_seq_id")
        cells.append((pos, [r.i32("seq_id") for _ in range(n_ids)]))
    if seq_id == -1:
        cache.clear()
        for i, (pos, ids) in enumerate(cells):
            cache.pos[i], cache.seq[i] = pos, set(ids)
        cache.head = 0
        return
    cache.seq_rm(seq_id, -1, -1)
    if cells:
        if not cache.find_slot(RefUBatch([p for p, _ in cells], [[seq_id]] * len(cells))):
            raise ValueError("the reference model finds no room for the cells of a blob the cache took")
        cache.commit()


def kvcache_target() -> Target:
    """The C-backed :class:`kvcache.UnifiedCache`."""
    from kvcache import UBatch
    return Target("kvcache.UnifiedCache", make_cache, UBatch, family=FAMILY)


def reference_target() -> Target:
    """The pure-Python reference model :class:`reference.UnifiedReference`: it keeps the
    cells only, so K/V data is not written or moved, a state_write is left out and a state_read
    takes the blob's cells when the trace says it succeeded (neither is compared)."""
    from reference import RefUBatch, UnifiedReference
    return Target("reference model", lambda config: UnifiedReference(**reference_arguments(config)), RefUBatch,
                  family=FAMILY, data=False, instead={"state_write": _no_state, "state_read": _read_cells})


def default_target() -> Target:
    """What ``python -m conformance`` replays unified traces against: the C-backed cache."""
    return kvcache_target()


#: the targets of unified traces, by short name
TARGETS: dict[str, Callable[[], Target]] = {"kvcache": kvcache_target, "reference": reference_target}


# --- the ops (the table: conformance.ops.OPS) ------------------------------------------

def counters(cache: Any) -> dict[str, Any]:
    """head, n and used of a unified (sub-)cache."""
    return {"head": cache.head, "n": cache.n, "used": cache.used}


def find_slot(r: Replay, index: int, op: dict) -> dict:
    """Place the ubatch, fill its K/V rows when it fits; the result and the counters."""
    ok = r.cache.find_slot(r.ubatch(op))
    if ok and r.target.data:
        fill(r.cache, r.config, op)
    return {"ok": ok, **counters(r.cache)}


def check(r: Replay, index: int, op: dict) -> dict:
    """What a check shows of the cache."""
    return check_fields(r.cache)


def float32_mask(index: int, op: dict, m: Any) -> Any:
    """A KQ mask, which must be float32 (the traces hash its float32 bytes)."""
    compare(index, op, "dtype", "float32", str(m.dtype))
    return m


def mask(r: Replay, index: int, op: dict) -> dict:
    """The KQ mask of the ubatch (ALiBi when the model's hparams say so)."""
    m = r.cache.kq_mask(r.ubatch(op), causal=op["causal"], alibi=bool(r.config.get("use_alibi")))
    return mask_fields(float32_mask(index, op, m))


def k_shift(r: Replay, index: int, op: dict) -> dict:
    """Read the K-shift input, then reset the shifts (what update() does after a K-shift)."""
    got = k_shift_fields(r.cache, r.cache.k_shift())
    r.cache.reset_shift()
    return got


def defrag(r: Replay, index: int, op: dict) -> dict:
    """Plan a defrag and carry it out (what update() does)."""
    return defrag_fields(index, r.cache, op["n_max_nodes"], r.target.data)


def defrag_sched(r: Replay, index: int, op: dict) -> dict:
    """Schedule a defrag; the flag after it."""
    r.cache.defrag_sched(op["thold"])
    return {"do_defrag": r.cache.do_defrag}
