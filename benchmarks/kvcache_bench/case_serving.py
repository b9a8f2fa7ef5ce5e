"""`kvcache bench --case serving`: one seeded serving workload replayed identically through
kvcache and, where they can be imported, the KV bookkeeping of the servers a user would pick
instead: vLLM v1's ``KVCacheManager`` and SGLang's ``RadixCache`` with its token pools. Only
the bookkeeping is replayed (no K/V data, no model): what each costs per step, driven from
Python as its server drives it, measured as the CPU time of the driving thread.

The workloads: ``n_slots`` requests run at once, ``8 * n_slots`` in all; a prompt is fed in
chunks of at most 512 tokens, one chunk per step; then the request decodes one token per step
until it has all its outputs (the first comes with its last chunk); a finished request is
replaced at once (admitted at the start of the next step). The capacity is 1024 tokens per
running request.

- independent requests: a prompt has U[64, 1024] tokens (with a shared system prompt its first
  256 are the same for every request), U[16, 256] outputs;
- multi-turn chat: ``2 * n_slots`` conversations of 4 turns; a turn's prompt is the previous
  turn's prompt, its answer (every output token) and a new message (U[32, 256] tokens the first
  turn, U[16, 128] later), U[16, 128] outputs; a conversation's next turn waits at the back of
  the queue, behind the turns of the other conversations, so its history must survive about
  ``n_slots`` other requests in the cache.

kvcache runs a today's-semantics cache with prefix reuse (a finished request's cells go to the
cache's prefix index, as do a running request's computed chunks while its prompt is unfinished;
a new one attaches the longest prefix it holds; cells held for no live request take no sequence
id); ``replay_kvcache_donor`` is the scheme without an index: a new
request copies the system prompt from a running request that computed it (``seq_cp``)."""
from __future__ import annotations

import gc
import importlib.abc
import importlib.machinery
import random
import statistics
import sys
import time
import types
from dataclasses import dataclass, field

import numpy as np

from kvcache_bench._rows import Row

CHUNK = 512
TOKENS_PER_SLOT = 1024
SYSTEM_PROMPT = 256
VOCAB = 32000
TURNS = 4
# the workloads of the rows: no shared prefix, a shared system prompt, multi-turn chat
WORKLOADS = ("none", "system", "chat")


@dataclass
class Req:
    rid: int
    prompt: list[int]
    out_len: int


def schedule(n_slots: int, n_requests: int, seed: int = 0, system: int = 0, chat: bool = False) -> list[list[tuple]]:
    """The events of every step, in order: ("admit", rid, prompt, out_len), ("prefill", rid,
    start, n, sampled), ("decode", rid, pos, token, sampled) (the KV of `token` at `pos` is
    computed; `sampled` is the token the step samples for the request: after its last chunk and
    after every decode, else None), ("finish", rid). Admissions come first in a step, finishes
    last. chat: the multi-turn chat workload (``system`` is ignored)."""
    rng = random.Random(seed)
    source = _Chat(rng, 2 * n_slots, n_requests) if chat else _Independent(rng, n_requests, system)
    running = [r for r in (source.next() for _ in range(n_slots)) if r is not None]
    admit = list(running)
    steps: list[list[tuple]] = []
    while running:
        ev: list[tuple] = [("admit", r["rid"], r["prompt"], r["out"]) for r in admit]
        admit = []
        done = []
        for r in running:
            n_prompt = len(r["prompt"])
            if r["done"] < n_prompt:
                n = min(CHUNK, n_prompt - r["done"])
                start = r["done"]
                r["done"] += n
                sampled = None
                if r["done"] == n_prompt:
                    sampled = rng.randrange(VOCAB)
                    r["outputs"].append(sampled)
                ev.append(("prefill", r["rid"], start, n, sampled))
            else:
                fed = r["outputs"][-1]
                r["done"] += 1
                r["outputs"].append(rng.randrange(VOCAB))
                ev.append(("decode", r["rid"], r["done"] - 1, fed, r["outputs"][-1]))
            if len(r["outputs"]) >= r["out"]:
                done.append(r)
        for r in done:
            running.remove(r)
            ev.append(("finish", r["rid"]))
            source.finished(r)
            nr = source.next()
            if nr is not None:
                running.append(nr)
                admit.append(nr)
        steps.append(ev)
    return steps


class _Independent:
    """Requests of U[64, 1024] prompt tokens (the first ``system`` shared), U[16, 256] outputs."""

    def __init__(self, rng: random.Random, n_requests: int, system: int):
        self.rng, self.left, self.system, self.rid = rng, n_requests, system, 0
        self.sys_prompt = [rng.randrange(VOCAB) for _ in range(system)]

    def next(self) -> dict | None:
        if self.rid >= self.left:
            return None
        rng = self.rng
        p, o = rng.randint(64, 1024), rng.randint(16, 256)
        body = [rng.randrange(VOCAB) for _ in range(max(0, p - self.system))]
        self.rid += 1
        return {"rid": self.rid - 1, "prompt": (self.sys_prompt + body)[:p], "out": o, "done": 0, "outputs": []}

    def finished(self, r: dict) -> None:
        pass


