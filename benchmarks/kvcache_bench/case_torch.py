"""`kvcache bench` case ``torch``: ``generate`` of a tiny random Llama with the kvcache
transformers Cache against the same with ``DynamicCache``, paired in one run (the tokens are
checked equal; the paired ratio with its 95% bootstrap interval), after a short
prompt (where every cache's fixed costs weigh most) and a long one (where the copies
DynamicCache's concatenation makes grow), and the per-step cost of kvcache's calls in a decode
step whose K/V live in torch tensors (find_slot, slot_indices into an int64 tensor, the scatter
of one layer's rows, the unpadded bool mask, commit) at 4096 and 32768 cells, as a share of the
tiny model's decode step measured in the same run. torch runs on one thread here and the times
are that thread's CPU time, so that other processes on a shared machine weigh less (torch's idle
pool threads spin, and a wall clock counts every other job). Without torch and transformers the
rows wait."""
from __future__ import annotations

import random
import statistics
import time
import warnings
from typing import Any

from kvcache_bench._rows import Row, _median_range, _paired, _paired_interval, waiting

N_PROMPT, N_NEW = 20, 32
N_PROMPT_LONG = 2000
# generate's repetitions (at least): the caches differ by a few tenths of a percent at the short
# prompt, which the machine's noise hides in fewer pairs
GENERATE_REPS = 100


def _model() -> Any:
    import torch  # type: ignore[import-not-found,unused-ignore]
    import transformers  # type: ignore[import-not-found,import-untyped,unused-ignore]

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                                   initializer_range=0.2)
    return transformers.LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa").eval()


def _generate_ns(model: Any, ids: Any, cache: Any) -> tuple[int, Any]:
    import torch  # type: ignore[import-not-found,unused-ignore]

    t0 = time.thread_time_ns()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        out = model.generate(ids, max_new_tokens=N_NEW, min_new_tokens=N_NEW, do_sample=False, pad_token_id=0,
                             past_key_values=cache)
    # the kvcache Cache: its kvcache cache, consulted, places what update left unplaced (timed too)
    kv = getattr(cache, "kv", None)
    if kv is not None and kv.seq_pos_max(0) != ids.shape[1] + N_NEW - 2:
        raise RuntimeError("bench torch: the kvcache cache does not hold every index the generate stored")
    return time.thread_time_ns() - t0, out


def _views_only_update(self: Any, key_states: Any, value_states: Any, layer_idx: int, *args: Any,
                       **kwargs: Any) -> Any:
    """update of the views-only Cache (see _floor_cache)."""
    import torch  # type: ignore[import-not-found,unused-ignore]

    if layer_idx == 0:
        rows, heads, q, dim = key_states.shape
        if self._n == 0:
            # [2 * layers, rows, heads, index, dim], and the same with the index first
            full = torch.zeros(2 * len(self._types), rows, heads, self._n_ctx, dim, dtype=key_states.dtype)
            self.floor = (full, full.unsqueeze(4).permute(3, 0, 1, 2, 4, 5))
        full, by_index = self.floor
        n = self._n
        self._n = n + q
        self.views = full.narrow(3, 0, n + q).unbind(0)
        self.dst = (by_index[n] if q == 1 else full.narrow(3, n, q)).unbind(0)
    at = 2 * layer_idx
    self.dst[at].copy_(key_states)
    self.dst[at + 1].copy_(value_states)
    return self.views[at], self.views[at + 1]


def _floor_cache(model: Any, n_ctx: int) -> Any:
    """A transformers Cache that does only what any cache returning views of its own memory
    must: one torch tensor for every layer's K/V (made on the first update), each forward's new
    rows copied in, the keys returned as views. No cells, no placement, no checks: the floor of
    the kvcache Cache's views (which it returns once rows are long; short ones it concatenates,
    as DynamicCache does). Its answers to transformers' other questions are the kvcache Cache's
    own, so only update differs."""
    from kvcache.integrations.transformers import KVCache

    views_only = type("ViewsOnly", (KVCache,), {"update": _views_only_update})
    return views_only(model.config, n_ctx)


def _calls_ns(size: int, steps: int) -> float:
    """ns per decode step of kvcache's calls for one sequence of size - 64 cells (metadata only,
    K/V as torch tensors of 2 layers), each step placed, scattered, masked, committed and
    then removed again so that every step sees the same cache."""
    import numpy as np
    import torch  # type: ignore[import-not-found,unused-ignore]

    import kvcache

    width = 64
    c = kvcache.UnifiedCache(kv_size=size, n_layer=2, n_embd_k_gqa=width, n_embd_v_gqa=width, v_trans=False,
                             buffers=None)
    n = size - 64
    for a in range(0, n, 4096):
        b = min(a + 4096, n)
        assert c.find_slot(kvcache.UBatch(np.arange(a, b, dtype=np.int32), np.zeros(b - a, np.int32)))
        c.commit()
    k = [torch.zeros(size, width) for _ in range(2)]
    v = [torch.zeros(size, width) for _ in range(2)]
    rows = torch.ones(1, width)
    idx = torch.empty(1, dtype=torch.long)
    mask = torch.empty(1, size, dtype=torch.bool)
    ub = kvcache.UBatch([n], [0])
    t0 = time.thread_time_ns()
    for _ in range(steps):
        assert c.find_slot(ub)
        at = c.slot_indices(out=idx)
        for il in range(2):
            k[il].index_copy_(0, at, rows)
            v[il].index_copy_(0, at, rows)
        m = c.kq_mask(ub, pad=False, dtype="bool", out=mask)
        c.commit()
        c.seq_rm(0, n, -1)
    dt = (time.thread_time_ns() - t0) / steps
    assert bool(m[0, 0]) and int(m.sum()) == n + 1       # the step saw the whole sequence and itself
    return dt


