"""kvcache's prompt cache for llama-cpp-python (kvcache.integrations.llama_cpp), live.

Runs against whichever llama-cpp-python is importable: 0.3.10 (layout "2025", .ci/run's llama
stage, in the suite) or 0.3.36 (layout "2026", .ci/run's llama36 stage, in a process of its own
as tests/test_live_v10.py). A first Llama completes a prompt with the cache on (its chunks go to
a store directory); a second Llama, with a cache of its own on the same directory (as another
process would have), completes a prompt that shares the first one's prefix: the prefix is
restored from the directory through llama.cpp's own state call, and the completion's tokens and
the next-token logits equal those of a Llama without a cache."""
import numpy as np
import pytest

from conftest import need
from interop_data import model_path

CHUNK = 16


def _llama_cpp():
    try:
        import llama_cpp
    except ImportError as e:
        need("llama", f"llama_cpp is not importable ({e}); .ci/run's llama stage installs llama-cpp-python==0.3.10")
    v = getattr(llama_cpp, "__version__", "")
    if v not in ("0.3.10", "0.3.36"):
        need("llama", f"llama-cpp-python {v} is installed; these tests know 0.3.10 and 0.3.36")
    return llama_cpp


def _new(L, **kw):
    """A Llama keeping every token's logits (the tests read the next token's after the prompt:
    today's llama-cpp-python keeps none without logits_all)."""
    kw = {"logits_all": True, "model_path": str(model_path("tiny_llama.gguf")), **kw}
    return L.Llama(n_ctx=256, n_batch=256, verbose=False, seed=1, n_threads=1, **kw)


def _cache(llama, *args, **kw):
    """Its prompt cache: these tests read no restored token's logits."""
    from kvcache.integrations.llama_cpp import LlamaPromptCache

    return LlamaPromptCache(llama, *args, allow_logits_all=True, **kw)


def _complete(llama, prompt):
    out = llama.create_completion(prompt, max_tokens=6, temperature=0.0)
    text = out["choices"][0]["text"]
    logits = np.array(llama.scores[len(prompt) - 1], dtype=np.float32)   # the next token's after the prompt
    return text, logits, list(llama._input_ids[len(prompt):])


@pytest.fixture(scope="module")
def L():
    return _llama_cpp()


@pytest.mark.parametrize("flash_attn", [False, True])
def test_a_shared_prefix_restores_from_the_store_and_decodes_the_same(L, tmp_path, flash_attn):
    from kvcache.integrations.llama_cpp import layout_of_installed

    rng = np.random.default_rng(0)
    first = _new(L, flash_attn=flash_attn)
    vocab = first.n_vocab()
    shared = [int(t) for t in rng.integers(10, vocab, 3 * CHUNK + 5)]
    p1 = shared + [int(t) for t in rng.integers(10, vocab, 7)]
    p2 = shared + [int(t) for t in rng.integers(10, vocab, 9)]

    c1 = _cache(first, tmp_path / "store", chunk_tokens=CHUNK)
    assert c1.scratch.v_trans is not flash_attn          # V stored as the context stores it
    assert c1.layout == layout_of_installed() == ("2026" if L.__version__ == "0.3.36" else "2025")
    first.set_cache(c1)
    _complete(first, p1)
    assert c1.store.stats["files_written"] >= 3            # the prompt's whole chunks (and the completion's)

    second = _new(L, flash_attn=flash_attn)
    c2 = _cache(second, tmp_path / "store", chunk_tokens=CHUNK, capacity_bytes=0)
    second.set_cache(c2)
    assert p2 in c2 and c2.store.match(p2, c2.namespace) == 3 * CHUNK
    text, logits, toks = _complete(second, p2)
    assert c2.store.stats["disk_hits"] == 3                 # restored from the directory, not computed

    plain = _new(L, flash_attn=flash_attn)
    want_text, want_logits, want_toks = _complete(plain, p2)
    assert toks == want_toks and text == want_text
    np.testing.assert_allclose(logits, want_logits, rtol=0, atol=1e-4)

    # the first Llama, reset, gets the prefix from its host tier the same way
    first.reset()
    text1, logits1, toks1 = _complete(first, p2)
    assert c1.store.stats["host_hits"] >= 3 and toks1 == want_toks
    np.testing.assert_allclose(logits1, want_logits, rtol=0, atol=1e-4)


