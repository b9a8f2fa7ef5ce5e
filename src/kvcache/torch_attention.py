"""Attention from kvcache's attention indices with plain torch, on any device: the reference of
what a paged-attention kernel (FlashInfer) computes from the same arrays.

``attention_from_indices(q, k, v, idx)`` takes the query rows of a ubatch, the K/V rows of one
layer and the :class:`~kvcache.AttentionIndices` of the ubatch (``cache.attention_indices(ub)``)
and returns what ``scaled_dot_product_attention`` with the ubatch's KQ mask over those rows
returns (with ``alibi_slopes``, the mask's ALiBi bias too), reading only the rows each group
attends to.

Which path: :func:`takes_dense_path` decides from the indices alone, by one deterministic rule
that weighs the work of each path in units of one query scoring one K/V row. The dense path (one
``scaled_dot_product_attention`` over the ``span = max(kv_indices) + 1`` rows the mask spans)
reads each spanned row once and scores every query against it: ``span * (DENSE_READ +
n_tokens)``. The gather copies each row a group attends to and scores that group's queries
against it: ``sum over groups of rows * (GATHER_COPY + tokens)``. The dense path is taken when
the gather's work is at least ``dense_at`` (default 1) times the dense path's; the indices then
run exactly the kernel the dense mask would (without the mask where it would hide nothing: one
sequence holding every spanned row). The weights :data:`DENSE_READ` and
:data:`GATHER_COPY` are measured (docs/torch.md): a decode step of one sequence takes the dense
path from about a third of the spanned rows on, one of 8 sequences from about a half, one of 64
never (scoring 64 queries against every spanned row costs more than copying the rows each needs).
Below the threshold, the single-token groups (a decode
step) are gathered into one padded batch, grouped by length so that the padding stays under a
quarter of the rows, and every group of several tokens is attended on its own, with its causal
rule as a small mask. Needs ``torch``."""
from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch  # type: ignore[import-not-found,unused-ignore]
import torch.nn.functional as F  # type: ignore[import-not-found,unused-ignore]

from kvcache._core import AttentionIndices, _csr_check

__all__ = ["DENSE_READ", "GATHER_COPY", "attention_from_indices", "dense_mask", "path_work", "takes_dense_path"]

# What reading a spanned row costs the dense kernel, and copying a row costs the gather, in
# units of one query scoring one row (torch on the CPU, f32, 8 heads x 128: a decode step's
# dense kernel costs about 10 + n_tokens such units per spanned row, the gather about 32 + 1
# per gathered row; docs/torch.md has the measurements)
DENSE_READ = 10
GATHER_COPY = 32
# a padded batch of single-token groups holds at most this many rows per row it needs
_PAD_SLACK = 1.25


def _is_count(x: Any) -> bool:
    """Whether x is an int (Python's or numpy's; a bool is no count)."""
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _field(idx: AttentionIndices, name: str, n: int | None, kinds: str) -> Any:
    """idx's array `name`: 1-D, of n entries (any number when None), of a dtype kind in kinds."""
    a = getattr(idx, name)
    if not isinstance(a, np.ndarray) or a.ndim != 1 or a.dtype.kind not in kinds or (n is not None and len(a) != n):
        what = "bool" if kinds == "b" else "integer"
        size = "" if n is None else f" of {n} entries"
        got = f"{a.dtype} {a.shape}" if isinstance(a, np.ndarray) else type(a).__name__
        raise ValueError(f"idx.{name} must be a 1-D {what} array{size}, got {got}")
    return a


def _check_indptr(name: str, a: Any, end: int | None) -> None:
    """An indptr array starts at 0, never decreases and (end given) ends at end."""
    if a[0] != 0:
        raise ValueError(f"idx.{name} must start at 0, got {int(a[0])}")
    down = a[1:] < a[:-1]
    if down.any():
        j = int(np.flatnonzero(down)[0]) + 1
        raise ValueError(f"idx.{name} must never decrease: idx.{name}[{j}] = {int(a[j])} follows {int(a[j - 1])}")
    if end is not None and a[-1] != end:
        raise ValueError(f"idx.{name} must end at len(idx.kv_indices) = {end}, got {int(a[-1])}")