class _Chat:
    """Turns of ``n_conv`` conversations: a finished turn's conversation queues its next turn
    behind the others'."""

    def __init__(self, rng: random.Random, n_conv: int, n_requests: int):
        self.rng, self.left, self.rid = rng, n_requests, 0
        self.ready = list(range(n_conv))      # conversations whose next turn waits, in order
        self.history: dict[int, list[int]] = {c: [] for c in self.ready}
        self.turn = dict.fromkeys(self.ready, 0)

    def next(self) -> dict | None:
        if self.rid >= self.left or not self.ready:
            return None
        rng = self.rng
        conv = self.ready.pop(0)
        n = rng.randint(32, 256) if not self.turn[conv] else rng.randint(16, 128)
        prompt = self.history[conv] + [rng.randrange(VOCAB) for _ in range(n)]
        self.rid += 1
        return {"rid": self.rid - 1, "prompt": prompt, "out": rng.randint(16, 128), "done": 0, "outputs": [],
                "conv": conv}

    def finished(self, r: dict) -> None:
        conv = r["conv"]
        self.history[conv] = r["prompt"] + r["outputs"]
        self.turn[conv] += 1
        if self.turn[conv] < TURNS:
            self.ready.append(conv)


# a replay's invariants are checked after every CHECK_EVERY-th step and after the last, untimed;
# the step after a check is not counted on any side (a check reads the whole cache, leaving the
# CPU caches as no server step would), so every side counts the same steps
CHECK_EVERY = 16


@dataclass
class Replay:
    """What one replay measured: CPU time of the driving thread per step (ns), wall time per step
    (ns), for every step; tokens served from a cached prefix, and driver-specific counters. The
    means count the steps :func:`counted` names."""
    cpu: list[int] = field(default_factory=list)
    wall: list[int] = field(default_factory=list)
    hits: int = 0
    counters: dict = field(default_factory=dict)

    @property
    def cpu_mean(self) -> float:
        return statistics.fmean(self.cpu[i] for i in counted(len(self.cpu)))

    @property
    def cpu_sum(self) -> int:
        return sum(self.cpu[i] for i in counted(len(self.cpu)))

    @property
    def wall_median(self) -> float:
        return statistics.median(self.wall[i] for i in counted(len(self.wall)))


def counted(n_steps: int) -> list[int]:
    """The steps of a replay of n_steps whose times count: all but those right after a check."""
    return [i for i in range(n_steps) if i == 0 or i % CHECK_EVERY]


def _timed(steps, one_step, check=None) -> Replay:
    """Run one_step on every step's events, timed; check() after every CHECK_EVERY-th step and
    after the last, untimed (every side times every step: :func:`counted` picks the same ones).

    What is alive when the replay starts (the schedule above all: millions of tuples, which no
    server holds) is frozen out of Python's cyclic garbage collector for the replay
    (``gc.freeze()``), for every side alike, so that a collection a step triggers traverses what
    the side made, never the schedule (vLLM's engine freezes its start-up heap the same way;
    SGLang has a freeze_gc). Measured on the workloads here it changes no side's figure: no
    collection runs inside kvcache's steps at all, and the few inside SGLang's and vLLM's
    (young generations only, about 12 and 9 of the 694 steps of chat at 256 requests) run
    with or without it."""
    out = Replay()
    gc.collect()
    gc.freeze()
    try:
        for i, ev in enumerate(steps):
            c0, w0 = time.thread_time_ns(), time.perf_counter_ns()
            one_step(ev)
            out.wall.append(time.perf_counter_ns() - w0)
            out.cpu.append(time.thread_time_ns() - c0)
            if check is not None and ((i + 1) % CHECK_EVERY == 0 or i + 1 == len(steps)):
                check()
    finally:
        gc.unfreeze()
    return out


# --- kvcache -------------------------------------------------------------------------------------

def replay_kvcache(steps, n_slots: int, capacity: int, system: int) -> Replay:
    """kvcache with prefix reuse (a today's-semantics cache), as a server with a prompt cache
    drives it, metadata only: a new request attaches the longest prefix of its prompt the cache's
    index holds (``prefix_attach``) and computes the rest; every ubatch carries its token ids (the
    index learns what each cell holds from them); a chunk that leaves its prompt unfinished is
    published at once (``prefix_publish``: later requests attach it while the request goes on,
    as SGLang indexes a running request's chunks); a finished request hands its cells to the
    index (``prefix_release``); placement evicts the index's cells, least recently used first, when it
    needs room. ``system`` does not change the calls (the index finds a shared prompt by itself).
    The rest as :func:`_replay_kvcache`; also checked (as often as the rest): the index agrees
    with the cells."""
    return _replay_kvcache(steps, n_slots, capacity, system, reuse=True)


def replay_kvcache_donor(steps, n_slots: int, capacity: int, system: int) -> Replay:
    """kvcache without a prefix index (the mid-2025 cache): before each step the scheduled
    defrag (defrag_sched(0.1) + update(), as llama_decode runs it), each placement committed, a
    finished request's sequence removed with seq_rm; with a shared system prompt a new request
    takes the prefix of a running request that has computed it (seq_cp). The rest as
    :func:`_replay_kvcache`."""
    return _replay_kvcache(steps, n_slots, capacity, system, reuse=False)


class _NoCache:
    """A cache that does nothing, for :func:`replay_driver`: every placement succeeds, nothing is
    matched, and a ubatch is the tuple of its arguments."""
    used = 0
    prefix_stats = {"cells": 0}

    @staticmethod
    def UBatch(*args, **kwargs):   # noqa: N802 (stands in for kvcache.UBatch)
        return args, kwargs

    def find_slot(self, ub) -> bool:
        return True

    def prefix_attach(self, seq_id, tokens) -> int:
        return 0

    def prefix_release(self, seq_id) -> None:
        pass

    def prefix_publish(self, seq_id) -> int:
        return 0