def test_a_prompt_without_a_stored_prefix_is_a_miss(L, tmp_path):
    llama = _new(L)
    cache = _cache(llama, chunk_tokens=CHUNK)
    assert [1, 2, 3] not in cache
    with pytest.raises(KeyError):
        cache[list(range(10, 10 + 2 * CHUNK))]
    llama.set_cache(cache)
    prompt = list(range(20, 20 + CHUNK + 3))
    text, logits, toks = _complete(llama, prompt)
    plain = _new(L)
    assert _complete(plain, prompt)[2] == toks
    assert cache.cache_size == cache.store.host_used > 0


def _shared_prompts(vocab, seed=0):
    rng = np.random.default_rng(seed)
    shared = [int(t) for t in rng.integers(10, vocab, 3 * CHUNK + 5)]
    return shared + [int(t) for t in rng.integers(10, vocab, 7)], shared + [int(t) for t in rng.integers(10, vocab, 9)]


@pytest.mark.parametrize("other", [{"rope_freq_base": 50000.0}, {"rope_freq_scale": 0.5},
                                   {"model_path": str(model_path("tiny_llama_hd32.gguf"))}],
                         ids=["rope_freq_base", "rope_freq_scale", "another model of the same geometry"])
def test_a_directory_shared_with_another_model_or_rope_setting_is_a_miss(L, tmp_path, other):
    """The K/V depend on the weights and RoPE beyond the store's geometry: a Llama whose model or
    RoPE parameters differ finds nothing of the other's in a shared directory (it restored the
    other's K/V, and decoded other tokens)."""
    first = _new(L)
    p1, p2 = _shared_prompts(first.n_vocab())
    c1 = _cache(first, tmp_path / "store", chunk_tokens=CHUNK)
    first.set_cache(c1)
    _complete(first, p1)
    second = _new(L, **other)
    c2 = _cache(second, tmp_path / "store", chunk_tokens=CHUNK, capacity_bytes=0)
    assert c2.scratch.layers == c1.scratch.layers and c2.fingerprint != c1.fingerprint
    second.set_cache(c2)
    assert p2 not in c2
    text, logits, toks = _complete(second, p2)
    assert c2.store.stats["disk_hits"] == 0
    want = _complete(_new(L, **other), p2)
    assert toks == want[2] and text == want[0]
    np.testing.assert_allclose(logits, want[1], rtol=0, atol=1e-4)
    # the same settings again share it
    third = _new(L, **other)
    c3 = _cache(third, tmp_path / "store", chunk_tokens=CHUNK, capacity_bytes=0)
    assert c3.fingerprint == c2.fingerprint and p2 in c3


def test_a_llama_keeping_every_tokens_logits_is_refused_unless_allowed(L):
    """Restored tokens have no logits: prompt logprobs after a restore were -log(n_vocab) each."""
    from kvcache.integrations.llama_cpp import LlamaPromptCache

    with pytest.raises(ValueError, match=r"keeps the logits of every token \(logits_all=True or a draft model\)"):
        LlamaPromptCache(_new(L), chunk_tokens=CHUNK)
    with pytest.raises(TypeError, match="allow_logits_all must be a bool"):
        LlamaPromptCache(_new(L), chunk_tokens=CHUNK, allow_logits_all=1)
    # allowed: a restored token's logits are unknown (NaN), never a plausible number
    llama = _new(L)
    cache = _cache(llama, chunk_tokens=CHUNK)
    llama.set_cache(cache)
    p1, p2 = _shared_prompts(llama.n_vocab())
    _complete(llama, p1)
    llama.reset()
    _complete(llama, p2)
    assert cache.store.stats["host_hits"] == 3
    assert np.isnan(llama.scores[:3 * CHUNK]).all() and np.isfinite(llama.scores[3 * CHUNK:len(p2)]).all()


