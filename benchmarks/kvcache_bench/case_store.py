"""`kvcache bench` case `store`: a prefix of 4096 tokens (32 layers x 1024 f16, V not transposed;
--quick: 512 tokens, 4 layers) restored from kvcache's prefix store into a fresh sequence of a
cache: from the host tier against a memcpy of its bytes, and from the disk tier with the page
cache warm against a read of its bytes (the same files read into one buffer). Both floors are
measured in the same repetition as the restore. Every restore is checked: the sequence's state
equals the one saved.

`kvcache bench` case `store_llama`: llama-cpp-python's time to first token with kvcache's prompt
cache, with its own LlamaRAMCache and with no cache (a 2000-token shared prefix, 100 suffixes;
--quick: 500 and 10), and the memory each cache holds; it waits without llama-cpp-python."""
from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from typing import Any

import numpy as np

from kvcache_bench._rows import Row, _median_range, _paired
from kvcache_bench.case_handoff import WIDTH, _cache

CHUNK = 256


def _sizes(quick: bool) -> tuple[int, int]:
    return (512, 4) if quick else (4096, 32)


def _read_all(paths: list[str], out: np.ndarray) -> None:
    mv = memoryview(out)
    off = 0
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while True:
                n = f.readinto(mv[off:])
                if not n:
                    break
                off += n


def bench_store(quick: bool, reps: int) -> list[Row]:
    from kvcache.store import PrefixStore

    tokens, n_layer = _sizes(quick)
    label = f"{tokens} tokens, {n_layer} layers x {WIDTH} f16, chunks of {CHUNK}"
    src, dst = _cache(tokens, n_layer, False, True), _cache(tokens, n_layer, False, False)
    toks = list(range(1, tokens + 1))
    want = src.state_write(0)
    rows = []
    tmp = tempfile.mkdtemp(prefix="kvcache-bench-store-")
    try:
        host = PrefixStore(src, chunk_tokens=CHUNK, host_bytes=1 << 40)
        host.save(src, 0, toks)
        disk = PrefixStore(src, os.path.join(tmp, "st"), chunk_tokens=CHUNK, host_bytes=0, disk_bytes=1 << 40)
        disk.save(src, 0, toks)
        nbytes = host.geometry.chunk_bytes * (tokens // CHUNK)
        paths = [disk._file(k) for k in disk.keys(toks)]
        file_bytes = sum(os.path.getsize(p) for p in paths)
        a, b = np.empty(nbytes, np.uint8), np.ones(nbytes, np.uint8)
        a[:] = 0
        r = np.empty(file_bytes, np.uint8)
        r[:] = 0
        _read_all(paths, r)      # the page cache warm

        for tier, store in (("host", host), ("disk", disk)):
            def once() -> tuple[float, float]:
                dst.seq_rm(0)
                t0 = time.perf_counter_ns()
                k = store.load(dst, 0, toks)
                t1 = time.perf_counter_ns()
                if k != tokens:
                    raise AssertionError(f"restored {k} of {tokens} tokens")
                if tier == "host":
                    np.copyto(a, b)
                else:
                    _read_all(paths, r)
                t2 = time.perf_counter_ns()
                return t1 - t0, t2 - t1
            res = [once() for _ in range(reps)]
            if dst.state_write(0) != want:
                raise AssertionError("the restored sequence differs from the saved one")
            fast, floor = [x[0] for x in res], [x[1] for x in res]
            m, rg = _median_range(fast)
            if tier == "host":
                name = f"store: restore a prefix from the host tier into a cache, {label}"
                yard, yb = "memcpy of its bytes (numpy copyto)", nbytes
            else:
                name = f"store: restore a prefix from the disk tier (page cache warm) into a cache, {label}"
                yard, yb = "read of its files into one buffer", file_bytes
            rows.append(Row(name, m, rg, gbps=nbytes / m, yardstick=yard, yardstick_gbps=yb / statistics.median(floor),
                            yardstick_ratio=_paired(fast, floor),
                            note=f"{tokens // CHUNK} chunks; checked against the saved sequence"))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return rows


def bench_store_llama(quick: bool, reps: int) -> list[Row]:
    """Time to first token of llama-cpp-python with kvcache's prompt cache, its own LlamaRAMCache
    and no cache: one shared prefix, distinct suffixes, the context reset before each request (as
    after other traffic or in a new process: the context's own reuse of the last prompt left out)."""
    import importlib.util

    from kvcache_bench._rows import waiting

    if importlib.util.find_spec("llama_cpp") is None:
        return [waiting("store: llama-cpp-python time to first token", "llama-cpp-python is not installed")]
    import llama_cpp

    from kvcache.integrations.llama_cpp import LlamaPromptCache

    path = _tiny_model()
    if path is None:
        return [waiting("store: llama-cpp-python time to first token", "the tiny test model (tests/data/models of a clone) is not here")]
    n_prefix, n_suffix = (500, 10) if quick else (2000, 100)
    rng = np.random.default_rng(0)
    rows = []
    times: dict[str, list[float]] = {}
    held: dict[str, int] = {}
    for kind in ("none", "LlamaRAMCache", "kvcache"):
        llama = llama_cpp.Llama(model_path=path, n_ctx=n_prefix + 64, n_batch=512, verbose=False, seed=1,
                                n_threads=1, n_threads_batch=1)
        vocab = llama.n_vocab()
        prefix = [int(t) for t in np.random.default_rng(1).integers(10, vocab, n_prefix)]
        cache: Any = None
        if kind == "LlamaRAMCache":
            cache = llama_cpp.LlamaRAMCache(capacity_bytes=1 << 40)
        elif kind == "kvcache":
            cache = LlamaPromptCache(llama, chunk_tokens=64, capacity_bytes=1 << 40)
        if cache is not None:
            llama.set_cache(cache)
        out = []
        for i in range(n_suffix + 1):
            prompt = prefix + [int(t) for t in rng.integers(10, vocab, 16)]
            llama.reset()
            t0 = time.perf_counter_ns()
            llama.create_completion(prompt, max_tokens=1, temperature=0.0)
            if i:            # the first request fills the caches
                out.append(time.perf_counter_ns() - t0)
        times[kind] = out
        held[kind] = 0 if cache is None else int(cache.cache_size)
    base = statistics.median(times["none"])
    for kind in ("none", "LlamaRAMCache", "kvcache"):
        m, rg = _median_range(times[kind])
        rows.append(Row(f"store: llama-cpp-python time to first token, {n_prefix}-token shared prefix, "
                        f"{n_suffix} suffixes of 16, tiny Llama, {kind}", m, rg, base, base / m,
                        note=f"cache holds {held[kind] / 2**20:.1f} MiB after {n_suffix + 1} requests; "
                             "baseline: no cache"))
    return rows


def _tiny_model() -> str | None:
    """The tiny Llama of the test suite (tests/data/models), when the bench runs from a clone."""
    here = os.path.dirname(os.path.abspath(__file__))
    p = os.path.join(here, "..", "..", "tests", "data", "models", "tiny_llama.gguf")
    return p if os.path.isfile(p) else None
