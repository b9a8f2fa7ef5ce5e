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
    convolution states read from the cache h, the new ones written to it; returns the last logits.
    With a sliding window (h.n_swa; every attention layer in the SWA cache, as LFM2's loader
    places them) the attention sees what llama.cpp's SWA mask leaves: a query at p the keys at
    p - n_swa < p' <= p, read from the SWA cache (only those: the cells the window has left may
    be gone)."""
    head = cfg.hidden_size // cfg.num_attention_heads
    n_kv, L = cfg.num_key_value_heads, cfg.conv_L_cache
    assert h.find_slot(UBatch(list(range(start, end)), [s], n_seq_tokens=end - start, tokens=tokens[start:end]))
    plane, cell = divmod(int(h.s_copy()[0]), h.recr.size)
    cache = transformers.DynamicCache(config=cfg)
    n_swa = h.n_swa
    part = h.attn.swa if n_swa else h.attn
    cells, pos = part.seq_cells(s)
    first = start - n_swa + 1 if n_swa else 0
    seen = sorted((p, c) for p, c in zip(pos, cells) if first <= p < start)
    held = [c for _, c in seen]
    if n_swa:
        assert [p for p, _ in seen] == list(range(max(first, 0), start)), "the window before start is held"
    for il in ATTN_LAYERS:
        if held:
            k = torch.from_numpy(np.array(part.k(il)).reshape(-1, n_kv, head)[held]).permute(1, 0, 2)[None]
            v = torch.from_numpy(np.array(part.v(il)).reshape(-1, n_kv, head)[held]).permute(1, 0, 2)[None]
            cache.update(k.contiguous(), v.contiguous(), il)
    if not (plane == 0 and cell == h.rs_z):
        for il in CONV_LAYERS:
            layer = cache.layers[il]
            conv = torch.from_numpy(np.array(h.r(il, plane)[cell])).reshape(1, cfg.hidden_size, L)
            layer.lazy_initialization(conv_states=conv)
            layer.conv_states[0].copy_(conv)
            layer.has_previous_state[0] = True
            layer.cumulative_length_linear.fill_(start)
    kw = {}
    if n_swa:
        q = torch.arange(start, end)[:, None]
        kpos = torch.tensor([p for p, _ in seen] + list(range(start, end)))[None, :]
        hidden = (kpos > q) | (q - kpos >= n_swa)
        mask = torch.zeros(hidden.shape).masked_fill(hidden, torch.finfo(torch.float32).min)[None, None]
        kw = dict(attention_mask={"full_attention": mask, "conv": None},
                  position_ids=torch.arange(start, end)[None])
    with torch.no_grad():
        out = model(torch.tensor([tokens[start:end]]), cache=cache, use_cache=True, **kw)
    for il in ATTN_LAYERS:
        layer = cache.layers[il]
        n_old = len(held)
        rows = [x[0, :, n_old:n_old + end - start].permute(1, 0, 2).reshape(end - start, -1).numpy()
                for x in (layer.keys, layer.values)]
        h.store(il, *rows)
    for il in CONV_LAYERS:
        h.store_state(il, cache.layers[il].conv_states[0].reshape(1, -1).numpy())
    return out.logits[0, -1]
