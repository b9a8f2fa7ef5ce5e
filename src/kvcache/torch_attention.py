"""Attention from kvcache's attention indices with plain torch, on any device: the reference of
what a paged-attention kernel (FlashInfer) computes from the same arrays.

``attention_from_indices(q, k, v, idx)`` takes the query rows of a ubatch, the K/V rows of one
layer and the :class:`~kvcache.AttentionIndices` of the ubatch (``cache.attention_indices(ub)``)
and returns what ``scaled_dot_product_attention`` with the ubatch's KQ mask over those rows
returns, reading only the rows each group attends to. It chooses the dense path (one
``scaled_dot_product_attention`` over every row the mask spans, with the mask rebuilt from the
indices) itself when the step reads nearly every row anyway: when the indices add up to at least
``dense_at`` (default 0.5) times the rows the mask spans. Below that, the single-token groups (a
decode step) are gathered into one padded batch, grouped by length so that the padding stays
under a quarter of the rows, and every group of several tokens is attended on its own, with its
causal rule as a small mask. Needs ``torch``."""
from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch  # type: ignore[import-not-found,unused-ignore]
import torch.nn.functional as F  # type: ignore[import-not-found,unused-ignore]

from kvcache._core import AttentionIndices

__all__ = ["attention_from_indices", "dense_mask"]

# a padded batch of single-token groups holds at most this many rows per row it needs
_PAD_SLACK = 1.25


