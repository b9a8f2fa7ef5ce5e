"""A continuous-batching workload driven through :class:`kvcache.UnifiedCache`, for its bookkeeping.

:func:`simulate` plays a server: requests arrive (Poisson per step) with prompt and output lengths
from a seeded distribution; a share of them start with a common system prompt, which they take
from the sequence holding it with ``seq_cp`` instead of prefilling it again; every step builds one
ubatch of at most ``n_ubatch`` tokens (one decode token per generating request, then prompt chunks),
places it with ``find_slot`` and commits it; finished requests leave with ``seq_rm``; the cache is
defragmented when fragmentation passes a threshold. The K/V rows are tiny and never written: what is
measured is the cache's bookkeeping, not attention.

Two more workloads carry token ids and run on today's cache (semantics "2026") with prefix reuse,
as a server with a prompt cache runs: a finished request hands its cells to the cache's prefix
index (``prefix_release``) and a new one starts from the longest prefix the index holds
(``prefix_attach``), computing only the rest; placement evicts held cells when it needs room.

- ``chat``: conversations arrive (Poisson per step), each of several turns; a turn's prompt is
  the previous turn's prompt, its answer and a new message; the next turn arrives some steps
  after the previous one finished, while other conversations run;
- ``system``: the requests of ``random``, a share of them starting with one system prompt, which
  they find in the index instead of copying it from a sequence that holds it.

Each is also played without reuse (every prompt computed in full), on the same requests, for
comparison.

When ``find_slot`` finds no room, the step does one of three things and tries again, and every
such failure is counted with what was done about it:

- ``defrag``: enough cells are free but not in one run -> defragment now;
- ``shrink``: too few cells are free for the whole ubatch, but enough for its decode tokens ->
  cut the prompt chunks down to the free cells;
- ``evict``: too few cells even for that -> the most recently admitted request gives its cells
  back (``seq_rm``) and waits again at the head of the queue, to be recomputed from its prompt.

Fragmentation is measured with the formula of llama.cpp's ``defrag_sched``:
``max(0, 1 - (used + n_pad) / n)`` where ``n`` is the span the last ``find_slot`` made attended
(``pad(used_max_p1, n_pad)``), without its rule that caches under 2048 cells are never
fragmented."""
from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable, Optional

import numpy as np

import kvcache
from kvcache._atomic import atomic_write
from kvcache._text import plural
from kvcache.plan import MAX_SEQ, SEMANTICS, _kv_types, _row, ctx_pad_for, n_pad_for

__all__ = ["SimConfig", "SimReport", "Simulation", "simulate", "format_report", "plot_report", "plot_format", "DEFRAG_MODES",
           "LENGTH_DISTS", "WORKLOADS", "REUSE_WORKLOADS", "FRAGMENTATION_FORMULA"]

DEFRAG_MODES = ("sched", "direct", "off")
LENGTH_DISTS = ("geometric", "uniform", "fixed")
WORKLOADS = ("random", "chat", "system")
# the workloads whose requests carry token ids and reuse prefixes through the cache's index
REUSE_WORKLOADS = ("chat", "system")
# token ids are drawn uniformly from a vocabulary of this size
VOCAB = 32000
FRAGMENTATION_FORMULA = "max(0, 1 - (used + n_pad) / n)  (llama.cpp's defrag_sched, without its n >= 2048 rule)"
# Largest graph of a llama.cpp context (graph_max_nodes); bounds the moves of one defrag plan.
_MAX_NODES = 65536
_PREFIX_SEQ = 0
# Requests a run may expect (arrival_rate * steps): each one waiting is kept in memory, and each
# step draws its arrivals one by one.
MAX_ARRIVALS = 1_000_000


