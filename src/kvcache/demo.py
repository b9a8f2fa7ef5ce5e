"""A toy attention model served through :class:`kvcache.UnifiedCache` (and, with sliding-window
layers, :class:`kvcache.ISWACache`), checked step by step.

``run_demo()`` drives a small multi-layer attention model (grouped-query heads, RoPE at absolute
positions, random weights from a fixed seed; numpy only) the way an inference server drives
llama.cpp: several sequences share one cache and are prefilled and decoded together in one
ubatch per step (continuous batching). Sequences finish and leave holes (``seq_rm``), new ones
arrive, some reuse the cells of another sequence's prompt prefix (``seq_cp``), and the cache is
defragmented when the holes pile up. A last run serves multi-turn chats through today's cache
with prefix reuse: each turn starts from the cells its earlier turns left in the cache's prefix
index.

Every step places the ubatch (``find_slot``), stores the new K/V rows of each layer, builds the
mask (``kq_mask``), attends over the cache's own K/V buffers (``k(il)`` / ``v(il)``, first ``n``
cells), and commits. The output of every token at every layer is then compared with the same
model recomputed from scratch over the sequence's whole token history, without a cache. Any
difference above the tolerance is a mismatch.

The iSWA run gives layer 0 a sliding window (a token at position p1 sees keys at p0 with
p1 - p0 < n_swa) and layer 1 full attention. Each layer attends over the part of the
:class:`kvcache.ISWACache` holding it, under that part's mask; every commit prunes the SWA
part, and a pruning that loses part of a window (``SWAWarning``) counts as a failure.
"""
from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np

import kvcache
from kvcache._text import plural

__all__ = ["ToyModel", "RunConfig", "RunReport", "ReuseReport", "DemoReport", "run", "run_demo", "reuse_run", "iswa_model",
           "format_report"]

# Largest graph of a llama.cpp context (graph_max_nodes); bounds the moves of one defrag plan.
_MAX_NODES = 65536