def replay_driver(steps, n_slots: int, capacity: int, system: int) -> Replay:
    """kvcache's driver alone: :func:`replay_kvcache`'s Python per step (the events read, the
    ubatches' arguments gathered, one call per ubatch, admission and finish) with a cache that does
    nothing (:class:`_NoCache`, no kvcache code run): the share of kvcache's per-step figure
    that is the server's own loop, not the cache's bookkeeping."""
    return _replay_kvcache(steps, n_slots, capacity, system, reuse=True, cache=_NoCache())


def _replay_kvcache(steps, n_slots: int, capacity: int, system: int, reuse: bool, cache=None) -> Replay:
    """kvcache as a llama.cpp-style server drives it, metadata only: a sequence id per running
    request; each prefill chunk one ubatch (one group), the step's decode tokens one ubatch; a
    ubatch that finds no slot is halved and retried (as llama.cpp's server halves its batch). A
    request's prompt is an int32 array, as a server holds it (made before the replay). Checked
    every CHECK_EVERY steps and after the last (untimed, :func:`_timed`): each running request
    holds exactly positions [0, computed); at the end no cell is used. The step's decode ubatch
    takes its positions, sequence ids and tokens as the Python lists the loop gathers them in
    (UBatch reads lists of ints as they are). ``cache``: a stand-in for the cache (not checked;
    :func:`replay_driver`)."""
    import kvcache

    if cache is not None:
        c, ubatch = cache, cache.UBatch
    elif reuse:
        c, ubatch = kvcache.UnifiedCache(capacity, 1, 8, 8, n_seq_max=n_slots, buffers=None, semantics="2026"), kvcache.UBatch
        c.enable_prefix_reuse()
    else:
        c, ubatch = kvcache.UnifiedCache(capacity, 1, 8, 8, n_seq_max=n_slots, buffers=None), kvcache.UBatch
    free_ids = list(range(n_slots - 1, -1, -1))
    live: dict[int, list] = {}          # rid -> [seq id, prompt, computed]
    prompts = {e[1]: np.asarray(e[2], dtype=np.int32) for ev in steps for e in ev if e[0] == "admit"}
    counters = {"split ubatches": 0} if reuse else {"defrags": 0, "split ubatches": 0}
    hits = [0]

    def place(ub_pos, ub_seq, tokens) -> None:
        # one group (an int sequence id) or one sequence id per token (a list: the step's decode
        # tokens go to the UBatch as the lists the loop gathered them in, as a server would pass them)
        grouped = isinstance(ub_seq, int)
        seqs = [ub_seq] if grouped else ub_seq
        n_seq_tokens = len(ub_pos) if grouped else 1
        ub = ubatch(ub_pos, seqs, n_seq_tokens, tokens=tokens) if reuse else ubatch(ub_pos, seqs, n_seq_tokens)
        if c.find_slot(ub):
            if not reuse:
                c.commit()
            return
        if len(ub_pos) == 1:
            raise AssertionError("kvcache: no cell for one token: the cache is full")
        counters["split ubatches"] += 1
        h = len(ub_pos) // 2
        place(ub_pos[:h], ub_seq if grouped else ub_seq[:h], tokens[:h])
        place(ub_pos[h:], ub_seq if grouped else ub_seq[h:], tokens[h:])

    def admit(rid: int) -> None:
        s = free_ids.pop()
        prompt = prompts[rid]
        computed = 0
        if reuse:
            computed = c.prefix_attach(s, prompt)
        elif system:
            k = min(system, len(prompt) - 1)
            for donor in live.values():
                if donor[2] >= k and np.array_equal(donor[1][:k], prompt[:k]):
                    c.seq_cp(donor[0], s, 0, k)
                    computed = k
                    break
        hits[0] += computed
        live[rid] = [s, prompt, computed]

    def step(ev) -> None:
        if not reuse:
            c.defrag_sched(0.1)
            if c.update().moved:
                counters["defrags"] += 1
        dec_pos, dec_seq, dec_tok = [], [], []
        for e in ev:
            kind = e[0]
            if kind == "admit":
                admit(e[1])
            elif kind == "prefill":
                rid, start, n = e[1], e[2], e[3]
                r = live[rid]
                lo, hi = max(start, r[2]), start + n
                if hi > lo:
                    place(np.arange(lo, hi, dtype=np.int32), r[0], r[1][lo:hi])
                    r[2] = hi
                    if reuse and hi < len(r[1]):
                        # an unfinished prompt's computed chunks go to the index at once (as
                        # SGLang's cache_unfinished_req), for requests admitted before it ends
                        c.prefix_publish(r[0])
            elif kind == "decode":
                r = live[e[1]]
                dec_pos.append(e[2])
                dec_seq.append(r[0])
                dec_tok.append(e[3])
                r[2] = e[2] + 1
            else:
                if dec_pos:   # the step's decode batch before its finishes
                    place(dec_pos, dec_seq, dec_tok)
                    dec_pos, dec_seq, dec_tok = [], [], []
                s = live.pop(e[1])[0]
                if reuse:
                    c.prefix_release(s)
                else:
                    c.seq_rm(s, -1, -1)
                free_ids.append(s)
        if dec_pos:
            place(dec_pos, dec_seq, dec_tok)

    def check() -> None:
        for s, _, computed in live.values():
            if computed and (c.seq_pos_min(s), c.seq_pos_max(s)) != (0, computed - 1):
                raise AssertionError(f"kvcache: sequence {s} holds [{c.seq_pos_min(s)}, {c.seq_pos_max(s)}], "
                                     f"not [0, {computed - 1}]")
        if reuse:
            c._prefix_check()

    out = _timed(steps, step, check if cache is None else None)
    if c.used != 0:
        raise AssertionError(f"kvcache: {c.used} cells still used after every request finished")
    out.hits = hits[0]
    if reuse:
        counters["held at the end"] = c.prefix_stats["cells"]
    out.counters = counters
    return out