@dataclass
class SimConfig:
    """The geometry and the workload of a simulation (see ``kvcache simulate --help``)."""
    n_ctx: int = 4096
    n_seq_max: int = 16
    n_layer: int = 1
    n_embd: int = 8
    type_k: str = "f16"
    type_v: str = "f16"
    flash_attn: bool = False
    steps: int = 2000
    arrival_rate: float = 0.1
    dist: str = "geometric"
    prompt_mean: int = 200
    output_mean: int = 100
    prefix_share: float = 0.5
    prefix_len: int = 128
    n_ubatch: int = 512
    defrag: str = "sched"
    defrag_thold: float = 0.1
    mask: bool = False
    seed: int = 0
    semantics: str = ""                # "": "2026" for the reuse workloads, else "2025"
    workload: str = "random"
    turns: int = 4                     # chat: mean turns of a conversation
    think_steps: int = 20              # chat: mean steps between a turn's end and the next turn
    reuse: bool = True                 # chat / system: prefix reuse on (and a run without it to compare)

    def __post_init__(self) -> None:
        if not self.semantics:
            self.semantics = "2026" if self.workload in REUSE_WORKLOADS else "2025"

    def check(self) -> None:
        """ValueError naming the first setting out of range."""
        def need(ok, msg):
            if not ok:
                raise ValueError(msg)
        for name in ("n_ctx", "n_layer", "n_embd", "steps", "prompt_mean", "output_mean", "n_ubatch"):
            need(isinstance(getattr(self, name), int) and getattr(self, name) >= 1, f"{name} must be an int >= 1")
        need(1 <= self.n_seq_max <= MAX_SEQ, f"n_seq_max = {self.n_seq_max} must be in [1, {MAX_SEQ}]")
        need(math.isfinite(self.arrival_rate) and self.arrival_rate >= 0,
             f"arrival_rate = {self.arrival_rate} must be a finite number >= 0")
        expected = self.arrival_rate * self.steps
        need(expected <= MAX_ARRIVALS,
             f"arrival_rate = {self.arrival_rate} over {self.steps} steps expects {expected:.3g} requests; at most "
             f"{MAX_ARRIVALS} are simulated (each waiting request is kept): lower the arrival rate or the steps")
        need(0.0 <= self.prefix_share <= 1.0, f"prefix_share = {self.prefix_share} must be in [0, 1]")
        need(self.prefix_len >= 0, f"prefix_len = {self.prefix_len} must be >= 0")
        need(self.dist in LENGTH_DISTS, f"dist = {self.dist!r}: expected one of {', '.join(LENGTH_DISTS)}")
        need(self.semantics in SEMANTICS, f"semantics = {self.semantics!r}: expected one of {', '.join(SEMANTICS)}")
        need(self.workload in WORKLOADS, f"workload = {self.workload!r}: expected one of {', '.join(WORKLOADS)}")
        need(isinstance(self.turns, int) and self.turns >= 1, "turns must be an int >= 1")
        need(isinstance(self.think_steps, int) and self.think_steps >= 0, "think_steps must be an int >= 0")
        need(isinstance(self.reuse, bool), "reuse must be a bool")
        need(self.workload not in REUSE_WORKLOADS or self.semantics == "2026",
             f"workload = {self.workload!r} reuses prefixes through the prefix index of today's cache: "
             f"semantics must be '2026', not {self.semantics!r}")
        need(self.defrag in DEFRAG_MODES, f"defrag = {self.defrag!r}: expected one of {', '.join(DEFRAG_MODES)}")
        need(math.isfinite(self.defrag_thold), "defrag_thold must be finite")
        # the cache's rows: n_embd elements of each type, V transposed without flash attention
        tk, tv = _kv_types(self.type_k, self.type_v, self.flash_attn)
        _row(tk, self.n_embd, None, "n_embd", "type_k")
        _row(tv, self.n_embd, None, "n_embd", "type_v")
        kv_size = self.kv_size
        need(self.n_ubatch <= kv_size, f"n_ubatch = {self.n_ubatch} is more than the cache's {kv_size} cells")
        if self.sharing:
            need(self.n_seq_max >= 2, "prefix sharing needs n_seq_max >= 2 (one sequence holds the shared prefix)")
        if self.sharing or self.workload == "system":
            need(self.prefix_len < kv_size, f"prefix_len = {self.prefix_len} leaves no room in {kv_size} cells")

    @property
    def n_pad(self) -> int:
        """Cell padding: 256 with flash attention, else 32; semantics "2026": 1."""
        return n_pad_for(self.flash_attn, self.semantics)

    @property
    def kv_size(self) -> int:
        """Cells of the cache: n_ctx padded to n_pad (semantics "2026": to 256)."""
        pad = ctx_pad_for(self.flash_attn, self.semantics)
        return -(-self.n_ctx // pad) * pad

    @property
    def seed_semantics(self) -> bool:
        """The 2025 semantics: placements are committed, and defragmented by the policy (today's
        llama.cpp has neither: its placements are final and scattered)."""
        return self.semantics == "2025"

    @property
    def sharing(self) -> bool:
        """Whether some requests copy a shared prefix from the sequence holding it (the random
        workload, a share above 0 and a prefix of at least a token)."""
        return self.workload == "random" and self.prefix_share > 0 and self.prefix_len > 0

    @property
    def tokens(self) -> bool:
        """Whether requests carry token ids (the workloads that reuse prefixes)."""
        return self.workload in REUSE_WORKLOADS

    @property
    def reusing(self) -> bool:
        """Whether the cache's prefix index is on: a reuse workload with reuse."""
        return self.tokens and self.reuse

    @property
    def runs(self) -> int:
        """Simulations a run plays: with reuse, the same workload once more without it."""
        return 2 if self.reusing else 1


@dataclass
class SimReport:
    """What a simulation did and measured. ``series`` holds one value per step."""
    config: dict
    kv_size: int = 0
    n_pad: int = 0
    # requests
    arrived: int = 0
    rejected: int = 0             # longer than the cache can ever hold
    admitted: int = 0
    admitted_shared: int = 0      # admissions that took a prefix (seq_cp, or attached from the index)
    conversations: int = 0        # chat: conversations started
    served: int = 0
    evicted: int = 0
    running_at_end: int = 0
    waiting_at_end: int = 0
    # tokens
    tokens_placed: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    recomputed_tokens: int = 0    # tokens placed again after their request was evicted
    prompt_tokens: int = 0        # prompt tokens of the admitted requests (a shared prefix included)
    prefix_tokens_reused: int = 0  # of those, never placed: seq_cp of the shared prefix, or attached
    # prefix reuse: the index's side (release on finish, attach on admission)
    reuse: dict = field(default_factory=dict)
    # the same workload without reuse (chat and system workloads)
    without_reuse: dict = field(default_factory=dict)
    # kvcache calls
    calls: dict = field(default_factory=dict)
    find_slot_failures: int = 0
    failure_actions: dict = field(default_factory=lambda: {"defrag": 0, "shrink": 0, "evict": 0})
    defrags: int = 0
    cells_moved: int = 0
    defrag_steps: list = field(default_factory=list)
    # time spent inside kvcache, per call kind
    seconds: dict = field(default_factory=dict)
    # per step
    series: dict = field(default_factory=lambda: {"occupancy": [], "fragmentation": [], "running": [],
                                                  "waiting": [], "tokens": []})
    # accounting: cells in use against what the live sequences hold
    accounting: dict = field(default_factory=dict)
    latency_steps: dict = field(default_factory=dict)

    @property
    def bookkeeping_seconds(self) -> float:
        """Time spent inside kvcache calls (UBatch construction included)."""
        return sum(self.seconds.values())

    def summary(self) -> dict:
        """The derived figures: throughput, occupancy and fragmentation statistics."""
        occ = np.asarray(self.series["occupancy"], dtype=float)
        frag = np.asarray(self.series["fragmentation"], dtype=float)
        t = self.bookkeeping_seconds
        t_fs = self.seconds.get("find_slot", 0.0)
        return {
            "bookkeeping_seconds": t,
            "tokens_per_s": self.tokens_placed / t if t > 0 else None,
            "find_slot_per_s": self.calls.get("find_slot", 0) / t_fs if t_fs > 0 else None,
            "calls_per_s": sum(self.calls.values()) / t if t > 0 else None,
            "occupancy_mean": float(occ.mean()) if occ.size else 0.0,
            "occupancy_max": float(occ.max()) if occ.size else 0.0,
            "fragmentation_mean": float(frag.mean()) if frag.size else 0.0,
            "fragmentation_max": float(frag.max()) if frag.size else 0.0,
            "prefix_hit_rate": self.prefix_tokens_reused / self.prompt_tokens if self.prompt_tokens else 0.0,
        }

    def to_dict(self, series: bool = False) -> dict:
        """The report as plain data; the per-step series only when asked for."""
        d = asdict(self)
        if not series:
            d.pop("series")
        d["summary"] = self.summary()
        d["fragmentation_formula"] = FRAGMENTATION_FORMULA
        return d


class _Req:
    __slots__ = ("rid", "arrival", "prompt", "output", "shared", "sid", "admit_no", "done_prompt", "n_gen",
                 "placed", "first_token", "evictions", "tokens", "attached", "conv")

    def __init__(self, rid, arrival, prompt, output, shared, tokens=None, conv=None):
        self.rid, self.arrival, self.prompt, self.output, self.shared = rid, arrival, prompt, output, shared
        # the token ids of the prompt and the output (the token at each position), where carried
        self.tokens = tokens
        self.conv = conv          # chat: the conversation this turn belongs to
        self.attached = 0         # leading cells taken from the prefix index at admission
        self.sid = -1
        self.admit_no = -1
        self.done_prompt = 0      # own prompt tokens placed
        self.n_gen = 0            # output tokens produced
        self.placed = 0           # own cells (shared prefix not counted)
        self.first_token = -1
        self.evictions = 0

    def base_pos(self, prefix_len: int) -> int:
        return prefix_len if self.shared else 0

    @property
    def prefilling(self) -> bool:
        return self.done_prompt < self.prompt


class _Conv:
    """A chat conversation: per turn its new message, the answer to it and the steps before the
    next turn arrives; ``turn`` is the turn running or waiting."""
    __slots__ = ("messages", "answers", "gaps", "turn")

    def __init__(self, messages, answers, gaps):
        self.messages, self.answers, self.gaps, self.turn = messages, answers, gaps, 0

    def request(self, rid: int, arrival: int) -> _Req:
        """The request of the current turn: every earlier message and answer, then its message."""
        t = self.turn
        parts = [x for i in range(t) for x in (self.messages[i], self.answers[i])]
        prompt = np.concatenate(parts + [self.messages[t]])
        full = np.concatenate([prompt, self.answers[t]])
        return _Req(rid, arrival, len(prompt), len(self.answers[t]), False, full, self)


def _trie_size(prefixes: list) -> int:
    """Distinct prefixes of a list of token tuples: the cells their union takes in a radix tree."""
    total = 0
    prev: tuple = ()
    for p in sorted(prefixes):
        common = 0
        for a, b in zip(prev, p):
            if a != b:
                break
            common += 1
        total += len(p) - common
        prev = p
    return total


class Simulation:
    """One simulation: ``run()`` plays the workload; ``cache`` is the UnifiedCache it drives and
    ``running`` its live requests by sequence id (attributes: ``placed`` cells of their own,
    ``shared`` prefix or not)."""

    def __init__(self, cfg: SimConfig, progress: Optional[Callable[[int, "SimReport"], None]] = None):
        cfg.check()
        self.cfg = cfg
        self.rng = np.random.default_rng(cfg.seed)
        self.progress = progress
        self.cache = kvcache.UnifiedCache(
            kv_size=cfg.kv_size, n_layer=cfg.n_layer, n_embd_k_gqa=cfg.n_embd, n_embd_v_gqa=cfg.n_embd,
            type_k=cfg.type_k, type_v=cfg.type_v, v_trans=not cfg.flash_attn, n_seq_max=cfg.n_seq_max,
            n_pad=cfg.n_pad, buffers="owned", semantics=cfg.semantics)
        self.rep = SimReport(config=asdict(cfg), kv_size=cfg.kv_size, n_pad=cfg.n_pad)
        self.rep.calls = {k: 0 for k in ("ubatch", "find_slot", "commit", "seq_cp", "seq_rm", "kq_mask", "update",
                                         "defrag_sched", "defrag_prepare", "defrag_move", "prefix_match",
                                         "prefix_attach", "prefix_release")}
        self.rep.seconds = {k: 0.0 for k in self.rep.calls}
        self.waiting: deque = deque()
        self.running: dict = {}        # sid -> _Req, in admission order
        first = 1 if cfg.sharing else 0
        self.free_sids = deque(range(first, cfg.n_seq_max))
        self.prefix_cells = 0
        self.n_rid = 0
        self.n_admit = 0
        self.capacity = cfg.kv_size - (cfg.prefix_len if cfg.sharing else 0)
        self.ttft: list = []
        self.e2e: list = []
        self.mismatches = 0
        self.first_mismatch: Optional[dict[str, Any]] = None
        self.step = -1
        # prefix reuse: the index's cells evicted by placement, and the tokens kept at releases
        if cfg.reusing:
            self.index().enable_prefix_reuse()
        self.index_evicted = 0
        self.kept_tokens = 0
        self.shared_cells = 0           # cells attached live requests share (their prefixes' union)
        self.shared_dirty = False
        self.followups: dict = {}       # chat: step -> conversations whose next turn arrives then
        if cfg.tokens:
            self.sys_prompt = self.rng.integers(0, VOCAB, cfg.prefix_len, dtype=np.int32)

    def index(self) -> kvcache.UnifiedCache2026:
        """The cache as today's cache, whose prefix index the reuse workloads use (their
        semantics is "2026": SimConfig.check)."""
        c = self.cache
        if not isinstance(c, kvcache.UnifiedCache2026):
            raise TypeError(f"prefix reuse needs a cache of semantics 2026, not {c.semantics}")
        return c

    def index_stats(self) -> dict:
        """The prefix index's figures (prefix_stats) of a cache whose reuse is on."""
        st = self.index().prefix_stats
        if st is None:
            raise RuntimeError("prefix reuse is off for the simulated cache")
        return dict(st)

    # --- kvcache calls, timed --------------------------------------------------------------------
    def call(self, name, fn, *args):
        """fn(*args), its time and count added to the report under name."""
        t0 = time.perf_counter()
        r = fn(*args)
        self.rep.seconds[name] += time.perf_counter() - t0
        self.rep.calls[name] += 1
        return r

    def commit(self) -> None:
        """Keep the placement (the 2025 semantics' commit; today's placements are final)."""
        if isinstance(self.cache, kvcache.UnifiedCache2025):
            self.call("commit", self.cache.commit)

    def defrag_now(self) -> bool:
        """Plan and apply a defrag; False when nothing had to move (or, today's llama.cpp,
        there is no defrag)."""
        c = self.cache
        if not isinstance(c, kvcache.UnifiedCache2025):
            return False
        if not self.call("defrag_prepare", c.defrag_prepare, _MAX_NODES):
            return False
        ids = c.defrag_ids
        self.call("defrag_move", c.defrag_move)
        self._count_defrag(ids)
        return True

    def _count_defrag(self, ids) -> None:
        self.rep.defrags += 1
        self.rep.cells_moved += int(np.count_nonzero((ids != np.arange(len(ids))) & (ids != len(ids))))
        self.rep.defrag_steps.append(self.step)

    def fragmentation(self) -> float:
        """The defrag measure max(0, 1 - (used + n_pad) / n), 0 while n is 0 (the cache's own)."""
        return self.cache.fragmentation

    # --- workload --------------------------------------------------------------------------------
    def draw_len(self, mean: int) -> int:
        """A prompt or output length (>= 1) of the given mean, from the configured distribution."""
        d = self.cfg.dist
        if d == "fixed":
            return mean
        if d == "uniform":
            return int(self.rng.integers(1, 2 * mean))          # [1, 2*mean - 1], mean `mean`
        return int(self.rng.geometric(1.0 / mean))               # >= 1, mean `mean`

    def draw_tokens(self, n: int) -> np.ndarray:
        """n token ids drawn from the workload's generator."""
        return self.rng.integers(0, VOCAB, n, dtype=np.int32)

    def arrivals(self) -> None:
        """This step's new requests (Poisson); those that could never fit the cache are rejected.
        Chat: this step's new conversations, after the next turns of earlier ones."""
        cfg = self.cfg
        if cfg.workload == "chat":
            for conv in self.followups.pop(self.step, []):
                self.enqueue(conv.request(self.n_rid + 1, self.step))
            for _ in range(int(self.rng.poisson(cfg.arrival_rate))):
                n = self.draw_len(cfg.turns)
                msgs = [self.draw_tokens(self.draw_len(cfg.prompt_mean)) for _ in range(n)]
                answers = [self.draw_tokens(self.draw_len(cfg.output_mean)) for _ in range(n)]
                gaps = [self.draw_len(cfg.think_steps) if cfg.think_steps else 0 for _ in range(n)]
                self.rep.conversations += 1
                self.enqueue(_Conv(msgs, answers, gaps).request(self.n_rid + 1, self.step))
            return
        for _ in range(int(self.rng.poisson(cfg.arrival_rate))):
            prompt, output = self.draw_len(cfg.prompt_mean), self.draw_len(cfg.output_mean)
            draw = cfg.prefix_share > 0 and cfg.prefix_len > 0 and bool(self.rng.random() < cfg.prefix_share)
            if cfg.workload == "system":
                # the system prompt (for a share of them), then the request's own prompt and output
                head = self.sys_prompt if draw else self.sys_prompt[:0]
                tokens = np.concatenate([head, self.draw_tokens(prompt + output)])
                self.enqueue(_Req(self.n_rid + 1, self.step, len(head) + prompt, output, False, tokens))
            else:
                self.enqueue(_Req(self.n_rid + 1, self.step, prompt, output, draw))

    def enqueue(self, r: _Req) -> None:
        """A new request waits, unless it could never fit the cache (rejected)."""
        self.rep.arrived += 1
        self.n_rid += 1
        # a request places its prompt and every output token but the last (never fed back)
        if r.prompt + r.output - 1 > self.capacity:
            self.rep.rejected += 1
            return
        self.waiting.append(r)

    def setup_prefix(self) -> None:
        """Prefill the shared system prompt into its own sequence, before any request."""
        cfg, c = self.cfg, self.cache
        done = 0
        while done < cfg.prefix_len:
            n = min(cfg.n_ubatch, cfg.prefix_len - done)
            ub = self.call("ubatch", kvcache.UBatch, np.arange(done, done + n), [_PREFIX_SEQ] * n)
            if not self.call("find_slot", c.find_slot, ub):     # an empty cache: cannot happen
                raise RuntimeError(f"find_slot failed for the shared prefix in an empty cache of {c.size} cells")
            self.commit()
            done += n
        self.prefix_cells = cfg.prefix_len

    def admit(self) -> None:
        """Start waiting requests, first come first served, while a sequence id is free and the
        next prompt fits in the free cells (a shared-prefix request copies the prefix sequence;
        with prefix reuse, a request attaches the longest prefix the index holds and only the
        rest of its prompt must fit; cells only the index holds count as free: placement evicts
        them)."""
        c, rep, cfg = self.cache, self.rep, self.cfg
        # first come, first served; a request starts only when its prompt fits in the free cells now
        while self.waiting and self.free_sids:
            r = self.waiting[0]
            held = self.call("prefix_match", self.index().prefix_match, r.tokens[:r.prompt]) if cfg.reusing else 0
            if r.prompt - held > c.size - c.used:
                break
            self.waiting.popleft()
            r.sid = self.free_sids.popleft()
            r.admit_no = self.n_admit
            self.n_admit += 1
            self.running[r.sid] = r
            rep.admitted += 1
            rep.prompt_tokens += r.prompt + (cfg.prefix_len if r.shared else 0)
            if r.shared:
                self.call("seq_cp", c.seq_cp, _PREFIX_SEQ, r.sid, -1, -1)
                rep.admitted_shared += 1
                rep.prefix_tokens_reused += cfg.prefix_len
            elif held:
                k = self.call("prefix_attach", self.index().prefix_attach, r.sid, r.tokens[:r.prompt])
                r.attached = r.done_prompt = r.placed = k
                rep.admitted_shared += 1
                rep.prefix_tokens_reused += k
                self.shared_dirty = True

    def plan_batch(self, budget: int) -> list:
        """The ubatch as (request, first position, count): a decode token of every generating
        request first (oldest first), then prompt chunks while the budget lasts."""
        out, left = [], budget
        reqs = sorted(self.running.values(), key=lambda r: r.admit_no)
        for r in reqs:
            if left and not r.prefilling:
                out.append((r, r.base_pos(self.cfg.prefix_len) + r.placed, 1))
                left -= 1
        for r in reqs:
            if left and r.prefilling:
                n = min(left, r.prompt - r.done_prompt)
                out.append((r, r.base_pos(self.cfg.prefix_len) + r.placed, n))
                left -= n
        return out

    def make_ubatch(self, parts: list):
        """The UBatch of planned (request, first position, count) parts (with prefix reuse, with
        the token of every position: the index learns from them what each cell holds)."""
        pos = np.concatenate([np.arange(p, p + n) for _, p, n in parts])
        sids = [s for r, _, n in parts for s in [r.sid] * n]
        if self.cfg.reusing:
            tokens = np.concatenate([r.tokens[p:p + n] for r, p, n in parts])
            return self.call("ubatch", _ubatch_with_tokens, pos, sids, tokens)
        return self.call("ubatch", kvcache.UBatch, pos, sids)

    def evict_youngest(self) -> None:
        """Drop the most recently admitted request's cells and queue it again at the front (its
        tokens are recomputed later)."""
        r = max(self.running.values(), key=lambda q: q.admit_no)
        self.call("seq_rm", self.cache.seq_rm, r.sid, -1, -1)
        del self.running[r.sid]
        self.free_sids.append(r.sid)
        self.rep.evicted += 1
        self.rep.recomputed_tokens += r.placed - r.attached
        self.shared_dirty |= r.attached > 0
        r.evictions += 1
        r.sid, r.done_prompt, r.n_gen, r.placed, r.first_token, r.attached = -1, 0, 0, 0, -1, 0
        self.waiting.appendleft(r)

    def place(self) -> tuple:
        """Find room for this step's ubatch, resolving failures: (parts placed, ubatch)."""
        c, rep, cfg = self.cache, self.rep, self.cfg
        budget = cfg.n_ubatch
        for _ in range(4 * cfg.n_seq_max + 64):
            parts = self.plan_batch(budget)
            if not parts:
                return [], None
            ub = self.make_ubatch(parts)
            held = self.held()
            ok = self.call("find_slot", c.find_slot, ub)
            self.index_evicted += held - self.held()
            if ok:
                return parts, ub
            rep.find_slot_failures += 1
            n_tokens = len(ub)
            free = c.size - c.used
            n_decode = sum(1 for r, _, _ in parts if not r.prefilling)
            if free >= n_tokens and self.defrag_now():
                rep.failure_actions["defrag"] += 1
            elif n_decode < free < n_tokens:
                budget = free
                rep.failure_actions["shrink"] += 1
            elif len(self.running) > 1:
                self.evict_youngest()
                rep.failure_actions["evict"] += 1
            else:
                # one request that fits the cache alone (arrivals check it) and still has no room
                raise RuntimeError(f"find_slot failed for {n_tokens} tokens of a lone request with {free} free "
                                   f"cells out of {c.size}")
        raise RuntimeError("find_slot kept failing after every remedy")

    def advance(self, parts: list) -> None:
        """Account for the tokens of a placed ubatch: prompt progress, first and later outputs."""
        rep = self.rep
        for r, _, n in parts:
            r.placed += n
            if r.prefilling:
                r.done_prompt += n
                rep.prefill_tokens += n
                if not r.prefilling:          # the last prompt token yields the first output token
                    r.n_gen = 1
                    r.first_token = self.step
                    self.ttft.append(self.step - r.arrival)
            else:
                r.n_gen += 1
                rep.decode_tokens += 1
            rep.tokens_placed += n

    def held(self) -> int:
        """Cells the prefix index holds (0 without reuse)."""
        return self.index_stats()["cells"] if self.cfg.reusing else 0

    def finish(self) -> None:
        """Retire the requests that produced all their output tokens: their cells are removed,
        or, with prefix reuse, handed to the index. Chat: the conversation's next turn is due."""
        c, rep = self.cache, self.rep
        for r in [r for r in self.running.values() if not r.prefilling and r.n_gen >= r.output]:
            if self.cfg.reusing:
                self.kept_tokens += self.call("prefix_release", self.index().prefix_release, r.sid)
                self.shared_dirty |= r.attached > 0
            else:
                self.call("seq_rm", c.seq_rm, r.sid, -1, -1)
            del self.running[r.sid]
            self.free_sids.append(r.sid)
            rep.served += 1
            self.e2e.append(self.step - r.arrival)
            conv = r.conv
            if conv is not None and conv.turn + 1 < len(conv.messages):
                due = self.step + max(1, conv.gaps[conv.turn])
                conv.turn += 1
                self.followups.setdefault(due, []).append(conv)

    def expected_used(self) -> int:
        """Cells in use by the rule: the shared prefix, each live request's own cells, and once
        the cells that attached requests took from the index (the union of their prefixes)."""
        if self.shared_dirty:
            self.shared_cells = _trie_size([tuple(r.tokens[:r.attached].tolist())
                                            for r in self.running.values() if r.attached])
            self.shared_dirty = False
        return self.prefix_cells + self.shared_cells + sum(r.placed - r.attached for r in self.running.values())

    def check_accounting(self) -> None:
        """Count a mismatch when the cells in use differ from the prefix plus what each live
        request placed (attached prefixes counted once)."""
        expect = self.expected_used()
        if self.cache.used != expect:
            self.mismatches += 1
            if self.first_mismatch is None:
                self.first_mismatch = {"step": self.step, "cells_used": self.cache.used, "expected": expect}

    # --- the loop --------------------------------------------------------------------------------
    def run(self) -> SimReport:
        """Play every step (arrivals, admission, scheduled defrag, placement, mask, commit,
        retirement, direct defrag, accounting) and return the report."""
        cfg, c, rep = self.cfg, self.cache, self.rep
        self.step = -1
        if cfg.sharing:
            self.setup_prefix()
        for self.step in range(cfg.steps):
            self.arrivals()
            self.admit()
            if cfg.defrag == "sched" and self.running and isinstance(c, kvcache.UnifiedCache2025):
                # llama.cpp applies the defrag scheduled by the previous decode when the next begins
                if c.do_defrag:
                    moved = self.call("update", c.update)
                    if moved:
                        self._count_defrag(c.defrag_ids)
            parts, ub = self.place()
            if parts:
                if cfg.mask:
                    self.call("kq_mask", c.kq_mask, ub)
                self.commit()
                self.advance(parts)
            self.finish()
            if not isinstance(c, kvcache.UnifiedCache2025):
                pass        # today's llama.cpp does not defragment
            elif cfg.defrag == "sched" and parts and cfg.defrag_thold >= 0:
                self.call("defrag_sched", c.defrag_sched, cfg.defrag_thold)
            elif cfg.defrag == "direct" and cfg.defrag_thold >= 0 and self.fragmentation() > cfg.defrag_thold:
                self.defrag_now()
            self.check_accounting()
            s = rep.series
            s["occupancy"].append(c.used / c.size)
            s["fragmentation"].append(self.fragmentation())
            s["running"].append(len(self.running))
            s["waiting"].append(len(self.waiting))
            s["tokens"].append(sum(n for _, _, n in parts))
            if self.progress is not None:
                self.progress(self.step + 1, rep)
        self.final_checks()
        return rep

    def final_checks(self) -> None:
        """Fill the report's end-of-run accounting (cells, positions) and latency statistics."""
        c, rep = self.cache, self.rep
        rep.running_at_end = len(self.running)
        rep.waiting_at_end = len(self.waiting)
        expect = self.expected_used()
        index_ok = True
        if self.cfg.reusing:
            try:
                self.index()._prefix_check()
            except RuntimeError:
                index_ok = False
            st = self.index_stats()
            rep.reuse = {"index_evicted_cells": self.index_evicted, "kept_tokens": self.kept_tokens,
                         "held_at_end": st["cells"], "nodes_at_end": st["nodes"], "index_ok": index_ok}
        # every live sequence ends where its placed tokens say
        pos_ok = all(c.seq_pos_max(r.sid) == r.base_pos(self.cfg.prefix_len) + r.placed - 1
                     for r in self.running.values() if r.placed)
        rep.accounting = {
            "cells_used": c.used, "expected": expect,
            "rule": "cells used == shared prefix (once) + the cells each live request placed"
                    + (", prefixes attached from the index counted once" if self.cfg.reusing else ""),
            "ok": c.used == expect and self.mismatches == 0 and pos_ok and index_ok,
            "steps_checked": self.step + 1, "mismatched_steps": self.mismatches,
            "first_mismatch": self.first_mismatch, "positions_ok": pos_ok,
            "failures_resolved": sum(rep.failure_actions.values()),
        }
        rep.latency_steps = {"time_to_first_token": _stats(self.ttft), "end_to_end": _stats(self.e2e)}


def _stats(xs: list) -> dict:
    if not xs:
        return {"n": 0, "mean": None, "p50": None, "p95": None, "max": None}
    a = np.asarray(xs, dtype=float)
    return {"n": len(xs), "mean": float(a.mean()), "p50": float(np.percentile(a, 50)),
            "p95": float(np.percentile(a, 95)), "max": float(a.max())}


def _ubatch_with_tokens(pos, sids, tokens):
    return kvcache.UBatch(pos, sids, tokens=tokens)


def simulate(cfg: SimConfig, progress: Optional[Callable[[int, SimReport], None]] = None) -> SimReport:
    """Run the workload ``cfg`` describes; ``progress(step, report)`` is called after every step
    (``cfg.runs * cfg.steps`` calls: with prefix reuse the same workload is then played without
    it, into the report's ``without_reuse``)."""
    rep = Simulation(cfg, progress).run()
    if cfg.reusing:
        after = None if progress is None else (lambda step, r: progress(cfg.steps + step, r))
        off = Simulation(replace(cfg, reuse=False), after).run()
        s = off.summary()
        rep.without_reuse = {
            "served": off.served, "evicted": off.evicted, "prompt_tokens": off.prompt_tokens,
            "prefill_tokens": off.prefill_tokens, "tokens_placed": off.tokens_placed,
            "find_slot_failures": off.find_slot_failures, "latency_steps": off.latency_steps,
            "occupancy_mean": s["occupancy_mean"], "bookkeeping_seconds": s["bookkeeping_seconds"],
            "accounting_ok": off.accounting["ok"]}
        rep.accounting["ok"] = rep.accounting["ok"] and off.accounting["ok"]
    return rep


# --- output ----------------------------------------------------------------------------------------

def _rate(x) -> str:
    if x is None:
        return "n/a"
    for unit, div in (("M", 1e6), ("k", 1e3)):
        if x >= div:
            return f"{x / div:.2f}{unit}"
    return f"{x:.0f}"


def format_report(rep: SimReport) -> str:
    """The report as the text ``kvcache simulate`` prints."""
    cfg, s = rep.config, rep.summary()
    a, fa = rep.accounting, rep.failure_actions
    lat = rep.latency_steps
    workload = cfg.get("workload", "random")
    lines = [
        f"kvcache simulate: {plural(cfg['steps'], 'step')}, seed {cfg['seed']}",
        f"  cache: {rep.kv_size} cells (n_pad {rep.n_pad}), {plural(cfg['n_seq_max'], 'sequence')}, {plural(cfg['n_layer'], 'layer')} "
        f"of width {cfg['n_embd']}, K {cfg['type_k']} / V {cfg['type_v']}, semantics {cfg.get('semantics', '2025')}",
        _workload_line(cfg),
        "",
        "requests",
        f"  arrived {rep.arrived}, served {rep.served}, rejected (longer than the cache) {rep.rejected}, "
        f"still running {rep.running_at_end}, waiting {rep.waiting_at_end}"
        + (f"; {plural(rep.conversations, 'conversation')}" if workload == "chat" else ""),
        f"  admitted {rep.admitted} ({rep.admitted_shared} took "
        + ("a prefix from the index" if workload in REUSE_WORKLOADS else "the shared prefix with seq_cp")
        + f", {rep.prefix_tokens_reused} of {rep.prompt_tokens} prompt tokens not recomputed), evicted {rep.evicted}",
        f"  latency in steps: first token mean {_num(lat['time_to_first_token']['mean'])} "
        f"p95 {_num(lat['time_to_first_token']['p95'])}, end to end mean {_num(lat['end_to_end']['mean'])} "
        f"p95 {_num(lat['end_to_end']['p95'])}",
        "bookkeeping",
        f"  tokens placed {rep.tokens_placed} (prefill {rep.prefill_tokens}, decode {rep.decode_tokens}, "
        f"recomputed after eviction {rep.recomputed_tokens})",
        f"  time in kvcache calls {s['bookkeeping_seconds'] * 1e3:.1f} ms (UBatch construction "
        f"{rep.seconds['ubatch'] * 1e3:.1f} ms, find_slot {rep.seconds['find_slot'] * 1e3:.1f} ms)",
        f"  {_rate(s['tokens_per_s'])} tokens placed/s, find_slot {_rate(s['find_slot_per_s'])} calls/s "
        f"({rep.calls['find_slot']} calls)",
        "memory",
        f"  occupancy (used / cells): mean {s['occupancy_mean']:.1%}, max {s['occupancy_max']:.1%}",
        f"  fragmentation: mean {s['fragmentation_mean']:.3f}, max {s['fragmentation_max']:.3f}",
        f"    = {FRAGMENTATION_FORMULA}",
        (f"  defrag ({cfg['defrag']}, threshold {cfg['defrag_thold']}): {rep.defrags} defrags, "
         f"{rep.cells_moved} cells moved" if cfg.get("semantics", "2025") == "2025"
         else "  defrag: none (today's llama.cpp places tokens in any free cells and does not defragment)"),
        f"  find_slot failures {rep.find_slot_failures}: defragmented and retried {fa['defrag']}, "
        f"shrank the ubatch {fa['shrink']}, evicted a request {fa['evict']}",
        "accounting",
        f"  cells used {a['cells_used']} == shared prefix + live requests' cells {a['expected']}: "
        f"{'ok' if a['ok'] else 'MISMATCH'} (checked every step, {a['mismatched_steps']} mismatched)",
    ]
    if rep.reuse:
        u, w = rep.reuse, rep.without_reuse
        wl = w["latency_steps"]
        lines[-2:-2] = [
            "prefix reuse (finished requests' cells kept in the cache's prefix index, attached by later requests)",
            f"  prompt tokens reused {rep.prefix_tokens_reused} of {rep.prompt_tokens} "
            f"(hit rate {s['prefix_hit_rate']:.1%}), {rep.admitted_shared} of {rep.admitted} admissions hit",
            f"  index: {u['kept_tokens']} tokens kept at releases, {u['index_evicted_cells']} cells evicted by "
            f"placement, {u['held_at_end']} cells held at the end ({u['nodes_at_end']} nodes)",
            f"  without reuse (the same requests): prefill {w['prefill_tokens']} tokens (with reuse "
            f"{rep.prefill_tokens}), served {w['served']}, evicted {w['evicted']}, first token mean "
            f"{_num(wl['time_to_first_token']['mean'])} p95 {_num(wl['time_to_first_token']['p95'])} steps, "
            f"time in kvcache calls {w['bookkeeping_seconds'] * 1e3:.1f} ms",
        ]
    return "\n".join(lines)


def _workload_line(cfg: dict) -> str:
    """The report's line on the workload."""
    w = cfg.get("workload", "random")
    lengths = f"{cfg['dist']} lengths"
    if w == "chat":
        think = f"{cfg['think_steps']} steps" if cfg["think_steps"] else "none"
        return (f"  workload: chat, {cfg['arrival_rate']} new conversations/step of {cfg['turns']} turns (mean), "
                f"{lengths} (message mean {cfg['prompt_mean']}, answer mean {cfg['output_mean']}), think time "
                f"{think} (mean); a turn's prompt is the conversation so far; ubatch {cfg['n_ubatch']} tokens, "
                f"prefix reuse {'on' if cfg['reuse'] else 'off'}")
    line = (f"  workload: {w}, {cfg['arrival_rate']} arrivals/step, {lengths} (prompt mean {cfg['prompt_mean']}, "
            f"output mean {cfg['output_mean']}), {cfg['prefix_share']:.0%} ")
    if w == "system":
        return (line + f"start with a {cfg['prefix_len']}-token system prompt, ubatch {cfg['n_ubatch']} tokens, "
                f"prefix reuse {'on' if cfg['reuse'] else 'off'}")
    return line + f"share a {cfg['prefix_len']}-token prefix, ubatch {cfg['n_ubatch']} tokens"


def _num(x) -> str:
    return "n/a" if x is None else f"{x:.1f}"


def plot_format(path: str) -> str:
    """The image format of a plot file, from its extension (needs matplotlib); ValueError for an
    extension matplotlib does not write."""
    import os

    from matplotlib.backend_bases import FigureCanvasBase

    ext = os.path.splitext(path)[1].lower().lstrip(".")
    known = FigureCanvasBase.get_supported_filetypes()
    if ext not in known:
        what = f"the extension .{ext}" if ext else "no extension"
        raise ValueError(f"{path}: {what} names no image format matplotlib writes "
                         f"({', '.join('.' + k for k in sorted(known))})")
    return ext


def plot_report(rep: SimReport, path: str) -> None:
    """Draw occupancy and fragmentation over the steps into an image file, in the format its
    extension names (.png, .svg, .pdf, ...: :func:`plot_format`; needs matplotlib)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fmt = plot_format(path)

    steps = np.arange(1, len(rep.series["occupancy"]) + 1)
    fig = Figure(figsize=(9, 5.5), dpi=100)
    FigureCanvasAgg(fig)
    ax1, ax2 = fig.subplots(2, 1, sharex=True)
    ax1.plot(steps, rep.series["occupancy"], lw=1, color="tab:blue", label="occupancy (used / cells)")
    ax1.set_ylim(0, 1.02)
    ax1.set_ylabel("occupancy")
    ax2.plot(steps, rep.series["fragmentation"], lw=1, color="tab:red", label="fragmentation")
    thold = rep.config["defrag_thold"]
    if rep.config["defrag"] != "off" and thold >= 0:
        ax2.axhline(thold, color="grey", ls="--", lw=0.8, label=f"defrag threshold {thold}")
    ax2.set_ylabel("fragmentation")
    ax2.set_xlabel("step")
    for x in rep.defrag_steps:
        for ax in (ax1, ax2):
            ax.axvline(x + 1, color="tab:green", lw=0.5, alpha=0.5)
    for ax in (ax1, ax2):
        ax.legend(loc="upper right", fontsize=8)
        ax.grid(alpha=0.3)
    fig.suptitle(f"kvcache simulate: {rep.kv_size} cells, {rep.config['n_seq_max']} sequences, "
                 f"{rep.defrags} defrags (green), seed {rep.config['seed']}", fontsize=10)
    with atomic_write(path) as f:
        fig.savefig(f, format=fmt)

