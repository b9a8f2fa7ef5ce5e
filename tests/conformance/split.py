"""``split`` traces (golden/FORMAT.md): batches cut into ubatches by :class:`kvcache.Batch`."""
from __future__ import annotations

from typing import Any, Callable

from kvcache import Batch, UBatch
from conformance import Replay, Target, compare, unsupported

__all__ = ["FAMILY", "kvcache_target", "default_target", "TARGETS"]

#: the family of these traces (the key of their ops in :data:`conformance.ops.OPS`)
FAMILY = "split"

_METHODS = {"simple": "split_simple", "equal": "split_equal", "seq": "split_seq"}


def kvcache_target() -> Target:
    """kvcache's batch splitter (:class:`kvcache.Batch`); these traces need no cache."""
    return Target("kvcache.Batch", lambda config: None, UBatch, family=FAMILY)


def default_target() -> Target:
    """What ``python -m conformance`` replays split traces against."""
    return kvcache_target()


#: the targets of split traces, by short name
TARGETS: dict[str, Callable[[], Target]] = {"kvcache": kvcache_target}


def _describe(ub: Any) -> dict[str, Any]:
    """A produced ubatch in the trace's encoding."""
    return {
        "n_tokens": ub.n_tokens,
        "n_seq_tokens": ub.n_seq_tokens,
        "n_seqs": ub.n_seqs,
        "equal_seqs": bool(ub.equal_seqs),
        "pos": ub.pos.tolist(),
        "seq_id": ub.seq_id,
        "output": [int(x) for x in ub.output],
    }


# --- the ops (the table: conformance.ops.OPS) ------------------------------------------

def split(r: Replay, index: int, op: dict) -> dict:
    """Split the whole batch, which must leave nothing over; the ubatches and out_ids."""
    if op.get("mode") not in _METHODS:
        raise unsupported(index, op)
    batch = Batch(op["pos"], op["seq_id"], output=op["logits"],
                  logits_all=bool(op.get("logits_all", False)),
                  simple_split=bool(op["simple_split"]))
    split = getattr(batch, _METHODS[op["mode"]])
    got = []
    while (ub := split(op["n_ubatch"])) is not None:
        got.append(_describe(ub))
    compare(index, op, "n_tokens_left", 0, batch.n_tokens_left)
    return {"ubatches": got, "out_ids": batch.out_ids.tolist()}
