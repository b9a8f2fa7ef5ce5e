"""Replay of ``split`` traces: batches cut into ubatches by :class:`kvcache.Batch`."""
from __future__ import annotations

from typing import Any, Iterator

from kvcache import Batch
from kvcache.conformance import compare, unsupported

_METHODS = {"simple": "split_simple", "equal": "split_equal", "seq": "split_seq"}


def _describe(ub) -> dict[str, Any]:
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


def replay(config: dict, ops: Iterator[tuple[int, dict]]) -> None:
    """Replay every ``split`` op: split the whole batch, compare ubatches and out_ids."""
    for index, op in ops:
        if op.get("op") != "split" or op.get("mode") not in _METHODS:
            raise unsupported(index, op)
        batch = Batch(op["pos"], op["seq_id"], output=op["logits"],
                      logits_all=bool(op.get("logits_all", False)),
                      simple_split=bool(op["simple_split"]))
        split = getattr(batch, _METHODS[op["mode"]])
        got = []
        while (ub := split(op["n_ubatch"])) is not None:
            got.append(_describe(ub))
        expect = op["expect"]
        want = expect["ubatches"]
        for k in range(min(len(want), len(got))):
            for field in want[k]:
                compare(index, op, f"ubatches[{k}].{field}", want[k][field], got[k].get(field))
        compare(index, op, "ubatches (count)", len(want), len(got))
        compare(index, op, "out_ids", expect["out_ids"], batch.out_ids.tolist())
        compare(index, op, "n_tokens_left", 0, batch.n_tokens_left)