# --- vLLM ---------------------------------------------------------------------------------------

def _names(*spec: str) -> types.SimpleNamespace:
    """The names "module:name" (or a module alone) imported from an optional package."""
    out = types.SimpleNamespace()
    for item in spec:
        mod, _, name = item.partition(":")
        m = importlib.import_module(mod)
        setattr(out, name or mod.rsplit(".", 1)[-1], getattr(m, name) if name else m)
    return out


def _import_vllm() -> types.SimpleNamespace:
    _torchvision_or_placeholder()
    return _names("torch", "vllm.sampling_params:SamplingParams", "vllm.utils.hashing:get_hash_fn_by_name",
                  "vllm.v1.core.kv_cache_manager:KVCacheManager",
                  "vllm.v1.core.kv_cache_utils:get_request_block_hasher", "vllm.v1.core.kv_cache_utils:init_none_hash",
                  "vllm.v1.kv_cache_interface:FullAttentionSpec", "vllm.v1.kv_cache_interface:KVCacheConfig",
                  "vllm.v1.kv_cache_interface:KVCacheGroupSpec", "vllm.v1.request:Request",
                  "vllm.v1.request:RequestStatus")


def replay_vllm(steps, n_slots: int, capacity: int, system: int, v, checked: bool = True) -> Replay:
    """vLLM v1's KVCacheManager as its Scheduler calls it (prefix caching on, sha256 block
    hashes: vLLM's defaults; blocks of 16 tokens): get_computed_blocks + allocate_slots when a
    request is admitted, allocate_slots for every chunk and decode token (the caller advances
    num_computed_tokens and appends the sampled token), free when it finishes, new_step_starts
    each step. Checked: no allocation fails, and every block is free at the end (not with
    ``checked`` false: :func:`replay_peer_driver`'s stand-ins hold no blocks)."""
    bs = 16
    spec = v.FullAttentionSpec(block_size=bs, num_kv_heads=8, head_size=128, dtype=v.torch.float16)
    n_blocks = capacity // bs + 1       # block 0 is the pool's null block
    cfg = v.KVCacheConfig(num_blocks=n_blocks, kv_cache_tensors=[],
                          kv_cache_groups=[v.KVCacheGroupSpec(["model.layers.0.self_attn"], spec)])
    mgr = v.KVCacheManager(cfg, max_model_len=4096, scheduler_block_size=bs, hash_block_size=bs, enable_caching=True)
    hash_fn = v.get_hash_fn_by_name("sha256")
    v.init_none_hash(hash_fn)
    hasher = v.get_request_block_hasher(bs, hash_fn)
    reqs: dict = {}
    hits = [0]

    def step(ev) -> None:
        mgr.new_step_starts()
        for e in ev:
            kind = e[0]
            if kind == "admit":
                _, rid, prompt, out_len = e
                reqs[rid] = v.Request(str(rid), list(prompt), v.SamplingParams(max_tokens=out_len), None,
                                      block_hasher=hasher)
            elif kind == "prefill":
                _, rid, start, n, sampled = e
                r = reqs[rid]
                # a hit may cover this chunk and more (a chat turn's history): only what lies past
                # it is computed, at the latest in the prompt's last chunk
                new = max(0, start + n - max(r.num_computed_tokens, start))
                got = True
                if r.status == v.RequestStatus.WAITING:
                    blocks, n_hit, _ = mgr.get_computed_blocks(r)
                    new = max(0, start + n - n_hit)
                    got = mgr.allocate_slots(r, new, n_hit, blocks if n_hit else None)
                    hits[0] += n_hit
                    r.num_computed_tokens = n_hit
                    r.status = v.RequestStatus.RUNNING
                elif new:
                    got = mgr.allocate_slots(r, new)
                if got is None:
                    raise AssertionError(f"vLLM: no blocks for request {rid}")
                r.num_computed_tokens += new
                if sampled is not None:
                    r.append_output_token_ids(sampled)
            elif kind == "decode":
                rid, sampled = e[1], e[4]
                r = reqs[rid]
                if mgr.allocate_slots(r, 1) is None:
                    raise AssertionError(f"vLLM: no block for request {rid}")
                r.num_computed_tokens += 1
                r.append_output_token_ids(sampled)
            else:
                r = reqs.pop(e[1])
                r.status = v.RequestStatus.FINISHED_LENGTH_CAPPED
                mgr.free(r)

    out = _timed(steps, step)
    free = mgr.block_pool.get_num_free_blocks() if checked else n_blocks - 1
    if free != n_blocks - 1:
        raise AssertionError(f"vLLM: {n_blocks - 1 - free} blocks still held after every request finished")
    out.hits = hits[0]
    return out


# --- SGLang -------------------------------------------------------------------------------------

