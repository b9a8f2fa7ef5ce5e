"""Prefix reuse with real models: a request served from the cells an earlier request left in the
prefix index gets the same next-token logits as the request computed from scratch.

Tiny transformers Llama and Gemma2 models (random weights from their configs). A first request's
K/V (every layer) go into a today's-semantics UnifiedCache through find_slot + store, then the
request ends into the index; a second request sharing part of its prompt attaches that prefix,
takes its rows from the cache (the documented torch path: a sequence's cells in position order,
docs/torch.md) and computes only the rest."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import kvcache  # noqa: E402
from kvcache import UBatch  # noqa: E402


def _model(kind: str):
    torch.manual_seed(0)
    common = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=256)
    if kind == "llama":
        cfg = transformers.LlamaConfig(**common)
        model = transformers.LlamaForCausalLM(cfg)
    else:
        cfg = transformers.Gemma2Config(**common, sliding_window=64, query_pre_attn_scalar=16)
        model = transformers.Gemma2ForCausalLM(cfg)
    return model.eval().to(torch.float32), cfg


def _cache(cfg) -> kvcache.UnifiedCache2026:
    w = cfg.num_key_value_heads * cfg.head_dim
    c = kvcache.UnifiedCache(128, cfg.num_hidden_layers, w, w, type_k="f32", type_v="f32", v_trans=False,
                             n_seq_max=2, semantics="2026")
    c.enable_prefix_reuse()
    return c


def _layers_kv(past):
    """Per layer (K, V) as (tokens, heads * head_dim) rows, from a transformers cache."""
    out = []
    for layer in past.layers:
        k, v = layer.keys[0], layer.values[0]                  # (heads, tokens, head_dim)
        out.append((k.transpose(0, 1).reshape(k.shape[1], -1).numpy(),
                    v.transpose(0, 1).reshape(v.shape[1], -1).numpy()))
    return out


@pytest.mark.parametrize("kind", ["llama", "gemma2"])
@torch.no_grad()
def test_a_reused_prefix_gives_the_logits_of_recomputation(kind):
    model, cfg = _model(kind)
    c = _cache(cfg)
    g = torch.Generator().manual_seed(1)
    first = torch.randint(0, cfg.vocab_size, (20,), generator=g).tolist()
    second = first[:14] + torch.randint(0, cfg.vocab_size, (6,), generator=g).tolist()

    # the first request: computed, stored, ended into the index
    out = model(torch.tensor([first]), use_cache=True)
    assert c.find_slot(UBatch(list(range(len(first))), [0] * len(first), tokens=first))
    for il, (k, v) in enumerate(_layers_kv(out.past_key_values)):
        c.store(il, k, v)
    assert c.prefix_release(0) == len(first)

    # the second request: 14 tokens from the index, 6 computed
    n = c.prefix_attach(1, second)
    assert n == 14
    cells, pos = c.seq_cells(1)
    assert list(pos) == list(range(n))
    past = transformers.DynamicCache()
    h, d = cfg.num_key_value_heads, cfg.head_dim
    for il in range(cfg.num_hidden_layers):
        k = torch.from_numpy(np.asarray(c.k(il))[cells]).reshape(n, h, d).transpose(0, 1)[None]
        v = torch.from_numpy(np.asarray(c.v(il))[cells]).reshape(n, h, d).transpose(0, 1)[None]
        past.update(k.contiguous(), v.contiguous(), il)
    reused = model(torch.tensor([second[n:]]), cache=past, use_cache=True,
                   position_ids=torch.arange(n, len(second))[None])
    scratch = model(torch.tensor([second]))
    torch.testing.assert_close(reused.logits[0, -1], scratch.logits[0, -1], rtol=1e-5, atol=1e-5)
    # and the rows the second request computed are what recomputation computes, the reused ones too
    assert c.find_slot(UBatch(list(range(n, len(second))), [1] * (len(second) - n), tokens=second[n:]))
    for il, (k, v) in enumerate(_layers_kv(reused.past_key_values)):
        c.store(il, k[n:], v[n:])
    full = _layers_kv(model(torch.tensor([second]), use_cache=True).past_key_values)
    cells, _ = c.seq_cells(1)
    for il, (k, _v) in enumerate(full):
        np.testing.assert_allclose(np.asarray(c.k(il))[cells], k, rtol=1e-5, atol=1e-5)
    assert c.prefix_release(1) == len(second)
    assert c.prefix_stats["cells"] == len(first) + 6


@torch.no_grad()
def test_gemma2_with_a_small_swa_cache_reuses_the_window():
    """Gemma2's sliding layers in the small SWA cache of an iSWA pair (swa_full=False): a chat's
    next turn attaches the previous prompt, whose early positions that cache no longer holds;
    the sliding layer's rows before the window are never read (here: filled with noise), and
    the logits are those of recomputation."""
    torch.manual_seed(0)
    w_slide = 8
    cfg = transformers.Gemma2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                    max_position_embeddings=1024, sliding_window=w_slide, query_pre_attn_scalar=16)
    model = transformers.Gemma2ForCausalLM(cfg).eval().to(torch.float32)
    sliding = [il for il, t in enumerate(cfg.layer_types) if t == "sliding_attention"]
    assert sliding and len(sliding) < cfg.num_hidden_layers
    h, d = cfg.num_key_value_heads, cfg.head_dim
    # the SWA cache: n_swa * n_seq_max + n_batch cells padded to 256, far fewer than the prompt
    c = kvcache.ISWACache(1024, cfg.num_hidden_layers, h * d, h * d, swa_layers=sliding, n_swa=w_slide,
                          type_k="f32", type_v="f32", v_trans=False, n_seq_max=2, n_batch=8, swa_full=False,
                          semantics="2026")
    c.enable_prefix_reuse()
    g = torch.Generator().manual_seed(1)
    first = torch.randint(0, cfg.vocab_size, (300,), generator=g).tolist()
    second = first + torch.randint(0, cfg.vocab_size, (6,), generator=g).tolist()

    # every layer's K/V of every position (a cache without sliding layers keeps them all)
    kv = _layers_kv(model(torch.tensor([first]), cache=transformers.DynamicCache(), use_cache=True).past_key_values)
    for a in range(0, len(first), 8):   # ubatches of the SWA cache's size: its early cells are overwritten
        b = min(a + 8, len(first))
        assert c.find_slot(UBatch(list(range(a, b)), [0] * (b - a), tokens=first[a:b]))
        for il, (k, v) in enumerate(kv):
            c.store(il, k[a:b], v[a:b])
    assert min(c.swa.seq_cells(0)[1]) > 0
    assert c.prefix_release(0) == len(first)

    n = c.prefix_attach(1, second)
    assert n == len(first)
    past = transformers.DynamicCache()
    for il in range(cfg.num_hidden_layers):
        part = c.swa if il in sliding else c.base
        cells, pos = part.seq_cells(1)
        k = torch.randn(n, h * d, generator=g) * 100   # rows the window hides
        v = torch.randn(n, h * d, generator=g) * 100
        k[torch.from_numpy(pos.astype(np.int64))] = torch.from_numpy(np.asarray(part.k(il))[cells])
        v[torch.from_numpy(pos.astype(np.int64))] = torch.from_numpy(np.asarray(part.v(il))[cells])
        if il in sliding:
            assert sorted(pos.tolist()) == list(range(n - w_slide + 1, n))
        else:
            assert list(pos) == list(range(n))
        past.update(k.reshape(n, h, d).transpose(0, 1)[None].contiguous(),
                    v.reshape(n, h, d).transpose(0, 1)[None].contiguous(), il)
    reused = model(torch.tensor([second[n:]]), cache=past, use_cache=True,
                   position_ids=torch.arange(n, len(second))[None], cache_position=torch.arange(n, len(second)))
    scratch = model(torch.tensor([second]))
    torch.testing.assert_close(reused.logits[0, -1], scratch.logits[0, -1], rtol=1e-5, atol=1e-5)
