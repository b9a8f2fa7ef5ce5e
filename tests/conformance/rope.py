"""Replay of ``rope`` traces: RoPE K-shifts of explicit K tensors.

Each ``rope_shift`` op carries the K bytes of every layer; they are rotated with
:func:`kvcache.rope_shift` and the decoded result is compared with the recorded values
under the trace's tolerance rules (the result depends on the platform's libm, so
bytes need not agree):

* f32: ``|got - exp| <= atol``;
* f16: ``|got - exp| <= atol + u``, ``u`` one f16 ulp at ``|exp|``;
* quantized: ``|got - exp| <= atol + 1.1*|d|`` on decoded values, ``d`` the scale of
  the expected block.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

import kvcache
from conformance import Divergence, Replay, Target

__all__ = ["FAMILY", "params_of", "tolerance", "kvcache_target", "default_target", "TARGETS"]

#: the family of these traces (the key of their ops in :data:`conformance.ops.OPS`)
FAMILY = "rope"

_OP_PARAMS = ("n_rot", "mode", "n_ctx_orig", "freq_base", "freq_scale", "ext_factor",
              "attn_factor", "beta_fast", "beta_slow")


def kvcache_target() -> Target:
    """kvcache's RoPE K-shift (:func:`kvcache.rope_shift`); these traces need no cache."""
    return Target("kvcache.rope_shift", lambda config: None, kvcache.UBatch, family=FAMILY)


def default_target() -> Target:
    """What ``python -m conformance`` replays rope traces against."""
    return kvcache_target()


#: the targets of rope traces, by short name
TARGETS: dict[str, Callable[[], Target]] = {"kvcache": kvcache_target}


def params_of(op: dict) -> kvcache.RopeParams:
    """The RopeParams of a ``rope_shift`` op."""
    kw = {name: op[name] for name in _OP_PARAMS}
    return kvcache.RopeParams(freq_factors=op.get("freq_factors"), **kw)


def tolerance(type_k: str, expected: np.ndarray, expected_raw: np.ndarray, n_embd: int,
              atol: float) -> np.ndarray:
    """Per-element allowed |got - exp| for one layer (float64, shape of ``expected``)."""
    if type_k == "f32":
        return np.full(expected.shape, atol)
    if type_k == "f16":
        return atol + np.spacing(np.abs(expected).astype(np.float16)).astype(np.float64)
    if type_k == "bf16":
        # 8 significant bits: one ulp is 2^(e - 8) for |x| in [2^(e-1), 2^e)
        _, e = np.frexp(np.abs(expected))
        return atol + np.where(expected == 0, 2.0 ** -133, np.ldexp(1.0, np.maximum(e - 8, -133)))
    # quantized: every block starts with its f16 scale d
    n_rows = expected.shape[0]
    n_blocks = n_embd // 32
    blocks = expected_raw.reshape(n_rows, n_blocks, -1)
    d = blocks[:, :, 0:2].copy().view("<f2").astype(np.float64).reshape(n_rows, n_blocks)
    return atol + 1.1 * np.repeat(np.abs(d), 32, axis=1)


def _check_layer(index: int, op: dict, il: int, type_k: str, n_embd: int, got: np.ndarray,
                 expect: dict) -> None:
    exp = np.asarray(expect["after"][il], dtype=np.float64).reshape(got.shape)
    exp_raw = np.frombuffer(bytes.fromhex(expect["after_hex"][il]), dtype=np.uint8)
    tol = tolerance(type_k, exp, exp_raw, n_embd, float(expect["atol"]))
    diff = np.abs(got.astype(np.float64) - exp)
    bad = ~(diff <= tol)
    if bad.any():
        r, e = (int(v) for v in np.argwhere(bad)[0])
        raise Divergence(index, op.get("op", "?"),
                         f"after[{il}][row {r}, elem {e}] (tolerance {tol[r, e]:.3g}, "
                         f"{int(bad.sum())} elements out)",
                         float(exp[r, e]), float(got[r, e]))


# --- the ops (the table: conformance.ops.OPS) ------------------------------------------

def rope_shift(r: Replay, index: int, op: dict) -> None:
    """Rotate the K bytes of every layer the op gives and compare them, decoded, with the
    recorded values within the tolerances."""
    config = r.config
    type_k = config["type_k"]
    head_dim = int(config["n_embd_head_k"])
    kv_size = int(config["kv_size"])
    params = params_of(op)
    shift = np.asarray(op["shift"], dtype=np.int32)
    expect = op["expect"]
    for il in range(int(config["n_layer"])):
        width = int(config["n_embd_k_gqa"][il])
        raw = np.frombuffer(bytes.fromhex(op["before_hex"][il]), dtype=np.uint8)
        k = raw.reshape(kv_size, -1).copy()
        kvcache.rope_shift(k, type_k, int(config["n_head_kv"][il]), head_dim, shift, params)
        got = kvcache.dequantize(k, type_k, width)
        _check_layer(index, op, il, type_k, width, got, expect)