def bench_torch(quick: bool, reps: int) -> list[Row]:
    try:
        import torch  # type: ignore[import-not-found,unused-ignore]
        import transformers  # type: ignore[import-not-found,import-untyped,unused-ignore]
        from transformers import DynamicCache  # type: ignore[import-not-found,import-untyped,unused-ignore]

        from kvcache.integrations.transformers import from_model
    except ImportError:
        return [waiting("torch: generate with the kvcache Cache vs DynamicCache", "torch and transformers"),
                waiting("torch: kvcache's calls per decode step", "torch and transformers")]
    if int(transformers.__version__.split(".")[0]) < 5:
        return [waiting("torch: generate with the kvcache Cache vs DynamicCache", "transformers 5.x")]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _rows(torch, DynamicCache, from_model, quick, reps)
    finally:
        torch.set_num_threads(threads)


def _rows(torch: Any, DynamicCache: Any, from_model: Any, quick: bool, reps: int) -> list[Row]:
    model = _model()
    rows: list[Row] = []
    step = 0.0
    for n_prompt in (N_PROMPT, N_PROMPT_LONG):
        generated, per_step = _generate_rows(torch, DynamicCache, from_model, model, n_prompt,
                                             reps if quick else max(reps, GENERATE_REPS))
        rows += generated
        if n_prompt == N_PROMPT:
            step = per_step
    for size in (4096, 32768):
        steps = 200 if quick else 1000
        per = [_calls_ns(size, steps) for _ in range(reps)]
        m, r = _median_range(per)
        rows.append(Row(f"torch: kvcache's calls per decode step (find_slot, slot_indices, scatter 2 layers, bool "
                        f"mask, commit), {size} cells", m, r,
                        note=f"{m / step:.1%} of this run's decode step of the model"))
    return rows


def _generate_rows(torch: Any, DynamicCache: Any, from_model: Any, model: Any, n_prompt: int, reps: int
                   ) -> tuple[list[Row], float]:
    """The two generate rows after an n_prompt-token prompt, and DynamicCache's time per new token.
    The paired ratio comes with its 95% bootstrap interval: whether the run can tell the caches
    apart."""
    ids = torch.randint(1, 256, (1, n_prompt), generator=torch.Generator().manual_seed(3))
    _generate_ns(model, ids, DynamicCache(config=model.config))       # warm up
    caches = {"ours": lambda: from_model(model, n_ctx=n_prompt + N_NEW),
              "theirs": lambda: DynamicCache(config=model.config),
              "floor": lambda: _floor_cache(model, n_prompt + N_NEW)}
    times: dict[str, list[float]] = {name: [] for name in caches}
    order = list(caches)
    shuffle = random.Random(n_prompt).shuffle     # each repetition in another order: no place is favoured
    for _ in range(reps):
        shuffle(order)
        out = {}
        for name in order:
            t, out[name] = _generate_ns(model, ids, caches[name]())
            times[name].append(t / N_NEW)
        if not torch.equal(out["ours"], out["theirs"]) or not torch.equal(out["floor"], out["theirs"]):   # type: ignore[arg-type,unused-ignore]
            raise RuntimeError("bench torch: generate with the kvcache Cache (or the views-only floor) gave other "
                               "tokens than DynamicCache")
    ours, theirs, floor = times["ours"], times["theirs"], times["floor"]
    step = statistics.median(theirs)
    ratio = _paired(theirs, ours)
    lo, hi = _paired_interval(theirs, ours)
    ratio_floor = _paired(theirs, floor)
    med, rng = _median_range(ours)
    fmed, frng = _median_range(floor)
    return [Row(f"torch: generate, tiny Llama (2 layers, sdpa), {n_prompt} + {N_NEW} tokens, per new token",
                med, rng, step, ratio, yardstick="DynamicCache",
                note=f"DynamicCache/kvcache {ratio:.3f}x, 95% interval {lo:.3f}-{hi:.3f} over {reps} pairs; a cache "
                     f"that only returns views of its memory: {ratio_floor:.3f}x"),
            Row(f"torch: the same ({n_prompt} + {N_NEW} tokens) with a views-only Cache (K/V copied into one tensor, "
                f"views returned, no cells: the floor of a cache that returns views of its tensor)", fmed, frng, step,
                ratio_floor, yardstick="DynamicCache", note="bounds the row above")], step