class _NoTorchvision(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """An import-time stand-in for torchvision, for the peers' imports only: PyPI's torchvision
    wheels need CUDA libraries that a CPU build of torch does not have, and vLLM's and SGLang's
    KV bookkeeping modules import it only through their multimodal configuration modules (and
    transformers' image utilities). Nothing of it is called by the KV bookkeeping replayed here;
    any use of it would fail loudly (its names are placeholders that raise when called)."""

    class _Placeholder:
        def __init__(self, *a, **k):
            pass

        def __getattr__(self, name):
            return _NoTorchvision._Placeholder()

        def __mro_entries__(self, bases):
            return (object,)

    class _Module(types.ModuleType):
        def __getattr__(self, name):
            if name.startswith("__"):
                raise AttributeError(name)
            return _NoTorchvision._Placeholder()

    def find_spec(self, name, path, target=None):
        if name == "torchvision" or name.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        m = self._Module(spec.name)
        m.__path__ = []
        return m

    def exec_module(self, module):
        pass


def _torchvision_or_placeholder() -> None:
    """torchvision where it loads; else the placeholder (_NoTorchvision) for the imports that
    follow."""
    try:
        importlib.import_module("torchvision")
    except Exception:   # not installed, or a wheel that cannot load beside this torch
        for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
            del sys.modules[name]
        if not any(isinstance(f, _NoTorchvision) for f in sys.meta_path):
            sys.meta_path.insert(0, _NoTorchvision())


def _import_sglang() -> types.SimpleNamespace:
    _torchvision_or_placeholder()
    g = _names("torch", "array:array", "sglang.srt.mem_cache.allocator:TokenToKVPoolAllocator",
               "sglang.srt.mem_cache.base_prefix_cache:EvictParams", "sglang.srt.mem_cache.base_prefix_cache:InsertParams",
               "sglang.srt.mem_cache.base_prefix_cache:MatchPrefixParams",
               "sglang.srt.mem_cache.cache_init_params:CacheInitParams",
               "sglang.srt.mem_cache.memory_pool:ReqToTokenPool", "sglang.srt.mem_cache.radix_cache:RadixCache",
               "sglang.srt.mem_cache.radix_cache:RadixKey")
    g.torch.set_num_threads(1)   # the scheduler's thread does the bookkeeping; thread CPU time measures it
    return g


def replay_sglang(steps, n_slots: int, capacity: int, system: int, g, checked: bool = True) -> Replay:
    """SGLang's RadixCache + ReqToTokenPool + TokenToKVPoolAllocator (page size 1, CPU tensors,
    no KV memory), the calls its scheduler's helpers make: match_prefix and a lock at admission,
    alloc (after evicting from the tree when short) and the row write per chunk, one batched row
    write of the step's decode slots, an unfinished chunk inserted into the tree and the lock moved
    (chunked prefill), the finished request inserted, its duplicate slots freed, unlocked, its row
    freed. Checked: no allocation fails, and every CHECK_EVERY steps and at the end (untimed, as
    kvcache's checks) every slot is free, in the tree or held by a running request alone (not
    with ``checked`` false: :func:`replay_peer_driver`'s stand-ins hold no slots)."""
    torch, array = g.torch, g.array
    r2t = g.ReqToTokenPool(size=n_slots, max_context_len=4096, device="cpu", enable_memory_saver=False)
    alloc = g.TokenToKVPoolAllocator(size=capacity, dtype=torch.float16, device="cpu", kvcache=None, need_sort=False)
    tree = g.RadixCache(g.CacheInitParams(disable=False, req_to_token_pool=r2t, token_to_kv_pool_allocator=alloc,
                                          page_size=1))
    reqs: dict = {}
    hits = [0]
    evicted = [0]

    def take(n):
        if alloc.available_size() < n:
            evicted[0] += tree.evict(g.EvictParams(num_tokens=n - alloc.available_size())).num_tokens_evicted
        loc = alloc.alloc(n)
        if loc is None:
            raise AssertionError(f"SGLang: no slots for {n} tokens")
        return loc

    def key(tokens):
        return g.RadixKey(array("q", tokens))

    def write_decodes(rows, pos):
        loc = take(len(rows))
        r2t.req_to_token[torch.tensor(rows), torch.tensor(pos)] = loc.to(torch.int32)

    def step(ev) -> None:
        rows, pos = [], []
        for e in ev:
            kind = e[0]
            if kind == "admit":
                _, rid, prompt, _out = e
                r = types.SimpleNamespace(tokens=list(prompt), n_prompt=len(prompt), row=r2t.alloc_rows(1)[0])
                m = tree.match_prefix(g.MatchPrefixParams(key=key(prompt)))
                r.node = m.last_device_node
                tree.inc_lock_ref(r.node)
                r.protected = min(m.device_prefix_len, len(prompt) - 1)   # a token is left to compute
                if r.protected:
                    r2t.write((r.row, slice(0, r.protected)),
                              tree.path_device_indices(r.node)[:r.protected].to(torch.int32))
                hits[0] += r.protected
                r.seq_len = r.protected
                reqs[rid] = r
            elif kind == "prefill":
                rid, start, n = e[1], e[2], e[3]
                r = reqs[rid]
                lo, hi = max(start, r.seq_len), start + n
                if hi <= lo:
                    continue    # the matched prefix covers this chunk
                r2t.write((r.row, slice(lo, hi)), take(hi - lo).to(torch.int32))
                r.seq_len = hi
                if hi < r.n_prompt:
                    # an unfinished chunk: into the tree, duplicates freed, the row and the lock moved
                    kv = r2t.req_to_token[r.row, :hi].to(torch.int64)
                    ins = tree.insert(g.InsertParams(key=key(r.tokens[:hi]), value=kv))
                    if ins.prefix_len > r.protected:
                        alloc.free(kv[r.protected:ins.prefix_len])
                    m = tree.match_prefix(g.MatchPrefixParams(key=key(r.tokens[:hi])))
                    new = tree.path_device_indices(m.last_device_node)
                    r2t.write((r.row, slice(r.protected, len(new))), new[r.protected:].to(torch.int32))
                    tree.dec_lock_ref(r.node)
                    r.node = m.last_device_node
                    tree.inc_lock_ref(r.node)
                    r.protected = len(new)
            elif kind == "decode":
                rid, p, tok = e[1], e[2], e[3]
                r = reqs[rid]
                r.tokens.append(tok)
                rows.append(r.row)
                pos.append(p)
                r.seq_len = p + 1
            else:
                if rows:    # the step's decode batch before its finishes
                    write_decodes(rows, pos)
                    rows, pos = [], []
                r = reqs.pop(e[1])
                kv = r2t.req_to_token[r.row, :r.seq_len].to(torch.int64)
                ins = tree.insert(g.InsertParams(key=key(r.tokens[:r.seq_len]), value=kv))
                if ins.prefix_len > r.protected:
                    alloc.free(kv[r.protected:ins.prefix_len])
                tree.dec_lock_ref(r.node)
                r2t.free_rows([r.row])
        if rows:
            write_decodes(rows, pos)

    def check() -> None:
        # a running request's slots past its protected prefix are its own, the rest the tree's
        own = sum(r.seq_len - r.protected for r in reqs.values())
        if alloc.available_size() + tree.total_size() + own != capacity:
            raise AssertionError(f"SGLang: {capacity - alloc.available_size() - tree.total_size() - own} slots lost")

    out = _timed(steps, step, check if checked else None)
    out.hits = hits[0]
    out.counters = {"evicted": evicted[0]}
    return out


# --- the peers' drivers alone ---------------------------------------------------------------------

class _Inert:
    """A tensor, pool or tree node of a peer's driver-alone replay: indexing, conversion and
    assignment do nothing and answer it again; no length."""

    def to(self, *args) -> "_Inert":
        return self

    def __getitem__(self, key) -> "_Inert":
        return self

    def __setitem__(self, key, value) -> None:
        pass

    def __len__(self) -> int:
        return 0


_INERT = _Inert()
# what a stand-in's lookup, insert or eviction finds: nothing cached, nothing evicted
_NOTHING = types.SimpleNamespace(last_device_node=_INERT, device_prefix_len=0, prefix_len=0, num_tokens_evicted=0)


def _inert(*args, **kwargs) -> _Inert:
    return _INERT


def _sglang_standins() -> types.SimpleNamespace:
    """What :func:`replay_sglang` takes from SGLang and torch, doing nothing: room for every
    allocation, no prefix found."""

    class Pool:
        req_to_token = _INERT

        def __init__(self, **kwargs):
            pass

        def alloc_rows(self, n):
            return [0] * n

        def write(self, *args):
            pass

        def free_rows(self, rows):
            pass

    class Allocator:
        def __init__(self, **kwargs):
            pass

        def available_size(self):
            return 1 << 62

        def alloc(self, n):
            return _INERT

        def free(self, slots):
            pass

    class Tree:
        def __init__(self, params):
            pass

        def match_prefix(self, params):
            return _NOTHING

        def insert(self, params):
            return _NOTHING

        def evict(self, params):
            return _NOTHING

        def inc_lock_ref(self, node):
            pass

        def dec_lock_ref(self, node):
            pass

        def path_device_indices(self, node):
            return _INERT

    return types.SimpleNamespace(
        torch=types.SimpleNamespace(tensor=_inert, float16=None, int32=None, int64=None), array=_inert,
        TokenToKVPoolAllocator=Allocator, ReqToTokenPool=Pool, RadixCache=Tree, RadixKey=_inert,
        EvictParams=_inert, InsertParams=_inert, MatchPrefixParams=_inert, CacheInitParams=_inert)


def _vllm_standins() -> types.SimpleNamespace:
    """What :func:`replay_vllm` takes from vLLM and torch, doing nothing: every allocation
    succeeds, no block is found cached."""
    status = types.SimpleNamespace(WAITING="waiting", RUNNING="running", FINISHED_LENGTH_CAPPED="finished")

    class Request:
        def __init__(self, request_id, prompt_token_ids, sampling_params, pooling_params, block_hasher=None):
            self.num_computed_tokens = 0
            self.status = status.WAITING

        def append_output_token_ids(self, token):
            pass

    class Manager:
        def __init__(self, *args, **kwargs):
            pass

        def new_step_starts(self):
            pass

        def get_computed_blocks(self, request):
            return (), 0, None

        def allocate_slots(self, request, n, *args):
            return True

        def free(self, request):
            pass

    return types.SimpleNamespace(
        torch=types.SimpleNamespace(float16=None), FullAttentionSpec=_inert, KVCacheConfig=_inert,
        KVCacheGroupSpec=_inert, KVCacheManager=Manager, get_hash_fn_by_name=_inert, init_none_hash=_inert,
        get_request_block_hasher=_inert, Request=Request, SamplingParams=_inert, RequestStatus=status)


_PEER_STANDINS = {"vLLM": _vllm_standins, "SGLang": _sglang_standins}


def replay_peer_driver(peer: str, steps, n_slots: int, capacity: int, system: int) -> Replay:
    """A peer's driver alone, as :func:`replay_driver` is kvcache's: the peer's replay (the
    events read, the calls' arguments gathered, admission and finish) with stand-ins for every
    object it takes from the peer and from torch (no peer code run, nothing cached: every chunk
    is computed), unchecked. The peer's figure less this one is its bookkeeping alone."""
    fn = {"vLLM": replay_vllm, "SGLang": replay_sglang}[peer]
    return fn(steps, n_slots, capacity, system, _PEER_STANDINS[peer](), checked=False)


# --- the case -------------------------------------------------------------------------------------

def _peers() -> tuple[dict, dict]:
    """({name: (replay, imported modules)}, {name: why it is not there})."""
    found, missing = {}, {}
    for name, imp, fn in (("vLLM", _import_vllm, replay_vllm), ("SGLang", _import_sglang, replay_sglang)):
        try:
            found[name] = (fn, imp())
        except Exception as e:   # not installed, or an installation that does not import
            missing[name] = f"{type(e).__name__}: {e}".splitlines()[0][:160]
    return found, missing


_WORKLOAD_NAMES = {"none": "no shared prefix", "system": f"{SYSTEM_PROMPT}-token shared system prompt",
                   "chat": f"multi-turn chat ({TURNS} turns)"}


def bench_serving(quick: bool, reps: int) -> list[Row]:
    """The serving workloads through kvcache and the peers, in one run, each replay repeated and
    the best kept (the fewest CPU nanoseconds in all: the run least disturbed by the machine), the
    peers' replays interleaved with kvcache's; beside kvcache with prefix reuse, the scheme
    without an index (seq_cp from a running request, where the workload has a shared prompt), and
    each side's driver alone (:func:`replay_driver`, :func:`replay_peer_driver`: a side's figure
    less its driver is its bookkeeping alone); then the prefix index's own costs
    (:func:`bench_prefix_index`)."""
    from kvcache_bench.case_step import capabilities

    caps = capabilities()
    configs = [(8, w) for w in WORKLOADS] if quick else [(n, w) for n in (32, 64, 256) for w in WORKLOADS]
    n_reps = 1 if quick else min(reps, 3)
    peers, missing = _peers()
    rows: list[Row] = []
    for n_slots, workload in configs:
        capacity = TOKENS_PER_SLOT * n_slots
        system = SYSTEM_PROMPT if workload == "system" else 0
        name = f"serving: {n_slots} requests, {capacity} tokens, {_WORKLOAD_NAMES[workload]}"
        # quick: fewer requests, but enough for the conversations' later turns
        n_requests = 8 * n_slots if not quick or workload == "chat" else 2 * n_slots
        steps = schedule(n_slots, n_requests, seed=0, system=system, chat=workload == "chat")
        best: dict[str, Replay] = {}
        for _ in range(n_reps):
            runs: dict[str, Replay] = {}
            runs["kvcache"] = replay_kvcache(steps, n_slots, capacity, system)
            runs["driver"] = replay_driver(steps, n_slots, capacity, system)
            if workload != "chat" and n_slots <= caps.max_seqs:
                # the donor scheme finds no earlier turn of a conversation: chat has no such row
                runs["kvcache seq_cp"] = replay_kvcache_donor(steps, n_slots, capacity, system)
            for peer, (fn, mods) in peers.items():
                runs[peer] = fn(steps, n_slots, capacity, system, mods)
                runs[f"{peer} driver"] = replay_peer_driver(peer, steps, n_slots, capacity, system)
            for k, r in runs.items():
                if k not in best or r.cpu_sum < best[k].cpu_sum:
                    best[k] = r
        donor = best.pop("kvcache seq_cp", None)
        driver = best.pop("driver")
        peer_drivers = {p: best.pop(f"{p} driver").cpu_mean for p in peers}
        per = {k: r.cpu_mean for k, r in best.items()}
        extra = {"steps": len(steps), "workload": workload, "per_step_ns": per,
                 "wall_median_ns": {k: r.wall_median for k, r in best.items()},
                 "prefix_hit_tokens": {k: r.hits for k, r in best.items()},
                 "prompt_tokens": sum(len(e[2]) for ev in steps for e in ev if e[0] == "admit"),
                 "counters": {k: r.counters for k, r in best.items() if r.counters},
                 "without_index": {"per_step_ns": donor.cpu_mean, "prefix_hit_tokens": donor.hits} if donor else None,
                 "driver_per_step_ns": driver.cpu_mean, "peer_driver_per_step_ns": peer_drivers,
                 "peers_missing": missing, "serving": True}
        k_cpu = [best["kvcache"].cpu[i] for i in counted(len(steps))]
        peers_note = ", ".join(f"{p} {per[p] / 1e3:.1f} us" for p in ("vLLM", "SGLang") if p in per)
        note = (f"per step (CPU): {peers_note}" if peers_note else "") + "".join(
            f"; {p} skipped ({why})" for p, why in missing.items())
        rows.append(Row(name, per["kvcache"], (min(k_cpu), max(k_cpu)), note=note.lstrip("; "), extra=extra))
    return rows + bench_prefix_index(quick, reps)


def _held_index(n_prompts: int, length: int, seed: int = 0):
    """A metadata-only today's cache whose prefix index holds n_prompts random prompts of length
    tokens (each placed as one sequence, then released), with room for two more; and the prompts."""
    import kvcache

    c = kvcache.UnifiedCache((n_prompts + 2) * length, 1, 8, 8, n_seq_max=2, buffers=None, semantics="2026")
    c.enable_prefix_reuse()
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, VOCAB, length, dtype=np.int32) for _ in range(n_prompts)]
    pos = np.arange(length, dtype=np.int32)
    for p in prompts:
        if not c.find_slot(kvcache.UBatch(pos, [0], n_seq_tokens=length, tokens=p)):
            raise AssertionError("kvcache: no room for a prompt in a cache sized for all of them")
        c.prefix_release(0)
    return c, prompts


