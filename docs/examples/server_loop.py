"""Continuous batching over a kvcache.UnifiedCache2026 with prefix reuse: a compact server loop.

Requests arrive with prompts of different lengths that begin with the same system prompt. A new
request first takes the longest prefix of its prompt that the cache still holds from requests
that ended before (prefix_attach: no K/V is computed or copied for it). Every step, each running
request offers its pending tokens (a chunk of its prompt, or the token it generated last), and
these form one batch. The batch is split into ubatches exactly as llama.cpp splits it, and each
ubatch goes through

    find_slot -> store K/V -> kq_mask -> attention -> (next ubatch) ...

A request that has generated enough tokens ends with prefix_release: its cells stay in the
cache's prefix index for later requests, which placement evicts (least recently used first) when
it needs the room. The "model" is one attention layer with random projections (numpy), and every
output row is compared with the same attention recomputed from scratch over the request's whole
history, so the example also proves that reused cells hold the right K/V.

Run it: ``python docs/examples/server_loop.py`` (the test suite does)."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

import kvcache

D = 16        # K/V row width (one head of 16)
VOCAB = 32
SYSTEM = 8    # tokens of the system prompt every request starts with
rng = np.random.default_rng(0)
EMBED = rng.standard_normal((VOCAB, D)).astype(np.float32)
WQ, WK, WV = (rng.standard_normal((D, D)).astype(np.float32) / 4 for _ in range(3))


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Softmax attention of q [t, D] over k, v [n, D]; mask [t, n] is 0 or -inf."""
    s = q @ k.T / np.sqrt(D) + mask
    p = np.exp(s - s.max(axis=1, keepdims=True))
    return (p / p.sum(axis=1, keepdims=True)) @ v


@dataclass
class Request:
    tokens: list            # prompt, then the generated tokens
    n_prompt: int
    max_new: int
    seq_id: int = -1        # its sequence in the cache while it runs
    n_cached: int = 0       # tokens whose K/V are in the cache
    n_reused: int = 0       # of those, taken from earlier requests' cells
    outputs: list = field(default_factory=list)

    @property
    def done(self) -> bool:
        # the last generated token is returned, never fed back
        return len(self.tokens) - self.n_prompt >= self.max_new


def serve(requests: list, kv_size: int = 128, n_seq_max: int = 4, n_batch: int = 24, n_ubatch: int = 8) -> dict:
    """Serve the requests to completion; returns counters."""
    cache = kvcache.UnifiedCache2026(kv_size=kv_size, n_layer=1, n_embd_k_gqa=D, n_embd_v_gqa=D,
                                     type_k="f32", type_v="f32", v_trans=False, n_seq_max=n_seq_max)
    cache.enable_prefix_reuse()
    waiting, running = deque(requests), {}
    free = list(range(n_seq_max))
    stats = {"steps": 0, "ubatches": 0, "tokens": 0, "max_used": 0, "reused": 0}

    while waiting or running:
        stats["steps"] += 1
        while waiting and free:                       # admit while a sequence id is free
            r = waiting.popleft()
            r.seq_id = free.pop(0)
            # the longest prefix earlier requests left in the cache (at least one token is left
            # to compute: its output is the first generated token)
            r.n_cached = r.n_reused = cache.prefix_attach(r.seq_id, r.tokens[:r.n_prompt])
            stats["reused"] += r.n_reused
            running[r.seq_id] = r

        # one batch: every running request's pending tokens (prompt chunks are cut to fit)
        pos, seq, tok, owner = [], [], [], []
        for r in running.values():
            take = min(len(r.tokens) - r.n_cached, n_batch - len(pos))
            for i in range(r.n_cached, r.n_cached + take):
                pos.append(i)
                seq.append(r.seq_id)
                tok.append(r.tokens[i])
                owner.append(r)
        batch = kvcache.Batch(pos, seq, tokens=tok)   # the cells learn their tokens

        for ub in cache.ubatches(batch, n_ubatch):
            if not cache.find_slot(ub):               # even after evicting every held prefix
                raise MemoryError(f"no room for {ub.n_tokens} tokens ({cache.size - cache.used} cells free)")
            ids = ub.ids                              # batch index of each ubatch token
            x = EMBED[[tok[i] for i in ids]]
            q, k, v = x @ WQ, x @ WK, x @ WV
            cache.store(0, k, v)                      # rows go to the cells find_slot chose
            mask = cache.kq_mask(ub)[0]               # [n_tokens, n_kv]: one token group, one stream
            n_kv = mask.shape[1]
            out = attention(q, cache.k(0)[:n_kv], cache.v(0)[:n_kv], mask)
            for row, i in enumerate(ids):
                owner[i].outputs.append((pos[i], out[row]))
            stats["ubatches"] += 1
        stats["tokens"] += len(pos)
        stats["max_used"] = max(stats["max_used"], cache.used)

        for r in owner:                               # advance; caught-up requests generate
            r.n_cached += 1
        for r in running.values():
            if r.n_cached == len(r.tokens):
                last = r.outputs[-1][1]
                r.tokens.append(int(np.argmax(last @ EMBED.T)))
        for r in [r for r in running.values() if r.done]:
            cache.prefix_release(r.seq_id)            # its cells stay for later requests
            free.append(r.seq_id)
            del running[r.seq_id]
    assert cache.used == 0                            # held cells belong to no sequence
    stats["held"] = cache.prefix_stats["cells"]
    return stats


def check(r: Request) -> None:
    """Every output equals attention over the request's own history, recomputed without a cache."""
    x = EMBED[r.tokens]
    q, k, v = x @ WQ, x @ WK, x @ WV
    for p, got in r.outputs:
        want = attention(q[p:p + 1], k[:p + 1], v[:p + 1], np.zeros((1, p + 1), np.float32))[0]
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def main() -> dict:
    system = rng.integers(0, VOCAB, size=SYSTEM).tolist()
    lengths = rng.integers(3, 20, size=10)
    requests = [Request(tokens=system + rng.integers(0, VOCAB, size=int(n)).tolist(), n_prompt=SYSTEM + int(n),
                        max_new=5) for n in lengths]
    stats = serve(requests)
    for r in requests:
        check(r)
        assert len(r.outputs) == len(r.tokens) - 1 - r.n_reused and len(r.tokens) == r.n_prompt + r.max_new
    print(f"{len(requests)} requests served in {stats['steps']} steps, {stats['ubatches']} ubatches, "
          f"{stats['tokens']} tokens; {stats['reused']} prompt tokens reused; at most {stats['max_used']} cells "
          f"in use; every output checked")
    # 10 requests served in 17 steps, 31 ubatches, 182 tokens; 49 prompt tokens reused; at most 99 cells
    # in use; every output checked
    return stats


if __name__ == "__main__":
    main()