class ToyModel:
    """A decoder of ``n_layer`` pre-norm attention blocks (no MLP), grouped-query heads, RoPE.

    Weights are drawn from ``numpy.random.default_rng(seed)``; all arithmetic is float32.
    K and V rows are ``n_head_kv * head_dim`` wide (the cache's ``n_embd_k_gqa``). The layers in
    ``swa_layers`` attend through a sliding window of ``n_swa`` positions; the weights do not
    depend on it."""

    def __init__(self, seed: int, n_layer: int = 2, n_head: int = 4, n_head_kv: int = 2,
                 head_dim: int = 16, n_vocab: int = 64, rope_base: float = 10000.0,
                 swa_layers=(), n_swa: int = 0):
        if n_head % n_head_kv:
            raise ValueError(f"n_head = {n_head}: expected a multiple of n_head_kv = {n_head_kv}")
        if head_dim % 2:
            raise ValueError(f"head_dim = {head_dim}: expected an even number (RoPE rotates pairs)")
        if swa_layers and n_swa < 1:
            raise ValueError(f"n_swa = {n_swa}: expected at least 1 with swa_layers (sliding-window layers)")
        self.n_layer, self.n_head, self.n_head_kv, self.head_dim = n_layer, n_head, n_head_kv, head_dim
        # layers whose token at position p1 sees only keys at p0 with p1 - p0 < n_swa
        self.swa_layers = tuple(sorted(set(int(il) for il in swa_layers)))
        self.n_swa = int(n_swa) if self.swa_layers else 0
        self.n_vocab = n_vocab
        self.n_embd = n_head * head_dim
        self.n_embd_kv = n_head_kv * head_dim
        rng = np.random.default_rng(seed)
        f32 = np.float32

        def w(n_in, n_out):
            return (rng.standard_normal((n_in, n_out)) / np.sqrt(n_in)).astype(f32)

        self.tok_embd = rng.standard_normal((n_vocab, self.n_embd)).astype(f32)
        self.wq = [w(self.n_embd, self.n_embd) for _ in range(n_layer)]
        self.wk = [w(self.n_embd, self.n_embd_kv) for _ in range(n_layer)]
        self.wv = [w(self.n_embd, self.n_embd_kv) for _ in range(n_layer)]
        self.wo = [w(self.n_embd, self.n_embd) for _ in range(n_layer)]
        self.w_out = w(self.n_embd, n_vocab)
        # theta_i = base^(-2i/d) for the pairs (2i, 2i + 1) of a head
        self.rope_freq = (rope_base ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))

    # --- the pieces a step is made of ------------------------------------------------------

    def embed(self, tokens) -> np.ndarray:
        """Token embeddings, (n, n_embd)."""
        return self.tok_embd[np.asarray(tokens, dtype=np.int64)]

    def rope(self, x: np.ndarray, pos: np.ndarray) -> np.ndarray:
        """Rotate the pairs of every head of ``x`` (n, heads * head_dim) by its token's position."""
        n = x.shape[0]
        ang = np.asarray(pos, dtype=np.float64)[:, None] * self.rope_freq[None, :]
        cos = np.cos(ang).astype(np.float32)[:, None, :]
        sin = np.sin(ang).astype(np.float32)[:, None, :]
        h = x.reshape(n, -1, self.head_dim // 2, 2)
        x0, x1 = h[..., 0], h[..., 1]
        out = np.empty_like(h)
        out[..., 0] = x0 * cos - x1 * sin
        out[..., 1] = x0 * sin + x1 * cos
        return out.reshape(n, -1)

    def qkv(self, il: int, x: np.ndarray, pos: np.ndarray):
        """Q (n, n_embd), K and V rows (n, n_embd_kv) of layer ``il``; RoPE applied to Q and K."""
        h = x / np.sqrt(np.mean(x * x, axis=1, keepdims=True) + np.float32(1e-6))
        q = self.rope(h @ self.wq[il], pos)
        k = self.rope(h @ self.wk[il], pos)
        v = h @ self.wv[il]
        return q, k, v

    def attend(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray) -> np.ndarray:
        """softmax(Q K^T / sqrt(d) + mask) V for every head; (n, n_embd).

        q: (n, n_embd); k, v: (n_kv, n_embd_kv); mask: (n, n_kv), 0 or -inf."""
        n, n_kv, d = q.shape[0], k.shape[0], self.head_dim
        group = self.n_head // self.n_head_kv
        qh = q.reshape(n, self.n_head, d).transpose(1, 0, 2)                  # (H, n, d)
        kh = k.reshape(n_kv, self.n_head_kv, d).transpose(1, 0, 2)            # (Hkv, n_kv, d)
        vh = v.reshape(n_kv, self.n_head_kv, d).transpose(1, 0, 2)
        kh = np.repeat(kh, group, axis=0)                                     # query head h uses kv head h // group
        vh = np.repeat(vh, group, axis=0)
        s = qh @ kh.transpose(0, 2, 1) * np.float32(1.0 / np.sqrt(d)) + mask[None, :, :]
        s = s - s.max(axis=2, keepdims=True)
        p = np.exp(s)
        p /= p.sum(axis=2, keepdims=True)
        return (p @ vh).transpose(1, 0, 2).reshape(n, self.n_embd)

    def residual(self, il: int, x: np.ndarray, attn: np.ndarray) -> np.ndarray:
        """The block's output: x + attn W_o."""
        return x + attn @ self.wo[il]

    def next_token(self, x_last: np.ndarray) -> int:
        """Greedy choice from the final hidden state of a sequence's last token."""
        return int(np.argmax(x_last @ self.w_out))

    # --- the reference: one sequence from scratch --------------------------------------------

    def forward(self, tokens, kv_dtype=np.float32) -> list:
        """Attention outputs of every layer, then the final hidden states, for a whole sequence
        at positions 0..len-1 with a causal mask and no cache (sliding-window layers also hide
        keys n_swa or more positions back). K/V pass through ``kv_dtype`` exactly as they would
        through the cache's storage."""
        n = len(tokens)
        pos = np.arange(n, dtype=np.int32)
        mask = np.triu(np.full((n, n), -np.inf, dtype=np.float32), k=1)
        mask_swa = mask.copy()
        if self.n_swa:
            dist = pos[:, None] - pos[None, :]
            mask_swa[dist >= self.n_swa] = -np.inf
        x = self.embed(tokens)
        outs = []
        for il in range(self.n_layer):
            q, k, v = self.qkv(il, x, pos)
            k = k.astype(kv_dtype).astype(np.float32)
            v = v.astype(kv_dtype).astype(np.float32)
            a = self.attend(q, k, v, mask_swa if il in self.swa_layers else mask)
            outs.append(a)
            x = self.residual(il, x, a)
        outs.append(x)
        return outs


@dataclass(frozen=True)
class RunConfig:
    """One demo run: cache layout and serving workload."""
    steps: int = 48
    type_kv: str = "f32"          # K and V storage type
    v_trans: bool = True          # V stored transposed
    tol: float = 1e-4             # largest accepted |cached - recomputed|
    kv_size: int = 128
    n_pad: int = 32
    n_seq_max: int = 8
    n_ubatch: int = 32            # tokens per step at most
    defrag_thold: float = 0.3     # defrag when holes exceed this share of the occupied span
    p_arrive: float = 0.6         # chance a request arrives in a step
    p_share: float = 0.5          # chance a new request reuses a running sequence's prompt prefix
    p_abort: float = 0.1          # chance a step's first placement is rolled back (restore)
    prompt_len: tuple = (4, 24)   # [lo, hi) tokens of a fresh prompt
    gen_len: tuple = (3, 24)      # [lo, hi) tokens generated per request
    iswa: bool = False            # serve through ISWACache (the model must have SWA layers)


@dataclass
class RunReport:
    """What a run did and how closely the cached attention matched recomputation."""
    type_kv: str
    v_trans: bool
    steps: int = 0
    tokens: int = 0               # tokens placed in the cache
    ubatches: int = 0
    sequences: int = 0            # sequences started
    finished: int = 0             # sequences finished and removed (seq_rm)
    shared_prefixes: int = 0      # sequences started from another's prompt cells (seq_cp)
    shared_cells: int = 0         # prompt tokens not recomputed thanks to seq_cp
    defrags: int = 0              # defrag plans applied
    cells_moved: int = 0          # cells a defrag moved
    slot_retries: int = 0         # find_slot failures resolved by a defrag
    rolled_back: int = 0          # placements undone with restore() before the real one
    max_abs_err: float = 0.0
    tol: float = 0.0
    mismatches: int = 0           # (step, sequence) pairs over the tolerance
    first_mismatch: Optional[dict] = None
    cache_errors: list = field(default_factory=list)  # bookkeeping the cache got wrong
    cache_size: int = 0
    cache_used: int = 0
    cache_n: int = 0
    swa: Optional[dict] = None    # iSWA runs: window, SWA layers, SWA cache size and use

    @property
    def ok(self) -> bool:
        """No mismatch and no bookkeeping error."""
        return self.mismatches == 0 and not self.cache_errors

    def to_dict(self) -> dict:
        """The report as plain JSON-ready values (with ``ok`` and ``occupancy``)."""
        d = dataclasses.asdict(self)
        d["ok"] = self.ok
        d["occupancy"] = self.cache_used / self.cache_size if self.cache_size else 0.0
        return d


@dataclass
class ReuseReport:
    """The prefix-reuse run: chats whose turns start from the cells of their earlier turns
    (:meth:`kvcache.UnifiedCache2026.prefix_attach`), every token checked against recomputation."""
    turns: int = 0
    prompt_tokens: int = 0        # prompt tokens of every turn
    reused_tokens: int = 0        # of those, taken from the prefix index instead of computed
    computed_tokens: int = 0      # tokens placed and computed (prompt suffixes and answers)
    max_abs_err: float = 0.0      # largest |reused - recomputed| relative to max(1, |recomputed|)
    tol: float = 0.0
    mismatches: int = 0           # computed ubatches over the tolerance

    @property
    def ok(self) -> bool:
        """Every turn matched recomputation, and the chats did reuse their history."""
        return self.mismatches == 0 and self.reused_tokens > 0

    def to_dict(self) -> dict:
        """The report as plain JSON-ready values (with ``ok``)."""
        d = dataclasses.asdict(self)
        d["ok"] = self.ok
        return d


@dataclass
class DemoReport:
    """The report of ``kvcache demo``: one or more runs of the same model."""
    seed: int
    model: dict
    runs: list
    reuse: Optional[ReuseReport] = None

    @property
    def ok(self) -> bool:
        """Every run passed."""
        return all(r.ok for r in self.runs) and (self.reuse is None or self.reuse.ok)

    def to_dict(self) -> dict:
        """The report as plain JSON-ready values."""
        d = {"seed": self.seed, "model": self.model, "ok": self.ok, "runs": [r.to_dict() for r in self.runs]}
        if self.reuse is not None:
            d["reuse"] = self.reuse.to_dict()
        return d


class _Seq:
    """A request being served: its tokens so far and how many of them the cache holds."""
    __slots__ = ("sid", "tokens", "n_prompt", "n_gen_max", "n_cached", "n_gen")

    def __init__(self, sid, tokens, n_prompt, n_gen_max, n_cached=0):
        self.sid = sid
        self.tokens = list(tokens)
        self.n_prompt = n_prompt
        self.n_gen_max = n_gen_max
        self.n_cached = n_cached
        self.n_gen = 0

    def pending(self) -> int:
        """Tokens still to be placed in the cache until the request completes (the last
        generated token is never fed back)."""
        return self.n_prompt + self.n_gen_max - 1 - self.n_cached


Tamper = Callable[[object, int, int], None]


class _Server:
    """The serving loop of one run: admission, ubatch planning, the cached forward pass, the
    check against recomputation, retirement and compaction."""

    def __init__(self, model: ToyModel, cfg: RunConfig, seed: int, tamper: Optional[Tamper]):
        if not hasattr(kvcache, "UnifiedCache"):
            raise RuntimeError("kvcache.UnifiedCache is not available in this build")
        self.model, self.cfg, self.tamper = model, cfg, tamper
        self.kv_dtype = {"f32": np.float32, "f16": np.float16}[cfg.type_kv]
        g = cfg.type_kv
        self.c: Any
        self.parts: tuple[Any, ...]
        if cfg.iswa:
            if not model.swa_layers:
                raise ValueError("an iSWA run needs a model with sliding-window layers")
            self.c = kvcache.ISWACache(cfg.kv_size, model.n_layer, model.n_embd_kv, model.n_embd_kv,
                                       swa_layers=model.swa_layers, n_swa=model.n_swa, swa_type="standard",
                                       n_batch=cfg.n_ubatch, swa_full=False, type_k=g, type_v=g,
                                       v_trans=cfg.v_trans, n_seq_max=cfg.n_seq_max, n_pad=cfg.n_pad)
            # the base cache holds every position of every sequence; the SWA cache only windows
            self.full = self.c.base
            self.parts = (self.c.base, self.c.swa)
        else:
            if model.swa_layers:
                raise ValueError("a model with sliding-window layers needs an iSWA run")
            self.c = kvcache.UnifiedCache2025(cfg.kv_size, model.n_layer, model.n_embd_kv, model.n_embd_kv,
                                              type_k=g, type_v=g, v_trans=cfg.v_trans, n_seq_max=cfg.n_seq_max,
                                              n_pad=cfg.n_pad)
            self.full = self.c
            self.parts = (self.c,)
        self.rng = np.random.default_rng(seed)
        self.rep = RunReport(type_kv=cfg.type_kv, v_trans=cfg.v_trans, tol=cfg.tol,
                             cache_size=self.full.size)
        if cfg.iswa:
            self.rep.swa = {"n_swa": model.n_swa, "swa_type": "standard", "swa_layers": list(model.swa_layers),
                            "size_swa": self.c.size_swa, "used_swa": 0, "max_used_swa": 0}
        self.active: dict = {}    # sequence id -> _Seq
        self.waiting: list = []   # requests not yet admitted: (prompt tokens, n_gen_max)
        self.free_ids = list(range(cfg.n_seq_max))
        self.step = 0

    def error(self, msg: str) -> None:
        self.rep.cache_errors.append(f"step {self.step}: {msg}")

    def spans(self) -> dict:
        """(seq_pos_min, seq_pos_max) of every running sequence."""
        return {s: (self.full.seq_pos_min(s), self.full.seq_pos_max(s)) for s in self.active}

    # --- requests in and out ------------------------------------------------------------------

    def arrive(self) -> None:
        lo, hi = self.cfg.prompt_len
        prompt = self.rng.integers(0, self.model.n_vocab, size=int(self.rng.integers(lo, hi))).tolist()
        self.waiting.append((prompt, int(self.rng.integers(*self.cfg.gen_len))))

    def admit(self) -> None:
        """Start waiting requests while a sequence id is free and the cache can hold every
        admitted request to its end; some start from a running sequence's prompt cells."""
        c, rng, rep = self.c, self.rng, self.rep
        while self.waiting and self.free_ids:
            prompt, n_gen = self.waiting[0]
            src = None
            if self.active and rng.random() < self.cfg.p_share:
                donors = [s for s in self.active.values() if s.n_cached >= 2 and s.n_prompt >= 2]
                if donors:
                    src = donors[int(rng.integers(len(donors)))]
            n_shared = int(rng.integers(1, min(src.n_prompt, src.n_cached) + 1)) if src else 0
            if src is not None and self.cfg.iswa:
                n_shared = self.window_kept(src, n_shared)
                if n_shared == 0:
                    src = None
            need = len(prompt) + n_gen - 1 + sum(s.pending() for s in self.active.values())
            if need > self.full.size - self.full.used:
                break
            self.waiting.pop(0)
            sid = self.free_ids.pop(0)
            tokens = (src.tokens[:n_shared] if src else []) + prompt
            if src is not None:
                c.seq_cp(src.sid, sid, 0, n_shared)
                rep.shared_prefixes += 1
                rep.shared_cells += n_shared
                span = (self.full.seq_pos_min(sid), self.full.seq_pos_max(sid))
                if span != (0, n_shared - 1):
                    self.error(f"after seq_cp sequence {sid} spans [{span[0]}, {span[1]}], "
                               f"expected [0, {n_shared - 1}]")
            self.active[sid] = _Seq(sid, tokens, n_prompt=len(tokens), n_gen_max=n_gen, n_cached=n_shared)
            rep.sequences += 1

    def window_kept(self, src: _Seq, n_shared: int) -> int:
        """A prefix length of ``src`` whose window the SWA cache still holds (0: none): a copy
        of the first ``n_shared`` positions gets only the SWA cells not yet pruned, and the
        next position needs the ``n_swa`` before it (as the SWA cache's own check counts them)."""
        lo = self.c.swa.seq_pos_min(src.sid)
        if lo <= 0:
            return n_shared
        # positions lo..n_shared-1 must cover min(n_swa, n_shared) cells
        n_min = lo + self.model.n_swa
        if n_min > min(src.n_prompt, src.n_cached):
            return 0
        return max(n_shared, n_min)

    def retire(self) -> None:
        """Finished requests leave the cache; their cells no other sequence holds become holes."""
        for seq in [s for s in self.active.values() if s.n_gen >= s.n_gen_max]:
            self.c.seq_rm(seq.sid)
            if self.c.seq_pos_max(seq.sid) != -1:
                self.error(f"sequence {seq.sid} still present after seq_rm")
            del self.active[seq.sid]
            self.free_ids.append(seq.sid)
            self.rep.finished += 1

    # --- the cache ----------------------------------------------------------------------------

    def defrag(self) -> bool:
        """Plan and apply a defrag of every part of the cache now; False when nothing had to move."""
        moved = False
        for c in self.parts:
            moved = self.defrag_part(c) or moved
        return moved

    def defrag_part(self, c) -> bool:
        if not c.defrag_prepare(_MAX_NODES):
            return False
        plan = np.asarray(c.defrag_ids)
        c.defrag_move()
        self.rep.defrags += 1
        self.rep.cells_moved += int(np.count_nonzero((plan != np.arange(len(plan))) & (plan != len(plan))))
        return True

    def compact(self) -> None:
        # llama.cpp's own trigger only considers caches of 2048+ cells; a small cache is compacted
        # here when holes make up more than the threshold of the cells up to the last used one
        for c in self.parts:
            c.defrag_sched(self.cfg.defrag_thold)
            if c.do_defrag:
                c.update()
                self.rep.defrags += 1
                continue
            used_max_p1 = _used_max_p1(c)
            if used_max_p1 and 1.0 - c.used / used_max_p1 > self.cfg.defrag_thold:
                self.defrag_part(c)

    def rehearse_abort(self, ub, n_tokens: int) -> None:
        """A decode that fails after placing its ubatch: restore() must give the cells back."""
        c = self.c
        before = ([p.used for p in self.parts], self.spans())
        placed = c.find_slot(ub)
        if placed:
            junk = np.full((n_tokens, self.model.n_embd_kv), 1e3, dtype=np.float32)
            for il in range(self.model.n_layer):
                c.store(il, junk, junk)
        # also after a failure: an iSWA cache may have placed the ubatch in one part
        c.restore()
        if placed:
            self.rep.rolled_back += 1
        after = ([p.used for p in self.parts], self.spans())
        if after != before:
            self.error(f"restore() left (used, spans) = {after}, expected {before}")

    def place(self, ub, n_tokens: int) -> bool:
        if self.c.find_slot(ub):
            return True
        # an iSWA cache may have placed the ubatch in one part only: undo that before retrying
        self.c.restore()
        # the free cells exist (admission reserved them) but are scattered: compact and retry
        if self.defrag() and self.c.find_slot(ub):
            self.rep.slot_retries += 1
            return True
        free = ", ".join(str(p.size - p.used) for p in self.parts)
        self.error(f"find_slot failed for {n_tokens} tokens with {free} free cells")
        return False

    # --- one step -----------------------------------------------------------------------------

    def plan(self) -> list:
        """The ubatch as (sequence, first token index, count): one token of every decoding
        sequence first, then prompt chunks while the ubatch has room."""
        budget, plan = self.cfg.n_ubatch, []
        for seq in sorted(self.active.values(), key=lambda s: s.n_cached < s.n_prompt):
            take = min(len(seq.tokens) - seq.n_cached, budget)
            if take > 0:
                plan.append((seq, seq.n_cached, take))
                budget -= take
        return plan

    def forward(self, ub, tok, pos) -> list:
        """The cached forward pass of a placed ubatch: per layer, store the new K/V rows, then
        attend over the first n cells of the cache's own buffers under its mask. Returns the
        attention output of every layer, then the final hidden states."""
        c, model = self.c, self.model
        if self.cfg.iswa:
            # each layer attends over the part holding it, under that part's mask
            masks = [np.asarray(m)[:len(tok)] for m in c.kq_mask(ub)]
            part = {il: (1 if il in model.swa_layers else 0) for il in range(model.n_layer)}
        else:
            masks = [np.asarray(c.kq_mask(ub))[:len(tok)]]
            part = {il: 0 for il in range(model.n_layer)}
        x = model.embed(tok)
        outs = []
        for il in range(model.n_layer):
            n, mask = self.parts[part[il]].n, masks[part[il]]
            q, k, v = model.qkv(il, x, pos)
            c.store(il, k, v)   # f32 rows, as a model computes them: the cache converts
            if self.tamper is not None:
                self.tamper(c, self.step, il)
            kc = np.asarray(c.k(il))[:n].astype(np.float32)
            vc = np.asarray(c.v(il))
            vc = (vc[:, :n].T if self.cfg.v_trans else vc[:n]).astype(np.float32)
            a = model.attend(q, kc, vc, mask)
            outs.append(a)
            x = model.residual(il, x, a)
        outs.append(x)
        return outs

    def check(self, plan, outs) -> None:
        """Compare every token with its sequence recomputed from scratch; advance the sequences
        and sample the next token of those that are caught up."""
        rep, row = self.rep, 0
        for seq, i0, m in plan:
            ref = self.model.forward(seq.tokens[:i0 + m], self.kv_dtype)
            err = max(float(np.max(np.abs(got[row:row + m] - want[i0:i0 + m])))
                      for got, want in zip(outs, ref))
            if np.isnan(err):
                err = float("inf")
            rep.max_abs_err = max(rep.max_abs_err, err)
            if err > self.cfg.tol:
                rep.mismatches += 1
                if rep.first_mismatch is None:
                    rep.first_mismatch = {"step": self.step, "seq_id": seq.sid,
                                          "pos": [i0, i0 + m - 1], "abs_err": err}
            seq.n_cached = i0 + m
            if seq.n_cached == len(seq.tokens) and seq.n_cached >= seq.n_prompt:
                seq.n_gen += 1
                if seq.n_gen < seq.n_gen_max:
                    seq.tokens.append(self.model.next_token(outs[-1][row + m - 1]))
            row += m
        # every running sequence holds exactly positions 0..n_cached-1
        for sid, span in self.spans().items():
            want = (0, self.active[sid].n_cached - 1)
            if span != want and want[1] >= 0:
                self.error(f"sequence {sid} spans {list(span)}, expected {list(want)}")

    def commit(self) -> None:
        """Commit the ubatch; a SWA cache pruned into a sequence's window is a failure."""
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", kvcache.SWAWarning)
            self.c.commit()
        for w in caught:
            if issubclass(w.category, kvcache.SWAWarning):
                self.error(f"SWA cache lost part of a window: {w.message}")
            else:
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        if self.rep.swa is not None:
            used = self.c.swa.used
            self.rep.swa["used_swa"] = used
            self.rep.swa["max_used_swa"] = max(self.rep.swa["max_used_swa"], used)

    def run(self) -> RunReport:
        rep = self.rep
        for _ in range(3):
            self.arrive()
        for self.step in range(self.cfg.steps):
            rep.steps = self.step + 1
            if self.rng.random() < self.cfg.p_arrive:
                self.arrive()
            self.admit()
            plan = self.plan()
            if plan:
                tok = np.concatenate([np.asarray(s.tokens[i0:i0 + m], dtype=np.int64) for s, i0, m in plan])
                pos = np.concatenate([np.arange(i0, i0 + m, dtype=np.int32) for s, i0, m in plan])
                seq_ids = [s.sid for s, _, m in plan for _ in range(m)]
                ub = kvcache.UBatch(pos=pos, seq_id=seq_ids)
                if self.cfg.iswa:
                    # the ranges commit() prunes the SWA cache with: the whole batch is this ubatch
                    self.c.sbatch_init(pos, seq_ids)
                if self.rng.random() < self.cfg.p_abort:
                    self.rehearse_abort(ub, len(tok))
                if not self.place(ub, len(tok)):
                    break
                outs = self.forward(ub, tok, pos)
                self.commit()
                rep.ubatches += 1
                rep.tokens += len(tok)
                self.check(plan, outs)
                self.retire()
                self.compact()
            if rep.cache_errors:
                break
        rep.cache_used, rep.cache_n = self.full.used, self.full.n
        if rep.swa is not None:
            rep.swa["used_swa"] = self.c.swa.used
        return rep


def run(model: ToyModel, cfg: RunConfig, seed: int, tamper: Optional[Tamper] = None) -> RunReport:
    """Serve a random workload for ``cfg.steps`` steps; check every output against recomputation.

    ``tamper(cache, step, il)``, when given, is called after the K/V rows of layer ``il`` are
    stored and before they are read back: it may alter the cache (to show the check fails)."""
    return _Server(model, cfg, seed, tamper).run()


def _used_max_p1(c) -> int:
    """One past the last non-empty cell (0 when the cache is empty)."""
    used = np.flatnonzero(np.asarray(c.cells().pos) >= 0)
    return int(used[-1]) + 1 if used.size else 0


def model_info(model: ToyModel) -> dict:
    """The model's shape, for the report."""
    return {"n_layer": model.n_layer, "n_head": model.n_head, "n_head_kv": model.n_head_kv,
            "head_dim": model.head_dim, "n_vocab": model.n_vocab}


# the iSWA run's window, on the even layers (layer 0 windowed, layer 1 full, as Gemma 2 alternates)
ISWA_N_SWA = 8


def iswa_model(seed: int, n_swa: int = ISWA_N_SWA) -> ToyModel:
    """The demo's model with a sliding window of ``n_swa`` on its even layers (same weights)."""
    return ToyModel(seed, swa_layers=(0,), n_swa=n_swa)


def reuse_run(model: ToyModel, seed: int, n_chats: int = 3, n_turns: int = 3, system_len: int = 12,
              tol: float = 1e-6, tamper: Optional[Tamper] = None) -> ReuseReport:
    """Chats served through a today's-semantics cache with prefix reuse: every chat starts
    with the same system prompt; each turn's prompt is the previous turn's prompt, its answer
    and a new message. A turn attaches the longest prefix the cache's index holds
    (``prefix_attach``), computes the rest of its prompt in one ubatch, decodes a few tokens
    greedily, and ends into the index (``prefix_release``). Every computed token's outputs, at
    every layer, are compared with the model recomputed from scratch over the whole turn."""
    rng = np.random.default_rng(seed)
    c = kvcache.UnifiedCache(256, model.n_layer, model.n_embd_kv, model.n_embd_kv, type_k="f32", type_v="f32",
                             v_trans=False, n_seq_max=n_chats, semantics="2026")
    c.enable_prefix_reuse()
    rep = ReuseReport(tol=tol)
    system = [int(t) for t in rng.integers(0, model.n_vocab, system_len)]
    history = [list(system) for _ in range(n_chats)]
    step = 0

    def compute(s: int, tokens: list, start: int) -> np.ndarray:
        # place tokens[start:], store each layer's K/V, attend over the cache under its mask
        nonlocal step
        n = len(tokens) - start
        pos = np.arange(start, len(tokens), dtype=np.int32)
        ub = kvcache.UBatch(pos, [s] * n, tokens=tokens[start:])
        if not c.find_slot(ub):
            raise RuntimeError("reuse run: the cache is full")
        mask = np.asarray(c.kq_mask(ub)).reshape(n, -1)
        x = model.embed(tokens[start:])
        outs = []
        for il in range(model.n_layer):
            q, k, v = model.qkv(il, x, pos)
            c.store(il, k, v)
            if tamper is not None:
                tamper(c, step, il)
            kc = np.asarray(c.k(il))[:mask.shape[1]]
            vc = np.asarray(c.v(il))[:mask.shape[1]]
            a = model.attend(q, kc, vc, mask)
            outs.append(a)
            x = model.residual(il, x, a)
        outs.append(x)
        step += 1
        ref = model.forward(tokens)
        # relative to the magnitude of the values (the residual stream grows with the layers)
        err = max(float(np.max(np.abs(got - want[start:])) / max(1.0, float(np.max(np.abs(want[start:])))))
                  for got, want in zip(outs, ref))
        rep.max_abs_err = max(rep.max_abs_err, err if not np.isnan(err) else float("inf"))
        if not err <= tol:
            rep.mismatches += 1
        rep.computed_tokens += n
        return outs[-1][-1]

    for _turn in range(n_turns):
        for s in range(n_chats):
            prompt = history[s] + [int(t) for t in rng.integers(0, model.n_vocab, int(rng.integers(2, 6)))]
            k = c.prefix_attach(s, prompt)
            rep.turns += 1
            rep.prompt_tokens += len(prompt)
            rep.reused_tokens += k
            tokens = list(prompt)
            last = compute(s, tokens, k)
            for _ in range(3):
                tokens.append(model.next_token(last))
                last = compute(s, tokens, len(tokens) - 1)
            c.prefix_release(s)
            history[s] = tokens
    return rep


def run_demo(seed: int = 0, steps: int = 48, tamper: Optional[Tamper] = None,
             second_run: bool = True, iswa_run: bool = True,
             iswa_tamper: Optional[Tamper] = None, reuse: bool = True,
             reuse_tamper: Optional[Tamper] = None) -> DemoReport:
    """The demo: a run with f32 K/V and transposed V (tolerance 1e-4), then a shorter one with
    f16 K/V stored as rows (its tolerance allows for f16 rounding), then a run of the same
    model with a sliding window on layer 0 served through :class:`kvcache.ISWACache` (f32 K/V,
    transposed V, tolerance 1e-4). ``tamper`` applies to the first run, ``iswa_tamper`` to the
    iSWA run."""
    model = ToyModel(seed)
    runs = [run(model, RunConfig(steps=steps), seed, tamper)]
    if second_run:
        runs.append(run(model, RunConfig(steps=max(1, steps // 2), type_kv="f16", v_trans=False,
                                         tol=5e-3), seed + 1))
    if iswa_run:
        runs.append(run(iswa_model(seed), RunConfig(steps=steps, iswa=True), seed + 2, iswa_tamper))
    rrep = reuse_run(model, seed + 3, tamper=reuse_tamper) if reuse else None
    return DemoReport(seed=seed, model=model_info(model), runs=runs, reuse=rrep)


def format_report(rep: DemoReport) -> str:
    """The human-readable report."""
    m = rep.model
    lines = [f"kvcache demo (seed {rep.seed}): {m['n_layer']} attention layers, {m['n_head']} query heads / "
             f"{m['n_head_kv']} KV heads of {m['head_dim']}, RoPE, continuous batching"]
    for r in rep.runs:
        lay = f"{r.type_kv} K/V, V {'transposed' if r.v_trans else 'rows'}"
        if r.swa is not None:
            lay += (f", iSWA (window {r.swa['n_swa']} on layers {r.swa['swa_layers']}, "
                    f"SWA cache {plural(r.swa['size_swa'], 'cell')})")
        lines.append(f"  {lay}: {plural(r.steps, 'step')}, {plural(r.tokens, 'token')} in {plural(r.ubatches, 'ubatch')}")
        lines.append(f"    sequences: {r.sequences} started, {r.finished} finished, "
                     f"{r.shared_prefixes} reusing a prefix ({plural(r.shared_cells, 'cell')} shared)")
        lines.append(f"    defrags: {r.defrags} ({plural(r.cells_moved, 'cell')} moved, {r.slot_retries} after a failed "
                     f"find_slot); placements rolled back: {r.rolled_back}")
        lines.append(f"    cache: {r.cache_used}/{r.cache_size} cells used "
                     f"({100.0 * r.cache_used / r.cache_size:.0f}%), n = {r.cache_n}")
        if r.swa is not None:
            lines.append(f"    SWA cache: {r.swa['used_swa']}/{r.swa['size_swa']} cells used "
                         f"(at most {r.swa['max_used_swa']} after a commit)")
        verdict = "ok" if r.ok else "MISMATCH"
        lines.append(f"    max |cached - recomputed| = {r.max_abs_err:.2e} (tolerance {r.tol:.0e}): {verdict}")
        if r.first_mismatch:
            fm = r.first_mismatch
            lines.append(f"    first mismatch: step {fm['step']}, sequence {fm['seq_id']}, "
                         f"positions {fm['pos'][0]}..{fm['pos'][1]}, error {fm['abs_err']:.3g}")
        if r.mismatches:
            lines.append(f"    {r.mismatches} mismatching (step, sequence) pairs")
        for e in r.cache_errors[:5]:
            lines.append(f"    cache error: {e}")
    if rep.reuse is not None:
        u = rep.reuse
        lines.append(f"  prefix reuse (today's cache, f32 K/V): {plural(u.turns, 'chat turn')}, "
                     f"{u.reused_tokens} of {plural(u.prompt_tokens, 'prompt token')} reused from earlier turns, "
                     f"{plural(u.computed_tokens, 'token')} computed")
        verdict = "ok" if u.ok else "MISMATCH"
        lines.append(f"    max |reused - recomputed| / max |recomputed| = {u.max_abs_err:.2e} (tolerance {u.tol:.0e}): "
                     f"{verdict}")
    lines.append("result: " + ("ok" if rep.ok else "FAILED"))
    return "\n".join(lines)