def bench_prefix_index(quick: bool, reps: int) -> list[Row]:
    """The prefix index's costs from Python: prefix_match + prefix_attach of a held 4096-token
    prompt in an index of 64K tokens and of 1M (256K when quick), paired per repetition (what a
    match costs should follow the tokens matched, not the index's size: the ratio ~1); and
    prefix_evict of N cells, 4096 and 65536 (16384 when quick), per cell evicted, paired (the cost
    should follow N)."""
    length = 4096
    small_n, big_n = 16, (64 if quick else 256)
    n_reps = max(3, reps)
    held = {n: _held_index(n, length) for n in (small_n, big_n)}
    times: dict[int, list[float]] = {n: [] for n in held}
    for i in range(n_reps):
        for n, (c, prompts) in held.items():
            q = prompts[(i * 37) % n]
            t = time.perf_counter_ns()
            k = c.prefix_match(q)
            got = c.prefix_attach(1, q)
            times[n].append(time.perf_counter_ns() - t)
            if k != got or got != length - 1:
                raise AssertionError(f"kvcache: matched {k}, attached {got} of a held {length}-token prompt")
            c.seq_rm(1, -1, -1)
            c._prefix_check()
    rows = []
    m, r = statistics.median(times[big_n]), (min(times[big_n]), max(times[big_n]))
    ratio = statistics.median(b / a for a, b in zip(times[small_n], times[big_n]))
    def size(n_prompts: int) -> str:
        tokens = n_prompts * length
        return f"{tokens >> 20}M" if tokens >= 1 << 20 else f"{tokens >> 10}K"

    rows.append(Row(f"prefix reuse: match + attach of a {length}-token prompt, index of {size(big_n)} tokens", m, r,
                    note=f"index of {size(small_n)} tokens: {statistics.median(times[small_n]) / 1e3:.1f} us; "
                         f"{size(big_n)} / {size(small_n)}: {ratio:.2f}x (paired)",
                    extra={"index_tokens": {str(n): n * length for n in held},
                           "ns": {str(n): statistics.median(v) for n, v in times.items()}, "size_ratio": ratio}))
    c, _ = held[big_n]
    del held
    few, many = 4096, (16384 if quick else 65536)
    per_cell: dict[int, list[float]] = {few: [], many: []}
    for _ in range(n_reps):
        for n in (few, many):
            t = time.perf_counter_ns()
            went = c.prefix_evict(n)
            t = time.perf_counter_ns() - t
            if went < n:
                raise AssertionError(f"kvcache: evicted {went} of {n} cells from an index holding more")
            per_cell[n].append(t / went)
    c._prefix_check()
    ratio = statistics.median(b / a for a, b in zip(per_cell[few], per_cell[many]))
    m, r = statistics.median(per_cell[many]), (min(per_cell[many]), max(per_cell[many]))
    rows.append(Row(f"prefix reuse: evict {many} cells (per cell), index of {size(big_n)} tokens", m, r,
                    note=f"{few} cells: {statistics.median(per_cell[few]):.1f} ns per cell; per cell {many} / {few}: "
                         f"{ratio:.2f}x (paired)",
                    extra={"ns_per_cell": {str(n): statistics.median(v) for n, v in per_cell.items()},
                           "count_ratio": ratio}))
    return rows