def _check_indices(idx: Any) -> int:
    """Check idx as given (the caller may have built or changed it since attention_indices
    filled it: its arrays are writable, out= buffers reused step after step), with a vectorized
    pass over each array it reads; its span."""
    if not isinstance(idx, AttentionIndices):
        raise TypeError(f"idx must be a kvcache.AttentionIndices (cache.attention_indices), not {type(idx).__name__}")
    qo = _field(idx, "qo_indptr", None, "iu")
    if len(qo) == 0:
        raise ValueError("idx.qo_indptr must have one entry per group and one more, got none")
    kv = _field(idx, "kv_indptr", len(qo), "iu")
    rows = _field(idx, "kv_indices", None, "iu")
    _field(idx, "causal", len(qo) - 1, "b")
    # one pass in C over int32 arrays (attention_indices' own); numpy for other layouts, and to
    # name what the C pass found wrong
    fast = _csr_check(qo, kv, rows)
    if fast is not None and fast >= 0:
        want = fast
    else:
        _check_indptr("qo_indptr", qo, None)
        _check_indptr("kv_indptr", kv, len(rows))
        if len(rows) and rows.min() < 0:
            j = int(np.argmin(rows))
            raise ValueError(f"idx.kv_indices must name K/V rows (>= 0), got idx.kv_indices[{j}] = {int(rows[j])}")
        want = int(rows.max()) + 1 if len(rows) else 0
    if not _is_count(idx.span) or idx.span != want:
        raise ValueError(f"idx.span must be max(idx.kv_indices) + 1 = {want}, got {idx.span!r}")
    return want


def _check(q: Any, k: Any, v: Any, idx: Any, alibi_slopes: Any) -> int:
    """Check the arguments of attention_from_indices; the indices' span."""
    span = _check_indices(idx)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            raise ValueError(f"{name} must be a 3-D torch tensor (rows, heads, head size), got "
                             f"{getattr(t, 'shape', type(t).__name__)}")
    n_tokens = int(idx.qo_indptr[-1])
    if q.shape[0] != n_tokens:
        raise ValueError(f"q must have one row per token of the ubatch ({n_tokens}), got {q.shape[0]}")
    if k.shape[:2] != v.shape[:2]:
        raise ValueError(f"k and v must have the same rows and heads, got {tuple(k.shape)} and {tuple(v.shape)}")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ValueError(f"q's heads must be a multiple of k's (at least one), got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}")
    if span > k.shape[0]:
        raise ValueError(f"k and v must hold every row the indices name (up to {span - 1}), got {k.shape[0]} rows")
    if alibi_slopes is not None:
        _positions(idx)
        _field(idx, "kv_pos", len(idx.kv_indices), "iu")
        _field(idx, "q_pos", n_tokens, "iu")
        shape = tuple(getattr(alibi_slopes, "shape", ()))
        if not isinstance(alibi_slopes, torch.Tensor) or shape != (q.shape[1],):
            raise ValueError(f"alibi_slopes must be a 1-D tensor of one slope per head of q ({q.shape[1]}), "
                             f"got {shape or type(alibi_slopes).__name__}")
        if not alibi_slopes.is_floating_point() or not bool(torch.isfinite(alibi_slopes).all()):
            # a NaN or infinite slope turns every score of its head into NaN
            raise ValueError(f"alibi_slopes must be finite floating-point slopes, got {alibi_slopes.tolist()} "
                             f"({alibi_slopes.dtype})")
    return span


def _positions(idx: AttentionIndices) -> tuple[Any, Any]:
    """``(kv_pos, q_pos)`` of idx, which ALiBi needs."""
    if idx.kv_pos is None or idx.q_pos is None:
        raise ValueError("alibi_slopes needs the indices' positions (attention_indices(..., positions=True))")
    return idx.kv_pos, idx.q_pos


def path_work(idx: AttentionIndices) -> tuple[int, int]:
    """``(gather, dense)``: the work of each path of :func:`attention_from_indices` for idx, in
    units of one query scoring one K/V row: the gather copies each group's rows and scores the
    group's tokens against them (``sum(rows * (GATHER_COPY + tokens))``), the dense kernel reads
    the ``max(kv_indices) + 1`` rows the mask spans and scores every token against each
    (``span * (DENSE_READ + n_tokens)``)."""
    return _path_work(idx, _check_indices(idx))


