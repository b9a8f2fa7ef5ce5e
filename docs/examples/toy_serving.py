"""Prefill and greedy decoding of one sequence of the demo's ToyModel over a UnifiedCache: the
workload the hand-off examples (handoff_ray.py, handoff_nixl.py beside this file) move between
processes. They import it as ``toy_serving``: a script's folder is first on its sys.path."""
from __future__ import annotations

import numpy as np
import numpy.typing as npt

import kvcache
from kvcache.demo import ToyModel

__all__ = ["toy_model", "toy_cache", "prefill", "decode"]


def toy_model(seed: int = 7) -> ToyModel:
    """A model with rows wide enough for a hand-off to have bytes to move: 4 layers of 4 KV heads
    of 32 elements (K and V rows of 128 elements)."""
    return ToyModel(seed, n_layer=4, n_head=8, n_head_kv=4, head_dim=32, n_vocab=256)


def toy_cache(model: ToyModel, kv_size: int, v_trans: bool = True, type_kv: str = "f16") -> kvcache.UnifiedCache:
    """A cache for the model's layers."""
    return kvcache.UnifiedCache(kv_size, model.n_layer, model.n_embd_kv, model.n_embd_kv, type_k=type_kv,
                                type_v=type_kv, v_trans=v_trans, n_seq_max=4)


def _step(model: ToyModel, cache: kvcache.UnifiedCache, tokens: list[int], pos0: int,
          seq_id: int) -> npt.NDArray[np.float32]:
    """One ubatch of a sequence's tokens at positions pos0...: place, store, attend, commit.
    Returns the logits of its last token."""
    pos = np.arange(pos0, pos0 + len(tokens), dtype=np.int32)
    ub = kvcache.UBatch(pos=pos, seq_id=[seq_id] * len(tokens))
    if not cache.find_slot(ub):
        raise RuntimeError(f"no room for {len(tokens)} tokens")
    mask = np.asarray(cache.kq_mask(ub))[:len(tokens)]
    x = model.embed(tokens)
    n = cache.n
    for il in range(model.n_layer):
        q, k, v = model.qkv(il, x, pos)
        cache.store(il, k, v)
        kc = np.asarray(cache.k(il))[:n].astype(np.float32)
        vc = np.asarray(cache.v(il))
        vc = (vc[:, :n].T if cache.v_trans else vc[:n]).astype(np.float32)
        x = model.residual(il, x, model.attend(q, kc, vc, mask))
    cache.commit()
    return np.asarray(x[-1] @ model.w_out, dtype=np.float32)


def prefill(model: ToyModel, cache: kvcache.UnifiedCache, prompt: list[int], seq_id: int = 0) -> int:
    """Run the prompt through the cache; returns the first generated token."""
    return int(np.argmax(_step(model, cache, prompt, 0, seq_id)))


def decode(model: ToyModel, cache: kvcache.UnifiedCache, token: int, pos: int, n: int,
           seq_id: int = 0) -> tuple[list[int], npt.NDArray[np.float32]]:
    """Greedy decoding of n tokens from token at position pos: the tokens and their logits (n, vocab)."""
    out, logits = [], []
    for i in range(n):
        lg = _step(model, cache, [token], pos + i, seq_id)
        logits.append(lg)
        token = int(np.argmax(lg))
        out.append(token)
    return out, np.stack(logits)