def test_the_default_llama_restores_and_decodes_the_same(L, tmp_path):
    """logits_all=False (llama-cpp-python's default): the cache as the docs make it."""
    from kvcache.integrations.llama_cpp import LlamaPromptCache

    first = _new(L, logits_all=False)
    p1, p2 = _shared_prompts(first.n_vocab(), seed=3)
    first.set_cache(LlamaPromptCache(first, tmp_path / "store", chunk_tokens=CHUNK))
    first.create_completion(p1, max_tokens=6, temperature=0.0)
    second = _new(L, logits_all=False)
    c2 = LlamaPromptCache(second, tmp_path / "store", chunk_tokens=CHUNK, capacity_bytes=0)
    second.set_cache(c2)
    got = second.create_completion(p2, max_tokens=6, temperature=0.0)["choices"][0]["text"]
    assert c2.store.stats["disk_hits"] == 3
    assert got == _new(L, logits_all=False).create_completion(p2, max_tokens=6, temperature=0.0)["choices"][0]["text"]


def test_keys_states_and_arguments_are_checked(L, tmp_path):
    """Keys are token ids as the store reads them (floats were truncated, bytes read as ids);
    states and arguments are checked where they are given."""
    llama = _new(L)
    cache = _cache(llama, chunk_tokens=CHUNK)
    toks = list(range(20, 20 + 3 * CHUNK + 2))
    llama.set_cache(cache)
    _complete(llama, toks)
    assert toks in cache and np.asarray(toks) in cache and tuple(toks) in cache
    for key in ([t + 0.9 for t in toks], [str(t) for t in toks], bytes(toks), set(toks), dict.fromkeys(toks),
                [True] * len(toks)):
        with pytest.raises(TypeError, match="tokens must be a 1-d sequence of token ids"):
            key in cache
        with pytest.raises(TypeError, match="tokens must be a 1-d sequence of token ids"):
            cache[key]
    with pytest.raises(ValueError, match="tokens must fit in int32"):
        cache[[2**40] * 40]
    state = llama.save_state()
    for n in (-5, len(state.input_ids) + 1):
        with pytest.raises(ValueError, match=f"the state's n_tokens {n} is not within"):
            cache[toks] = L.llama.LlamaState(state.input_ids, state.scores, n, state.llama_state,
                                             state.llama_state_size, state.seed)
    with pytest.raises(TypeError):
        cache[toks] = L.llama.LlamaState(state.input_ids, state.scores, 2.5, state.llama_state,
                                         state.llama_state_size, state.seed)
    for kw, err, text in (({"capacity_bytes": -1}, ValueError, "capacity_bytes must be an int >= 0, not -1"),
                          ({"disk_bytes": -1}, ValueError, "disk_bytes must be an int >= 0, not -1"),
                          ({"salt": 5}, TypeError, "salt must be a str, bytes or None, not int")):
        with pytest.raises(err, match=text):
            _cache(llama, **kw)
    with pytest.raises(ValueError, match="chunk_tokens must be an int in"):
        _cache(llama, tmp_path / "st", chunk_tokens=0)


def test_a_cache_set_on_another_llama_is_refused(L):
    """Its state is of its own Llama's geometry and context size: another Llama half-loaded it
    (llama-cpp-python sets its token count before the load fails) and decoded wrong logits."""
    a = _new(L)
    cache = _cache(a, chunk_tokens=CHUNK)
    a.set_cache(cache)
    p1, p2 = _shared_prompts(a.n_vocab())
    _complete(a, p1)
    b = _new(L, flash_attn=True)
    b.set_cache(cache)
    with pytest.raises(ValueError, match="this cache serves the Llama it was made for, not another"):
        b.create_completion(p2, max_tokens=2, temperature=0.0)
    b.set_cache(None)
    want = _complete(_new(L, flash_attn=True), p2)
    b.reset()
    assert _complete(b, p2)[2] == want[2]