def format_serving(report: dict) -> str:
    """The serving rows of a report as their own table: per-step cost of each implementation, the
    same less each side's driver (its bookkeeping alone), the prompt tokens each found cached (and
    kvcache without its prefix index beside)."""
    rows = [r for r in report["rows"] if r.get("extra", {}).get("serving")]
    if not rows:
        return ""
    out = ["| workload | steps | kvcache us/step | of it, the driver alone | vLLM us/step | SGLang us/step | "
           "SGLang/kvcache | vLLM/kvcache | drivers alone (vLLM / SGLang) us/step | "
           "bookkeeping alone: SGLang/kvcache, vLLM/kvcache | prompt tokens | "
           "prefix-hit tokens (kvcache / vLLM / SGLang) | kvcache without index: us/step, hits |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        x = r["extra"]
        per, hits = x["per_step_ns"], x["prefix_hit_tokens"]
        drivers = dict(x.get("peer_driver_per_step_ns") or {})
        if "driver_per_step_ns" in x:
            drivers["kvcache"] = x["driver_per_step_ns"]

        def us(k):
            return f"{per[k] / 1e3:.1f}" if k in per else "-"

        def ratio(k):
            return f"{per[k] / per['kvcache']:.2f}x" if k in per and "kvcache" in per else "-"

        def own_ratio(k):
            if k not in per or "kvcache" not in per or k not in drivers or "kvcache" not in drivers:
                return "-"
            return f"{(per[k] - drivers[k]) / (per['kvcache'] - drivers['kvcache']):.2f}x"
        donor = x.get("without_index")
        out.append(f"| {r['case'].removeprefix('serving: ')} | {x['steps']} | "
                   f"{us('kvcache') if 'kvcache' in per else r['note']} | "
                   + (f"{x['driver_per_step_ns'] / 1e3:.1f}" if "driver_per_step_ns" in x else "-")
                   + f" | {us('vLLM')} | {us('SGLang')} | {ratio('SGLang')} | {ratio('vLLM')} | "
                   + " / ".join(f"{drivers[k] / 1e3:.1f}" if k in drivers else "-" for k in ("vLLM", "SGLang"))
                   + f" | {own_ratio('SGLang')}, {own_ratio('vLLM')} | {x.get('prompt_tokens', '-')} | "
                   + " / ".join(str(hits.get(k, "-")) for k in ("kvcache", "vLLM", "SGLang")) + " | "
                   + (f"{donor['per_step_ns'] / 1e3:.1f}, {donor['prefix_hit_tokens']}" if donor else "-") + " |")
    missing = rows[0]["extra"].get("peers_missing") or {}
    if missing:
        out.append("")
        out += [f"{p} not run: {why}" for p, why in missing.items()]
    return "\n".join(out)
