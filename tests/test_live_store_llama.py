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
    return L.Llama(model_path=str(model_path("tiny_llama.gguf")), n_ctx=256, n_batch=256, logits_all=True,
                   verbose=False, seed=1, n_threads=1, **kw)


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
    from kvcache.integrations.llama_cpp import LlamaPromptCache, layout_of_installed

    rng = np.random.default_rng(0)
    first = _new(L, flash_attn=flash_attn)
    vocab = first.n_vocab()
    shared = [int(t) for t in rng.integers(10, vocab, 3 * CHUNK + 5)]
    p1 = shared + [int(t) for t in rng.integers(10, vocab, 7)]
    p2 = shared + [int(t) for t in rng.integers(10, vocab, 9)]

    c1 = LlamaPromptCache(first, tmp_path / "store", chunk_tokens=CHUNK)
    assert c1.scratch.v_trans is not flash_attn          # V stored as the context stores it
    assert c1.layout == layout_of_installed() == ("2026" if L.__version__ == "0.3.36" else "2025")
    first.set_cache(c1)
    _complete(first, p1)
    assert c1.store.stats["files_written"] >= 3            # the prompt's whole chunks (and the completion's)

    second = _new(L, flash_attn=flash_attn)
    c2 = LlamaPromptCache(second, tmp_path / "store", chunk_tokens=CHUNK, capacity_bytes=0)
    second.set_cache(c2)
    assert p2 in c2 and c2.store.match(p2) == 3 * CHUNK
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
    from kvcache.integrations.llama_cpp import LlamaPromptCache

    llama = _new(L)
    cache = LlamaPromptCache(llama, chunk_tokens=CHUNK)
    assert [1, 2, 3] not in cache
    with pytest.raises(KeyError):
        cache[list(range(10, 10 + 2 * CHUNK))]
    llama.set_cache(cache)
    prompt = list(range(20, 20 + CHUNK + 3))
    text, logits, toks = _complete(llama, prompt)
    plain = _new(L)
    assert _complete(plain, prompt)[2] == toks
    assert cache.cache_size == cache.store.host_used > 0