def _check(q: Any, k: Any, v: Any, idx: Any) -> None:
    if not isinstance(idx, AttentionIndices):
        raise TypeError(f"idx must be a kvcache.AttentionIndices (cache.attention_indices), not {type(idx).__name__}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            raise ValueError(f"{name} must be a 3-D torch tensor (rows, heads, head size), got "
                             f"{getattr(t, 'shape', type(t).__name__)}")
    n_tokens = int(idx.qo_indptr[-1])
    if q.shape[0] != n_tokens:
        raise ValueError(f"q must have one row per token of the ubatch ({n_tokens}), got {q.shape[0]}")
    if k.shape[:2] != v.shape[:2]:
        raise ValueError(f"k and v must have the same rows and heads, got {tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"q's heads ({q.shape[1]}) must be a multiple of k's ({k.shape[1]})")
    if len(idx.kv_indices) and int(idx.kv_indices.max()) >= k.shape[0]:
        raise ValueError(f"k and v must hold every row the indices name (up to {int(idx.kv_indices.max())}), "
                         f"got {k.shape[0]} rows")


def dense_mask(idx: AttentionIndices, n_rows: int | None = None, device: Any = None) -> Any:
    """The bool mask ``[n_tokens, n_rows]`` (True: the token attends to the row) the indices
    stand for, over K/V rows ``0 .. n_rows - 1`` (default: up to the last row they name)."""
    qo = idx.qo_indptr.astype(np.int64)
    kv = idx.kv_indptr.astype(np.int64)
    rows = idx.kv_indices.astype(np.int64)
    n_tokens = int(qo[-1])
    if n_rows is None:
        n_rows = int(rows.max()) + 1 if len(rows) else 0
    mask = np.zeros((n_tokens, n_rows), dtype=np.bool_)
    q_len, kv_len = np.diff(qo), np.diff(kv)
    single = q_len == 1
    # single-token groups: each entry is one (token, row) pair
    tok = np.repeat(qo[:-1], kv_len)
    pick = np.repeat(single, kv_len)
    mask[tok[pick], rows[pick]] = True
    for g in np.flatnonzero(~single):
        t0, n_q, a, n_kv = int(qo[g]), int(q_len[g]), int(kv[g]), int(kv_len[g])
        for i in range(n_q):
            upto = n_kv - n_q + i + 1 if idx.causal[g] else n_kv
            mask[t0 + i, rows[a:a + max(upto, 0)]] = True
    return torch.from_numpy(mask).to(device) if device is not None else torch.from_numpy(mask)


def _sdpa(q: Any, k: Any, v: Any, mask: Any, scale: float | None) -> Any:
    """scaled_dot_product_attention of q [B, q, H, D] over k, v [B, L, Hkv, D] -> [B, q, H, Dv]."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                                         scale=scale, enable_gqa=q.shape[2] != k.shape[2])
    return out.transpose(1, 2)


def attention_from_indices(q: Any, k: Any, v: Any, idx: AttentionIndices, *, scale: float | None = None,
                           dense_at: float = 0.5, mask: Callable[[], Any] | None = None) -> Any:
    """Attention of the ubatch's queries ``q [n_tokens, heads, head size]`` over the K/V rows
    ``k``, ``v`` ``[rows, kv heads, head size]`` (a layer's rows as the cache keeps them:
    ``cache.k(il)`` viewed per head, or the caller's own tensors), with the attention indices
    ``idx`` of the ubatch: ``[n_tokens, heads, v head size]``, equal to
    ``scaled_dot_product_attention`` with the ubatch's KQ mask. ``scale``: as SDPA's (default
    ``1/sqrt(head size)``). ``dense_at``: the share of the mask's rows from which the dense path
    is taken (0: always, above 1: never; see the module's docstring). Heads of q that are a
    multiple of k's share them (grouped-query attention). ``mask``: where the dense path is
    taken, a function giving the cache's bool KQ mask of the ubatch (a one-stream cache's
    ``lambda: cache.kq_mask(ub, pad=False, dtype="bool", out=buf)``), used instead of a mask
    rebuilt from the indices."""
    _check(q, k, v, idx)
    n_tokens = q.shape[0]
    out = q.new_empty((n_tokens, q.shape[1], v.shape[2]))
    if n_tokens == 0:
        return out
    device = k.device
    nnz = len(idx.kv_indices)
    span = int(idx.kv_indices.max()) + 1 if nnz else 0
    if nnz >= dense_at * span:
        if mask is None:
            m = dense_mask(idx, span, device)
        else:
            m = torch.as_tensor(mask(), device=device)
            if m.dim() == 3 and m.shape[0] == 1:
                m = m[0]
            if m.dim() != 2 or m.shape[0] != n_tokens or m.shape[1] < span or m.shape[1] > k.shape[0]:
                raise ValueError(f"mask() must give a bool mask [n_tokens, n_kv] of one stream ({n_tokens} rows, "
                                 f"at least {span} and at most {k.shape[0]} columns), got {tuple(m.shape)}")
            span = m.shape[1]
        return _sdpa(q[None], k[None, :span], v[None, :span], m, scale)[0]
    qo = idx.qo_indptr.astype(np.int64)
    kv = idx.kv_indptr.astype(np.int64)
    q_len, kv_len = np.diff(qo), np.diff(kv)
    rows = torch.from_numpy(idx.kv_indices.astype(np.int64)).to(device)
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
        sel = rows[torch.from_numpy(pos.reshape(-1)).to(device)]
        kg = k.index_select(0, sel).view(len(groups), longest, *k.shape[1:])
        vg = v.index_select(0, sel).view(len(groups), longest, *v.shape[1:])
        toks = torch.from_numpy(qo[groups]).to(device)
        pad = None
        if (lens != longest).any():
            pad = (torch.arange(longest, device=device)[None, :] < torch.from_numpy(lens).to(device)[:, None])
            pad = pad[:, None, None, :]
        out[toks] = _sdpa(q[toks][:, None], kg, vg, pad, scale)[:, 0]
        start = end
    for g in np.flatnonzero(q_len > 1):
        t0, n_q, a, n_kv = int(qo[g]), int(q_len[g]), int(kv[g]), int(kv_len[g])
        sel = rows[a:a + n_kv]
        causal = None
        if idx.causal[g]:
            causal = torch.ones((n_q, n_kv), dtype=torch.bool, device=device).tril(n_kv - n_q)
        out[t0:t0 + n_q] = _sdpa(q[None, t0:t0 + n_q], k.index_select(0, sel)[None], v.index_select(0, sel)[None],
                                 causal, scale)[0]
    return out