def _path_work(idx: AttentionIndices, span: int) -> tuple[int, int]:
    """path_work of idx whose span is known."""
    n_groups, n_tokens, nnz = len(idx.causal), int(idx.qo_indptr[-1]), len(idx.kv_indices)
    # one token per group (a decode step) or one group: the sum needs no pass over the groups
    if n_groups == n_tokens:
        gather = nnz * (1 + GATHER_COPY)
    elif n_groups == 1:
        gather = nnz * (n_tokens + GATHER_COPY)
    else:
        q_len = np.diff(idx.qo_indptr).astype(np.int64)
        kv_len = np.diff(idx.kv_indptr).astype(np.int64)
        gather = int(np.dot(kv_len, q_len + GATHER_COPY))
    return gather, span * (DENSE_READ + n_tokens)


def _dense_at(v: Any) -> float:
    """The dense_at argument: a real number >= 0 (inf: never dense). A NaN never compares, so
    it would silently mean "never"; a string would fail only on the first comparison."""
    if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)):
        raise TypeError(f"dense_at must be a real number >= 0 (inf: never dense), not {type(v).__name__}")
    f = float(v)
    if not f >= 0:
        raise ValueError(f"dense_at must be a real number >= 0 (inf: never dense), not {v!r}")
    return f


def takes_dense_path(idx: AttentionIndices, dense_at: float = 1.0) -> bool:
    """Whether :func:`attention_from_indices` takes the dense path for idx: when the gather's
    work is at least ``dense_at`` times the dense kernel's (:func:`path_work`; 0: always).
    Deterministic: the same indices always take the same path."""
    dense_at = _dense_at(dense_at)
    gather, dense = path_work(idx)
    return gather >= dense_at * dense


def _pairs(idx: AttentionIndices) -> tuple[Any, Any]:
    """Every (token, entry of kv_indices) the indices let attend, as two int64 arrays."""
    qo = idx.qo_indptr.astype(np.int64)
    kv = idx.kv_indptr.astype(np.int64)
    q_len, kv_len = np.diff(qo), np.diff(kv)
    single = q_len == 1
    # single-token groups: each entry is one (token, entry) pair
    pick = np.repeat(single, kv_len)
    toks, ents = [np.repeat(qo[:-1], kv_len)[pick]], [np.arange(int(kv[-1]), dtype=np.int64)[pick]]
    for g in np.flatnonzero(~single):
        t0, n_q, a, n_kv = int(qo[g]), int(q_len[g]), int(kv[g]), int(kv_len[g])
        for i in range(n_q):
            upto = max(n_kv - n_q + i + 1, 0) if idx.causal[g] else n_kv
            toks.append(np.full(upto, t0 + i, dtype=np.int64))
            ents.append(np.arange(a, a + upto, dtype=np.int64))
    return np.concatenate(toks), np.concatenate(ents)


def dense_mask(idx: AttentionIndices, n_rows: int | None = None, device: Any = None) -> Any:
    """The bool mask ``[n_tokens, n_rows]`` (True: the token attends to the row) the indices
    stand for, over K/V rows ``0 .. n_rows - 1`` (default: up to the last row they name)."""
    span = _check_indices(idx)
    if n_rows is None:
        n_rows = span
    elif not _is_count(n_rows) or n_rows < span:
        raise ValueError(f"n_rows must be an int of at least the indices' span ({span}), got {n_rows!r}")
    return _dense_mask(idx, n_rows, device)


def _dense_mask(idx: AttentionIndices, n_rows: int, device: Any) -> Any:
    """dense_mask of checked indices."""
    n_tokens = int(idx.qo_indptr[-1])
    mask = np.zeros((n_tokens, n_rows), dtype=np.bool_)
    tok, ent = _pairs(idx)
    mask[tok, idx.kv_indices[ent]] = True
    return torch.from_numpy(mask).to(device) if device is not None else torch.from_numpy(mask)


def _alibi_distances(idx: AttentionIndices, n_rows: int) -> Any:
    """``[n_tokens, n_rows]`` float32: ``-|kv_pos - q_pos|`` where a token attends to a row, -inf
    elsewhere (the KQ mask of ``alibi=True``)."""
    n_tokens = int(idx.qo_indptr[-1])
    out = np.full((n_tokens, n_rows), -np.inf, dtype=np.float32)
    tok, ent = _pairs(idx)
    kv_pos, q_pos = _positions(idx)
    out[tok, idx.kv_indices[ent]] = -np.abs(kv_pos[ent].astype(np.int64) - q_pos[tok])
    return torch.from_numpy(out)


