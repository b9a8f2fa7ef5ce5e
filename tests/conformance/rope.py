"""Replay of ``rope`` traces: RoPE K-shifts of explicit K tensors.

Each ``rope_shift`` op carries the K bytes of every layer; they are rotated with
:func:`kvcache.rope_shift` and the decoded result (the field ``after``) is compared with the
recorded values under the trace's tolerance rules (the result depends on the platform's libm,
so bytes need not agree):

* f32: ``|got - exp| <= atol``;
* f16: ``|got - exp| <= atol + u``, ``u`` one f16 ulp at ``|exp|``;
* quantized: ``|got - exp| <= atol + 1.1*|d|`` on decoded values, ``d`` the scale of
  the expected block (from the recorded bytes, ``after_hex``).

``atol`` is the op's, capped by :func:`atol_cap` (:data:`FIELDS`).
"""
from __future__ import annotations

import math
from decimal import ROUND_CEILING, Decimal
from typing import Any, Callable

import numpy as np

import kvcache
from conformance import Divergence, Replay, Target, compare
from conformance.common import Fields

__all__ = ["FAMILY", "FIELDS", "params_of", "tolerance", "atol_cap", "kvcache_target", "default_target", "TARGETS"]

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


#: the K types whose tolerance needs no block scale (every other type is quantized in blocks)
_FLOAT_TYPES = ("f32", "f16", "bf16")


def tolerance(type_k: str, expected: np.ndarray, expected_raw: np.ndarray | None, n_embd: int,
              atol: float) -> np.ndarray:
    """Per-element allowed |got - exp| for one layer (float64, shape of ``expected``);
    ``expected_raw``, the recorded bytes, only for a quantized type."""
    if type_k == "f32":
        return np.full(expected.shape, atol)
    if type_k == "f16":
        return atol + np.spacing(np.abs(expected).astype(np.float16)).astype(np.float64)
    if type_k == "bf16":
        # 8 significant bits: one ulp is 2^(e - 8) for |x| in [2^(e-1), 2^e)
        _, e = np.frexp(np.abs(expected))
        return atol + np.where(expected == 0, 2.0 ** -133, np.ldexp(1.0, np.maximum(e - 8, -133)))
    # quantized: every block starts with its f16 scale d
    assert expected_raw is not None
    n_rows = expected.shape[0]
    n_blocks = n_embd // 32
    blocks = expected_raw.reshape(n_rows, n_blocks, -1)
    d = blocks[:, :, 0:2].copy().view("<f2").astype(np.float64).reshape(n_rows, n_blocks)
    return atol + 1.1 * np.repeat(np.abs(d), 32, axis=1)


def _before(config: dict, op: dict, il: int) -> np.ndarray:
    """Layer il's K tensor before the shift, as the op gives it: one row of bytes per cell."""
    raw = np.frombuffer(bytes.fromhex(op["before_hex"][il]), dtype=np.uint8)
    return raw.reshape(int(config["kv_size"]), -1).copy()


def _round_up(x: float, digits: int) -> float:
    """x rounded up to ``digits`` significant digits."""
    if x <= 0:
        return 0.0
    d = Decimal(repr(x))
    step = Decimal(1).scaleb(d.adjusted() - digits + 1)
    return float((d / step).to_integral_value(ROUND_CEILING) * step)


def atol_cap(config: dict, op: dict) -> float:
    """The loosest ``atol`` a trace may ask for a ``rope_shift`` op.

    It is the tolerance golden/FORMAT.md derives from the op's own inputs,
    ``1e-5*max(1, M*G) + 4e-7*(1 + S*F)*2*M*G`` rounded up to 2 significant digits (M the
    largest input magnitude, S the largest shift, F the smallest frequency factor's inverse
    when below 1, G the magnitude factor): a ~1e-5 relative allowance plus one ulp of the
    per-pair frequency step, which grows with the shift. That covers what differs between
    libms and FMA choices; every recorded op asks exactly this much. A fixed cap per K type
    would be as loose as the op of largest inputs (0.025 for f32) for every other op."""
    m = max(float(np.abs(kvcache.dequantize(_before(config, op, il), config["type_k"],
                                            int(config["n_embd_k_gqa"][il]))).max())
            for il in range(int(config["n_layer"])))
    s = max((abs(int(x)) for x in op["shift"]), default=0)
    factors = op.get("freq_factors")
    f = 1.0 / min(1.0, min(factors)) if factors else 1.0
    g = float(op["attn_factor"])
    if op["ext_factor"] != 0:
        g *= 1.0 + 0.1 * math.log(1.0 / op["freq_scale"])
    return _round_up(1e-5 * max(1.0, m * g) + 4e-7 * (1 + s * f) * 2 * m * g, 2)


def _within(index: int, op: dict, config: dict, field: str, expected: Any, got: list[np.ndarray],
            atol: float) -> None:
    """Compare the decoded K of every layer with the recorded values within the tolerances."""
    compare(index, op, f"{field} (count)", len(expected), len(got))
    type_k = config["type_k"]
    scaled = type_k not in _FLOAT_TYPES
    hexes = op["expect"].get("after_hex")
    if scaled and (not isinstance(hexes, list) or len(hexes) != len(got)):
        raise Divergence(index, op.get("op", "?"), "after_hex", "the recorded bytes of every layer", hexes)
    for il, (want, have) in enumerate(zip(expected, got)):
        exp = np.asarray(want, dtype=np.float64)
        compare(index, op, f"{field}[{il}] (count)", exp.size, have.size)
        exp = exp.reshape(have.shape)
        exp_raw = np.frombuffer(bytes.fromhex(hexes[il]), dtype=np.uint8) if scaled else None
        tol = tolerance(type_k, exp, exp_raw, have.shape[1], atol)
        bad = ~(np.abs(have.astype(np.float64) - exp) <= tol)
        if bad.any():
            r, e = (int(v) for v in np.argwhere(bad)[0])
            raise Divergence(index, op.get("op", "?"),
                             f"{field}[{il}][row {r}, elem {e}] (tolerance {tol[r, e]:.3g}, "
                             f"{int(bad.sum())} elements out)",
                             float(exp[r, e]), float(have[r, e]))


#: how a rope_shift op is held against its expectation (conformance.ops.FIELDS)
FIELDS = Fields(
    inputs={"after_hex": "the recorded K bytes: the scales of the quantized blocks, whose steps the "
                         "tolerance allows; the bytes themselves need not agree (libm differences)"},
    within={"after": _within}, atol_cap=atol_cap)


# --- the ops (the table: conformance.ops.OPS) ------------------------------------------

def rope_shift(r: Replay, index: int, op: dict) -> dict:
    """Rotate the K bytes of every layer the op gives; the decoded K of every layer."""
    config = r.config
    type_k = config["type_k"]
    head_dim = int(config["n_embd_head_k"])
    params = params_of(op)
    shift = np.asarray(op["shift"], dtype=np.int32)
    after = []
    for il in range(int(config["n_layer"])):
        k = _before(config, op, il)
        kvcache.rope_shift(k, type_k, int(config["n_head_kv"][il]), head_dim, shift, params)
        after.append(kvcache.dequantize(k, type_k, int(config["n_embd_k_gqa"][il])))
    return {"after": after}
