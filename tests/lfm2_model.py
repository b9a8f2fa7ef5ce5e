"""A tiny transformers LFM2 (random weights) driven through a HybridCache: its attention K/V and
convolution states live in the cache, as a server would keep them. Shared by the prefix-reuse and
prefix-store tests."""
import numpy as np

from kvcache import UBatch

CONV_LAYERS, ATTN_LAYERS = (0, 2), (1, 3)


def tiny_lfm2(transformers):
    """(model, cfg): 4 layers, short convolutions in 0 and 2, attention in 1 and 3."""
    cfg = transformers.Lfm2Config(num_hidden_layers=4, layer_types=["conv", "full_attention"] * 2, conv_L_cache=3,
                                  hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
                                  max_position_embeddings=256, vocab_size=50)
    return transformers.Lfm2ForCausalLM(cfg).eval(), cfg


def lfm2_chunk(torch, transformers, model, cfg, h, s, tokens, start, end):
    """The model computes tokens[start:end] of s: the attention K/V of [0, start) and the
    convolution states read from the cache h, the new ones written to it; returns the last logits."""
    head = cfg.hidden_size // cfg.num_attention_heads
    n_kv, L = cfg.num_key_value_heads, cfg.conv_L_cache
    assert h.find_slot(UBatch(list(range(start, end)), [s], n_seq_tokens=end - start, tokens=tokens[start:end]))
    plane, cell = divmod(int(h.s_copy()[0]), h.recr.size)
    cache = transformers.DynamicCache(config=cfg)
    cells, pos = h.attn.seq_cells(s)
    held = [c for p, c in sorted(zip(pos, cells)) if p < start]
    for il in ATTN_LAYERS:
        if start:
            k = torch.from_numpy(np.array(h.attn.k(il)).reshape(-1, n_kv, head)[held]).permute(1, 0, 2)[None]
            v = torch.from_numpy(np.array(h.attn.v(il)).reshape(-1, n_kv, head)[held]).permute(1, 0, 2)[None]
            cache.update(k.contiguous(), v.contiguous(), il)
    if not (plane == 0 and cell == h.rs_z):
        for il in CONV_LAYERS:
            layer = cache.layers[il]
            conv = torch.from_numpy(np.array(h.r(il, plane)[cell])).reshape(1, cfg.hidden_size, L)
            layer.lazy_initialization(conv_states=conv)
            layer.conv_states[0].copy_(conv)
            layer.has_previous_state[0] = True
            layer.cumulative_length_linear.fill_(start)
    with torch.no_grad():
        out = model(torch.tensor([tokens[start:end]]), cache=cache, use_cache=True)
    for il in ATTN_LAYERS:
        layer = cache.layers[il]
        rows = [x[0, :, start:end].permute(1, 0, 2).reshape(end - start, -1).numpy()
                for x in (layer.keys, layer.values)]
        h.store(il, *rows)
    for il in CONV_LAYERS:
        h.store_state(il, cache.layers[il].conv_states[0].reshape(1, -1).numpy())
    return out.logits[0, -1]