def _alibi_bias(slopes: Any, dist: Any) -> Any:
    """The additive mask of each head: ``slope * dist`` ([..., tokens, rows] -> [..., heads,
    tokens, rows]), -inf kept -inf whatever the slope."""
    d = dist.unsqueeze(-3)
    s = slopes.to(dist.dtype).view(-1, 1, 1)
    return torch.where(torch.isinf(d), d, s * d)


def _sdpa(q: Any, k: Any, v: Any, mask: Any, scale: float | None) -> Any:
    """scaled_dot_product_attention of q [B, q, H, D] over k, v [B, L, Hkv, D] -> [B, q, H, Dv]."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                                         scale=scale, enable_gqa=q.shape[2] != k.shape[2])
    return out.transpose(1, 2)


def _sees_all(idx: AttentionIndices, span: int) -> bool:
    """Whether every token of idx attends to every one of its span rows (one sequence holding
    them all, or a non-causal call's): then a mask would hide nothing."""
    if len(idx.causal) == 1:
        # one group (a decode step of one sequence) needs no pass over the groups
        return not idx.causal[0] and len(idx.kv_indices) == span
    return not idx.causal.any() and bool((np.diff(idx.kv_indptr) == span).all())


def _dense(q: Any, k: Any, v: Any, idx: AttentionIndices, span: int, scale: float | None,
           mask: Callable[[], Any] | None, slopes: Any) -> Any:
    """The dense path: one SDPA over the span rows the mask spans (without a mask where it would
    hide nothing)."""
    device = k.device
    n_tokens = q.shape[0]
    if slopes is None and _sees_all(idx, span):
        # every token attends to every spanned row (one sequence holding them all): a mask would hide nothing
        return _sdpa(q[None], k[None, :span], v[None, :span], None, scale)[0]
    if mask is None:
        m = _dense_mask(idx, span, device) if slopes is None else _alibi_distances(idx, span).to(device)
    else:
        m = torch.as_tensor(mask(), device=device)
        if m.dim() == 3 and m.shape[0] == 1:
            m = m[0]
        if m.dim() != 2 or m.shape[0] != n_tokens or m.shape[1] < span or m.shape[1] > k.shape[0]:
            raise ValueError(f"mask() must give a KQ mask [n_tokens, n_kv] of one stream ({n_tokens} rows, "
                             f"at least {span} and at most {k.shape[0]} columns), got {tuple(m.shape)}")
        if slopes is not None and not m.is_floating_point():
            raise ValueError("with alibi_slopes, mask() must give the float KQ mask of alibi=True "
                             "(cache.kq_mask(ub, alibi=True, pad=False)), got a bool one")
        span = m.shape[1]
    if slopes is not None:
        m = _alibi_bias(slopes, m.to(q.dtype))
    elif m.is_floating_point():
        m = m.to(q.dtype)
    return _sdpa(q[None], k[None, :span], v[None, :span], m, scale)[0]


def attention_from_indices(q: Any, k: Any, v: Any, idx: AttentionIndices, *, scale: float | None = None,
                           dense_at: float = 1.0, mask: Callable[[], Any] | None = None,
                           alibi_slopes: Any = None) -> Any:
    """Attention of the ubatch's queries ``q [n_tokens, heads, head size]`` over the K/V rows
    ``k``, ``v`` ``[rows, kv heads, head size]`` (a layer's rows as the cache keeps them:
    ``cache.k(il)`` viewed per head, or the caller's own tensors), with the attention indices
    ``idx`` of the ubatch: ``[n_tokens, heads, v head size]``, equal to
    ``scaled_dot_product_attention`` with the ubatch's KQ mask. ``scale``: as SDPA's (default
    ``1/sqrt(head size)``). ``dense_at``: the dense path is taken when the gather's work is at
    least this times the dense kernel's (:func:`takes_dense_path`; 0: always, ``inf``: never). Heads of q that are a
    multiple of k's share them (grouped-query attention). ``alibi_slopes``: a tensor of one slope
    per head of q, for ALiBi (needs ``attention_indices(..., positions=True)``): head h adds
    ``-alibi_slopes[h] * |kv_pos - q_pos|`` to its scores, as llama.cpp's softmax does with the
    mask of ``alibi=True``. ``mask``: where the dense path is taken, a function giving the
    cache's KQ mask of the ubatch, used instead of a mask rebuilt from the indices (a one-stream
    cache's ``lambda: cache.kq_mask(ub, pad=False, dtype="bool", out=buf)``; with ALiBi the float
    mask of ``alibi=True``)."""
    dense_at = _dense_at(dense_at)
    span = _check(q, k, v, idx, alibi_slopes)
    n_tokens = q.shape[0]
    if n_tokens == 0:
        return q.new_empty((n_tokens, q.shape[1], v.shape[2]))
    device = k.device
    slopes = None if alibi_slopes is None else torch.as_tensor(alibi_slopes, device=device)
    gather, dense = _path_work(idx, span)
    if gather >= dense_at * dense:
        return _dense(q, k, v, idx, span, scale, mask, slopes)
    out = q.new_empty((n_tokens, q.shape[1], v.shape[2]))
    qo = idx.qo_indptr.astype(np.int64)
    kv = idx.kv_indptr.astype(np.int64)
    q_len, kv_len = np.diff(qo), np.diff(kv)
    rows = torch.from_numpy(idx.kv_indices.astype(np.int64)).to(device)
    if slopes is not None:
        kv_pos, q_pos = (torch.from_numpy(a.astype(np.int64)).to(device) for a in _positions(idx))
    single = np.flatnonzero(q_len == 1)
    # the single-token groups, longest first, in padded batches of similar lengths
    order = single[np.argsort(-kv_len[single], kind="stable")]
    start = 0
    while start < len(order):
        longest = int(kv_len[order[start]])
        end, total = start, 0
        while end < len(order) and (end - start + 1) * longest <= _PAD_SLACK * (total + int(kv_len[order[end]])):
            total += int(kv_len[order[end]])
            end += 1
        end = max(end, start + 1)
        groups = order[start:end]
        lens = kv_len[groups]
        # every group's entries, padded with its own first row (masked out)
        pos = np.minimum(np.arange(longest)[None, :], np.maximum(lens[:, None] - 1, 0)) + kv[groups][:, None]
        ent = torch.from_numpy(pos.reshape(-1)).to(device)
        sel = rows[ent]
        kg = k.index_select(0, sel).view(len(groups), longest, *k.shape[1:])
        vg = v.index_select(0, sel).view(len(groups), longest, *v.shape[1:])
        toks = torch.from_numpy(qo[groups]).to(device)
        bias = None
        if (lens != longest).any():
            bias = (torch.arange(longest, device=device)[None, :] < torch.from_numpy(lens).to(device)[:, None])
            bias = bias[:, None, None, :]
        if slopes is not None:
            dist = -(kv_pos[ent].view(len(groups), 1, longest) - q_pos[toks][:, None, None]).abs().to(q.dtype)
            if bias is not None:
                dist = dist.masked_fill(~bias[:, 0], float("-inf"))
            bias = _alibi_bias(slopes, dist)
        out[toks] = _sdpa(q[toks][:, None], kg, vg, bias, scale)[:, 0]
        start = end
    for g in np.flatnonzero(q_len > 1):
        t0, n_q, a, n_kv = int(qo[g]), int(q_len[g]), int(kv[g]), int(kv_len[g])
        sel = rows[a:a + n_kv]
        bias = None
        if idx.causal[g]:
            bias = torch.ones((n_q, n_kv), dtype=torch.bool, device=device).tril(n_kv - n_q)
        if slopes is not None:
            dist = -(kv_pos[a:a + n_kv][None, :] - q_pos[t0:t0 + n_q][:, None]).abs().to(q.dtype)
            if bias is not None:
                dist = dist.masked_fill(~bias, float("-inf"))
            bias = _alibi_bias(slopes, dist)
        out[t0:t0 + n_q] = _sdpa(q[None, t0:t0 + n_q], k.index_select(0, sel)[None], v.index_select(0, sel)[None],
                                 bias, scale)[0]
    return out
