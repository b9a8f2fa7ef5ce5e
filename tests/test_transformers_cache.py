"""kvcache.integrations.transformers: unmodified ``model.generate`` over the kvcache Cache gives
the tokens and logits of transformers' own DynamicCache, for tiny random Llama (full attention,
eager and SDPA) and Gemma2 (sliding-window layers, eager) models built from configs: batch 1 and
batches with left padding, beam search, a continuation, and a save and restore into a fresh
cache."""
import warnings

import numpy as np
import pytest

from conftest import need, need_module

torch = need_module("torch", "torch")
transformers = need_module("transformers", "transformers")
if int(transformers.__version__.split(".")[0]) < 5:
    need("transformers", f"transformers 5.x is needed, {transformers.__version__} is installed")

from transformers import DynamicCache  # noqa: E402

from kvcache.geometry import hf_attention  # noqa: E402
from kvcache.integrations import transformers as tx  # noqa: E402
from kvcache.integrations.transformers import KVCache, from_model  # noqa: E402

N_NEW = 12


@pytest.fixture(params=[None, 0, 18], ids=["short-rows-concatenated", "views-throughout", "views-from-18"])
def cat_max(request, monkeypatch):
    """The indices per row up to which the Cache's full-attention layers concatenate (CAT_MAX):
    as shipped (more than any test here holds), 0 (views of the cache's tensor from the first
    forward on) and 18 (the switch within a test's generate, its K/V moved into the tensor)."""
    if request.param is not None:
        monkeypatch.setattr(tx, "CAT_MAX", request.param)
    return tx.CAT_MAX


def _model(kind, attn="eager"):
    torch.manual_seed(0)
    common = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256)
    if kind == "llama":
        cfg = transformers.LlamaConfig(num_hidden_layers=2, initializer_range=0.2, **common)
        cls = transformers.LlamaForCausalLM
    elif kind == "llama4":
        # chunked attention (chunks of 4) in three layers of four, as Llama 4 has it
        cfg = transformers.Llama4TextConfig(num_hidden_layers=4, head_dim=8, attention_chunk_size=4,
                                            intermediate_size_mlp=64, num_local_experts=2, **common)
        cls = transformers.Llama4ForCausalLM
    else:
        cfg = transformers.Gemma2Config(num_hidden_layers=4, head_dim=8, sliding_window=6, tie_word_embeddings=False,
                                        **common)
        cls = transformers.Gemma2ForCausalLM
    return cls._from_config(cfg, attn_implementation=attn).eval()


def _inputs(pads, length=14):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, 128, (len(pads), length), generator=g)
    mask = torch.ones_like(ids)
    for b, p in enumerate(pads):
        ids[b, :p] = 0
        mask[b, :p] = 0
    return ids, mask


def _generate(model, ids, mask, cache, n_new=N_NEW, **kw):
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)   # the cache keyword's new name on 5.24
        out = model.generate(ids, attention_mask=mask, max_new_tokens=n_new, do_sample=False, pad_token_id=0,
                             past_key_values=cache, return_dict_in_generate=True, output_logits=True, **kw)
    return out.sequences, torch.stack(out.logits, 1)


def _same(a, b):
    assert torch.equal(a[0], b[0])
    torch.testing.assert_close(a[1], b[1], rtol=0, atol=1e-5)


CASES = [("llama", "eager"), ("llama", "sdpa"), ("gemma2", "eager"), ("llama4", "sdpa")]
PADS = [(0,), (0, 5), (3, 0, 7)]


@pytest.mark.parametrize("kind,attn", CASES)
@pytest.mark.parametrize("pads", PADS, ids=["b1", "b2-left-pad", "b3-left-pad"])
@pytest.mark.usefixtures("cat_max")
def test_generate_matches_dynamic_cache(kind, attn, pads):
    model = _model(kind, attn)
    ids, mask = _inputs(pads)
    want = _generate(model, ids, mask, DynamicCache(config=model.config))
    # a small window cache for Gemma2: its cells are reused as the window slides
    cache = from_model(model, n_ctx=64, n_batch=len(pads) * ids.shape[1])
    got = _generate(model, ids, mask, cache)
    _same(got, want)
    assert cache.get_seq_length() == ids.shape[1] + N_NEW - 1
    if kind == "gemma2":
        assert cache.kv.swa.size < cache.kv.base.size


@pytest.mark.parametrize("kind,attn", [("llama", "sdpa"), ("gemma2", "eager")])
@pytest.mark.usefixtures("cat_max")
def test_save_and_restore_into_a_fresh_cache(kind, attn):
    model = _model(kind, attn)
    ids, mask = _inputs((0, 4))
    first = from_model(model, n_ctx=48)
    seq, _ = _generate(model, ids, mask, first, n_new=6)
    blob = first.state_write()
    mask2 = torch.cat([mask, torch.ones(2, seq.shape[1] - ids.shape[1], dtype=mask.dtype)], 1)
    ref_cache = DynamicCache(config=model.config)
    _generate(model, ids, mask, ref_cache, n_new=6)
    want = _generate(model, seq, mask2, ref_cache)                # DynamicCache continued
    restored = from_model(model, n_ctx=48)
    restored.state_read(blob, batch_size=2, dtype=torch.float32)
    assert restored.get_seq_length() == seq.shape[1] - 1
    got = _generate(model, seq, mask2, restored)
    _same(got, want)
    _same(_generate(model, seq, mask2, first), want)              # and the saved one, continued


@pytest.mark.usefixtures("cat_max")
def test_beam_search_reorders_rows():
    model = _model("llama")
    ids, mask = _inputs((0,))
    want = _generate(model, ids, mask, DynamicCache(config=model.config), num_beams=3)
    got = _generate(model, ids, mask, from_model(model, n_ctx=32), num_beams=3)
    assert torch.equal(got[0], want[0])


@pytest.mark.usefixtures("cat_max")
def test_crop_and_reset():
    model = _model("llama")
    ids, mask = _inputs((0,))
    cache = from_model(model, n_ctx=40)
    _generate(model, ids, mask, cache)
    n = cache.get_seq_length()
    cache.crop(-5)
    assert cache.get_seq_length() == n - 5 and cache.kv.seq_pos_max(0) == n - 6
    cache.crop(3)
    assert cache.get_seq_length() == 3
    cache.reset()
    assert cache.get_seq_length() == 0 and cache.kv.used == 0
    _same(_generate(model, ids, mask, cache), _generate(model, ids, mask, DynamicCache(config=model.config)))


def test_the_layers_are_what_transformers_reads():
    model = _model("gemma2")
    cache = from_model(model, n_ctx=16)
    assert len(cache.layers) == 4 and cache.is_sliding == [True, False, True, False]
    assert not any(cache.is_linear) and not cache.is_compileable
    assert hf_attention(model.config)[-2:] == (6, ["sliding_attention", "full_attention"] * 2)
    # Llama 4's chunked layers: windows of the chunk size, as DynamicCache's layers for them
    model = _model("llama4")
    cache, dyn = from_model(model, n_ctx=16), DynamicCache(config=model.config)
    assert cache.is_sliding == dyn.is_sliding == [True, True, True, False]
    assert [layer.sliding_window for layer in cache.layers[:3]] == [4] * 3
    with pytest.raises(ValueError, match="only full and sliding"):
        hf_attention(model.config)
    assert hf_attention(model.config, chunked_as_sliding=True)[-2:] == (4, ["sliding_attention"] * 3 + ["full_attention"])


def test_what_it_cannot_do_raises():
    model = _model("llama")
    ids, mask = _inputs((0,), length=30)
    with pytest.raises(ValueError, match="holds 16 indices"):
        _generate(model, ids, mask, from_model(model, n_ctx=16))
    cache = from_model(model, n_ctx=64)
    _generate(model, ids[:, :4], mask[:, :4], cache, n_new=2)
    with pytest.raises(ValueError, match="batch of 2 rows"):
        _generate(model, ids[:, :4].repeat(2, 1), mask[:, :4].repeat(2, 1), cache, n_new=2)
    with pytest.raises(NotImplementedError):
        cache.batch_repeat_interleave(2)
    with pytest.raises(NotImplementedError):
        cache.batch_select_indices(torch.tensor([0, 0]))
    with pytest.raises(TypeError, match="dtype"):
        KVCache(model.config, 8, batch_size=1, dtype=torch.float64)
    with pytest.raises(ValueError, match="batch_size and dtype"):
        from_model(model, n_ctx=8).state_read(b"")
    cfg = transformers.LlamaConfig(num_hidden_layers=2, layer_types=["full_attention", "chunked_attention"])
    with pytest.raises(ValueError, match="chunked layers but no attention_chunk_size"):
        KVCache(cfg, 8)
    cfg = transformers.LlamaConfig(num_hidden_layers=2, layer_types=["full_attention", "linear_attention"])
    with pytest.raises(ValueError, match="only full and sliding"):
        KVCache(cfg, 8)
    cfg = transformers.LlamaConfig(num_hidden_layers=2, layer_types=["sliding_attention", "chunked_attention"],
                                   sliding_window=4, attention_chunk_size=4)
    with pytest.raises(ValueError, match="both sliding and chunked"):
        KVCache(cfg, 8)


def test_a_state_saved_by_a_server_in_another_layout_is_gathered():
    """K/V of a DynamicCache prefill stored by hand into a UnifiedCache row after row (not in
    the layout the transformers Cache gives a fresh cache), saved, restored into it: the keys
    come back gathered, and generate continues as DynamicCache does."""
    import kvcache

    model = _model("llama", "sdpa")
    ids, mask = _inputs((0, 3))
    ref = DynamicCache(config=model.config)
    seq, _ = _generate(model, ids, mask, ref, n_new=4)
    n = ref.get_seq_length()
    server = kvcache.UnifiedCache(kv_size=96, n_layer=2, n_embd_k_gqa=16, n_embd_v_gqa=16, type_k="f32",
                                  type_v="f32", v_trans=False, n_seq_max=2)
    for b in range(2):
        assert server.find_slot(kvcache.UBatch(list(range(n)), [b] * n))
        for il in range(2):
            k, v = ref.layers[il].keys[b], ref.layers[il].values[b]       # [heads, n, head_dim]
            server.store(il, k.transpose(0, 1).reshape(n, -1).contiguous(), v.transpose(0, 1).reshape(n, -1).contiguous())
        server.commit()
    restored = from_model(model, n_ctx=48)
    restored.state_read(server.state_write(), batch_size=2, dtype=torch.float32)
    assert restored.get_seq_length() == n
    assert restored.kv.seq_cells(1)[0].tolist() == list(range(n, 2 * n))
    mask2 = torch.cat([mask, torch.ones(2, seq.shape[1] - ids.shape[1], dtype=mask.dtype)], 1)
    want = _generate(model, seq, mask2, ref)
    _same(_generate(model, seq, mask2, restored), want)


def test_the_bench_case_runs_and_checks_the_tokens():
    """`kvcache bench torch` in its quick size: rows for generate after a short and a long prompt
    (kvcache's Cache and the views-only floor) and the per-step calls (its own check: the tokens of both are
    DynamicCache's, or it raises)."""
    bench = need_module("bench", "kvcache_bench")

    rows = bench.CASES["torch"](True, 1)
    assert len(rows) == 6 and all(r.kvcache_ns and r.kvcache_ns > 0 for r in rows)
    for short_or_long in (rows[:2], rows[2:4]):
        assert short_or_long[0].baseline_ns and all(r.yardstick == "DynamicCache" for r in short_or_long)
        assert "views-only" in short_or_long[1].case and short_or_long[1].ratio
    assert ["20 + 32" in rows[0].case, "2000 + 32" in rows[2].case] == [True, True]
    assert ["4096" in rows[4].case, "32768" in rows[5].case] == [True, True]


def _kv(rows, q, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, 2, q, 8, generator=g).to(dtype), torch.randn(rows, 2, q, 8, generator=g).to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("grad", [True, False], ids=["autograd", "no_grad"])
def test_update_keeps_the_rows_and_the_state_holds_them(dtype, grad, cat_max):
    """update by hand, as a model's layers call it: the keys returned are every row's keys so
    far: while the rows are short (autograd off) concatenations, else views of the cache's
    tensors while the cells lie as a fresh cache places them (cell = index * rows + row);
    kvcache keeps the cells (metadata mode), and the state holds the K/V as kvcache rows:
    restored into a plain kvcache cache, its k()/v() are the rows. Byte for byte the same state
    whether the rows were concatenated or written into the tensor."""
    import kvcache

    cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2)
    cache = KVCache(cfg, 16, batch_size=3, dtype=dtype)
    assert cache.kv.buffers == "none"
    seen = {0: [], 1: []}
    for step, q in enumerate([4, 1, 1, 2]):
        for il in range(2):
            k, v = _kv(3, q, 10 * step + il, dtype)
            seen[il].append((k, v))
            with torch.set_grad_enabled(grad):
                got_k, got_v = cache.update(k, v, il)
            assert torch.equal(got_k, torch.cat([s[0] for s in seen[il]], 2))
            assert torch.equal(got_v, torch.cat([s[1] for s in seen[il]], 2))
            views = grad or sum(s[0].shape[2] for s in seen[il]) > cat_max
            assert (got_k._base is not None and got_v._base is not None) == views    # views, no gather
    n = cache.get_seq_length()
    assert n == 8 and all(cache.kv.seq_cells(b)[0].tolist() == [j * 3 + b for j in range(n)] for b in range(3))
    name = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}[dtype]
    plain = kvcache.UnifiedCache(kv_size=cache.kv.size, n_layer=2, n_embd_k_gqa=16, n_embd_v_gqa=16, type_k=name,
                                 type_v=name, v_trans=False, n_seq_max=3)
    plain.state_read(cache.state_write())
    for il in range(2):
        for i, get in enumerate((plain.k, plain.v)):
            want = torch.cat([s[i] for s in seen[il]], 2)                  # [rows, heads, n, dim]
            rows = np.asarray(get(il))
            rows = torch.from_numpy(rows.view(np.uint16)).view(dtype) if dtype == torch.bfloat16 else torch.from_numpy(rows)
            assert torch.equal(rows[:n * 3].view(n, 3, 2, 8).permute(1, 2, 0, 3), want)
    views = KVCache(cfg, 16, batch_size=3, dtype=dtype)
    for step, q in enumerate([4, 1, 1, 2]):
        for il in range(2):
            with torch.enable_grad():
                views.update(*seen[il][step], il)
    assert views.state_write() == cache.state_write()


@pytest.mark.parametrize("grad", [True, False], ids=["autograd", "no_grad"])
def test_update_after_crop_continues_every_row(grad, cat_max):
    """crop(-1) forgets the last index of both rows; the next forwards write index 5 and 6 in
    its place: the keys returned are every row's, in index order, the cells those of a fresh
    cache (cell = index * rows + row)."""
    cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2)
    cache = KVCache(cfg, 16, batch_size=2, dtype=torch.float32)
    seen: dict[int, list] = {0: [], 1: []}
    for step, q in enumerate([3, 1, 1]):
        for il in range(2):
            k, v = _kv(2, q, 10 * step + il)
            seen[il].append((k, v))
            with torch.set_grad_enabled(grad):
                cache.update(k, v, il)
    cache.crop(-1)
    for il in range(2):
        last_k, last_v = seen[il].pop()
        seen[il].append((last_k[:, :, :0], last_v[:, :, :0]))
    for step in (3, 4):
        for il in range(2):
            k, v = _kv(2, 1, 10 * step + il)
            seen[il].append((k, v))
            with torch.set_grad_enabled(grad):
                got_k, got_v = cache.update(k, v, il)
            assert torch.equal(got_k, torch.cat([s[0] for s in seen[il]], 2))
            assert torch.equal(got_v, torch.cat([s[1] for s in seen[il]], 2))
    assert cache.get_seq_length() == 6
    assert [cache.kv.seq_cells(b)[0].tolist() for b in range(2)] == [list(range(b, 12, 2)) for b in range(2)]


def test_update_in_another_layer_order_and_bad_kv():
    """Layers in any order make one forward (a layer seen twice starts the next); K/V the cache
    cannot take raise and change nothing, on the first layer of a forward and on a later one."""
    cfg = transformers.LlamaConfig(num_hidden_layers=3, hidden_size=32, num_attention_heads=4, num_key_value_heads=2)
    cache = KVCache(cfg, 8, batch_size=1, dtype=torch.float32)
    k, v = _kv(1, 2, 0)
    for il in (2, 0, 1):
        cache.update(k, v, il)
    assert cache.get_seq_length() == 2 and cache.kv.seq_pos_max(0) == 1
    k1, v1 = _kv(1, 1, 1)
    got, _ = cache.update(k1, v1, 1)
    assert torch.equal(got, torch.cat([k, k1], 2)) and cache.get_seq_length() == 3
    bad = [((k1.double(), v1.double()), TypeError, "dtype"), ((k1, v1.half()), TypeError, "dtype"),
           ((k1[:, :1], v1[:, :1]), ValueError, "kv heads"), ((k1, _kv(1, 2, 2)[1]), ValueError, "both alike"),
           ((k1.expand(2, -1, -1, -1), v1.expand(2, -1, -1, -1)), ValueError, "batch of 2 rows"),
           ((k1.numpy(), v1.numpy()), TypeError, "torch tensors")]
    for (bk, bv), err, msg in bad:
        with pytest.raises(err, match=msg):
            cache.update(bk, bv, 0)                       # later layer of the forward under way
        with pytest.raises(IndexError):
            cache.update(k1, v1, 3)
        assert cache.get_seq_length() == 3 and cache.kv.seq_pos_max(0) == 2
    for il in (0, 2):
        cache.update(k1, v1, il)
    assert cache.kv.seq_pos_max(0) == 2
    with pytest.raises(ValueError, match="layer 1 brings 1 indices, the forward 2"):
        cache.update(k, v, 0)                             # the next forward's first layer: fine ...
        cache.update(k1, v1, 1)                           # ... another count in the same forward: not
    for bk, bv in ((k1.double(), v1.double()), (k1[:, :1], v1[:, :1])):
        with pytest.raises((TypeError, ValueError)):
            cache.update(bk, bv, 2)


def test_decode_steps_of_short_rows_check_and_place_like_any_other():
    """Autograd off, the layers in order, rows short: update's hot path (concatenation, the
    placement in kvcache made when the kvcache cache is next consulted). K/V it cannot take on
    a later layer raise and change nothing; another count in the same forward raises; the
    kvcache cache, consulted at any point, holds every index placed as a fresh cache places
    it; the state equals that of the same updates with autograd on (views of the tensor)."""
    cfg = transformers.LlamaConfig(num_hidden_layers=3, hidden_size=32, num_attention_heads=4, num_key_value_heads=2)
    caches = [KVCache(cfg, 12, batch_size=2, dtype=torch.float32) for _ in range(2)]
    for grad, cache in zip((False, True), caches):
        seen: dict[int, list] = {il: [] for il in range(3)}
        with torch.set_grad_enabled(grad):
            for il in range(3):
                k, v = _kv(2, 3, il)
                seen[il].append((k, v))
                cache.update(k, v, il)
            for step in range(1, 6):
                for il in range(3):
                    k, v = _kv(2, 1, 10 * step + il)
                    seen[il].append((k, v))
                    if il == 1 and not grad:
                        with pytest.raises(TypeError, match="dtype"):
                            cache.update(k.double(), v.double(), il)
                        with pytest.raises(ValueError, match="layer 1 brings 2 indices, the forward 1"):
                            cache.update(*_kv(2, 2, 0), il)
                    got_k, got_v = cache.update(k, v, il)
                    assert torch.equal(got_k, torch.cat([s[0] for s in seen[il]], 2))
                    assert torch.equal(got_v, torch.cat([s[1] for s in seen[il]], 2))
                    if il == step % 3:          # consulted mid-forward, at each layer in turn
                        assert cache.kv.seq_pos_max(0) == cache.kv.seq_pos_max(1) == 2 + step
                        assert [cache.kv.seq_cells(b)[0].tolist() for b in range(2)] == \
                            [list(range(b, 2 * (3 + step), 2)) for b in range(2)]
    assert caches[0].get_seq_length() == caches[1].get_seq_length() == 8
    assert caches[0].state_write() == caches[1].state_write()


MODES = {"grad": torch.enable_grad, "no_grad": torch.no_grad, "inference": torch.inference_mode}


def _forwards(model, cache, ids, modes):
    """One forward per mode (the prompt, then one token a forward), the logits of each, and
    the gradients of every parameter of the sum of the logits of the forwards made with
    autograd on (None when none was)."""
    model.zero_grad(set_to_none=True)
    logits, loss, at = [], None, 0
    for i, mode in enumerate(modes):
        step = ids[:, at:at + (ids.shape[1] - len(modes) + 1 if i == 0 else 1)]
        at += step.shape[1]
        with warnings.catch_warnings(), MODES[mode]():
            warnings.simplefilter("ignore", FutureWarning)
            out = model(step, past_key_values=cache, use_cache=True).logits
        logits.append(out.detach().clone())
        if mode == "grad":
            loss = out.sum() if loss is None else loss + out.sum()
    if loss is None:
        return logits, None
    loss.backward()
    return logits, [p.grad.clone() if p.grad is not None else None for p in model.parameters()]


@pytest.mark.parametrize("kind,attn", [("llama", "sdpa"), ("gemma2", "eager")])
@pytest.mark.parametrize("first", list(MODES))
@pytest.mark.parametrize("second", list(MODES))
def test_forwards_in_any_autograd_mode(kind, attn, first, second):
    """A forward without no_grad (as a plain ``model(ids, ...)`` runs), under no_grad or under
    inference_mode, and the next in any mode: the logits of DynamicCache, and with autograd on
    the gradients of DynamicCache (through the keys of earlier forwards made with autograd)."""
    model = _model(kind, attn)
    ids = torch.randint(1, 128, (2, 9), generator=torch.Generator().manual_seed(5))
    want = _forwards(model, DynamicCache(config=model.config), ids, [first, second])
    got = _forwards(model, from_model(model, n_ctx=12), ids, [first, second])
    for a, b in zip(got[0], want[0]):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    assert (got[1] is None) == (want[1] is None) == (second != "grad" and first != "grad")
    for a, b in zip(got[1] or [], want[1] or []):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kind,attn", [("llama", "eager"), ("gemma2", "eager")])
def test_autograd_history_ends_where_a_forward_without_it_writes(kind, attn):
    """Forwards with autograd, without, and with it again, past the sliding window (cells
    reused): the gradients are DynamicCache's, which keep no history through a forward made
    without autograd; a restore drops the history too."""
    model = _model(kind, attn)
    ids = torch.randint(1, 128, (2, 16), generator=torch.Generator().manual_seed(6))
    modes = ["grad", "grad", "no_grad", "inference", "no_grad", "grad", "no_grad", "grad", "grad"]
    want = _forwards(model, DynamicCache(config=model.config), ids, modes)
    got = _forwards(model, from_model(model, n_ctx=16), ids, modes)
    for a, b in zip(got[0], want[0]):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    for a, b in zip(got[1], want[1]):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    # a state saved without autograd, restored into a cache whose rows have history: the next
    # forward's gradients are those of a DynamicCache filled without autograd
    saved = from_model(model, n_ctx=16)
    _forwards(model, saved, ids[:, :8], ["no_grad"])
    cache = from_model(model, n_ctx=16)
    _forwards(model, cache, ids[:, :8], ["grad"])
    cache.state_read(saved.state_write())
    want = _forwards(model, DynamicCache(config=model.config), ids[:, :9], ["no_grad", "grad"])
    model.zero_grad(set_to_none=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        out = model(ids[:, 8:9], past_key_values=cache, use_cache=True).logits
    out.sum().backward()
    torch.testing.assert_close(out.detach(), want[0][1], rtol=0, atol=1e-5)
    for p, b in zip(model.parameters(), want[1]):
        assert (p.grad is None) == (b is None)
        if b is not None:
            torch.testing.assert_close(p.grad, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kind,attn", [("llama", "eager"), ("gemma2", "eager")])
def test_reorder_with_autograd(kind, attn):
    """reorder_cache between two forwards with autograd on: logits and gradients of
    DynamicCache (the rows' history moves with them)."""
    model = _model(kind, attn)
    ids = torch.randint(1, 128, (2, 9), generator=torch.Generator().manual_seed(7))
    res = []
    for cache in (DynamicCache(config=model.config), from_model(model, n_ctx=12)):
        model.zero_grad(set_to_none=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            out1 = model(ids[:, :8], past_key_values=cache, use_cache=True).logits
            cache.reorder_cache(torch.tensor([1, 0]))
            out2 = model(ids[:, 8:], past_key_values=cache, use_cache=True).logits
        (out1.sum() + out2.sum()).backward()
        res.append((out2.detach(), [p.grad for p in model.parameters()]))
    torch.testing.assert_close(res[1][0], res[0][0], rtol=0, atol=1e-5)
    for a, b in zip(res[1][1], res[0][1]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kind", ["llama", "gemma2"])
def test_a_prompt_cache_reused_through_deepcopy(kind):
    """transformers' way to reuse a prompt's cache: fill it once, then generate each
    continuation from a copy.deepcopy of it. Tokens and logits of the same with DynamicCache;
    the prompt's cache is left as it was; pickle gives the same copy; copy.copy is refused."""
    import copy
    import pickle

    model = _model(kind)
    ids, mask = _inputs((0, 2), length=10)
    caches = {}
    for name, make in (("dyn", lambda: DynamicCache(config=model.config)), ("ours", lambda: from_model(model, n_ctx=24))):
        prompt = make()
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            model(ids[:, :6], attention_mask=mask[:, :6], past_key_values=prompt, use_cache=True)
        caches[name] = prompt
    before = caches["ours"].state_write()
    for tail in (ids[:, 6:8], ids[:, 6:10]):
        full = torch.cat([ids[:, :6], tail], 1)
        fmask = mask[:, :full.shape[1]]
        want = _generate(model, full, fmask, copy.deepcopy(caches["dyn"]), n_new=5)
        _same(_generate(model, full, fmask, copy.deepcopy(caches["ours"]), n_new=5), want)
        _same(_generate(model, full, fmask, pickle.loads(pickle.dumps(caches["ours"])), n_new=5), want)
    assert caches["ours"].get_seq_length() == 6 and caches["ours"].state_write() == before
    empty = copy.deepcopy(from_model(model, n_ctx=24))
    assert empty.kv is None and empty.get_seq_length() == 0
    with pytest.raises(TypeError, match="deepcopy"):
        copy.copy(caches["ours"])


@pytest.mark.parametrize("kind", ["llama", "gemma2"])
@pytest.mark.usefixtures("cat_max")
def test_the_layers_keys_and_values_are_dynamic_caches(kind):
    """cache.layers[i].keys / .values and iterating the cache give what a DynamicCache's do
    after the same forwards (a sliding layer: the last window - 1 indices), with autograd on
    or off and after a restore; None before the first update."""
    model = _model(kind)
    ids, mask = _inputs((0, 3), length=12)
    dyn, ours = DynamicCache(config=model.config), from_model(model, n_ctx=20)
    assert ours.layers[0].keys is None and [kv[0] for kv in ours] == [None] * len(ours.layers)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        for cache in (dyn, ours):
            model(ids[:, :9], attention_mask=mask[:, :9], past_key_values=cache)
            for j in range(9, 12):
                model(ids[:, j:j + 1], attention_mask=mask[:, :j + 1], past_key_values=cache)
    restored = from_model(model, n_ctx=20)
    restored.state_read(ours.state_write(), batch_size=2, dtype=torch.float32)
    for cache in (ours, restored):
        for grad in (False, True):
            with torch.set_grad_enabled(grad):
                got = list(cache)
                for il, (k, v, _) in enumerate(dyn):
                    assert torch.equal(got[il][0], k) and torch.equal(got[il][1], v)
                    assert torch.equal(cache.layers[il].keys, k) and torch.equal(cache.layers[il].values, v)


@pytest.mark.parametrize("kind", ["llama", "gemma2"])
@pytest.mark.parametrize("how", ["prompt_lookup", "assistant"])
@pytest.mark.usefixtures("cat_max")
def test_assisted_decoding(kind, how):
    """Assisted decoding (prompt lookup, an assistant model): the candidates' forwards and the
    crops that undo the rejected ones (crop(0), crop(-k), a sliding layer's past recorded until
    the crop) give DynamicCache's tokens and logits."""
    model = _model(kind)
    ids = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6]])
    kw = dict(prompt_lookup_num_tokens=3) if how == "prompt_lookup" else dict(assistant_model=_model(kind))
    mask = torch.ones_like(ids)
    want = _generate(model, ids, mask, DynamicCache(config=model.config), n_new=16, **kw)
    _same(_generate(model, ids, mask, from_model(model, n_ctx=40), n_new=16, **kw), want)


def test_past_recording_takes_the_recurrent_states_to_keep():
    """transformers 5.25 passes recurrent_states_to_keep when it starts recording (assisted
    decoding): the layers take it (they hold no recurrent state), only the sliding ones record,
    and the cache asks for no recurrent states."""
    cache = from_model(_model("gemma2"), n_ctx=16)
    for layer in cache.layers:
        layer.activate_past_recording(recurrent_states_to_keep=3)
    assert [layer.record_past for layer in cache.layers] == cache.is_sliding and any(cache.is_sliding)
    if hasattr(cache, "get_recurrent_states_to_keep"):     # transformers >= 5.25
        cache.activate_past_recording(recurrent_states_to_keep=3)
        assert cache.get_recurrent_states_to_keep() == 0


def _forward(model, cache, ids):
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return model(ids, past_key_values=cache, use_cache=True).logits


@pytest.mark.usefixtures("cat_max")
def test_crop_semantics_of_transformers_5():
    """crop(0) removes nothing, crop(-k) the last k indices; with sliding layers (window 6), a
    crop past what the window still holds raises and changes nothing unless the past was
    recorded (activate_past_recording), and then the next forward sees DynamicCache's keys."""
    model = _model("llama")
    ids = torch.randint(1, 128, (1, 12), generator=torch.Generator().manual_seed(8))
    cache = from_model(model, n_ctx=16)
    _forward(model, cache, ids[:, :10])
    cache.crop(0)
    assert cache.get_seq_length() == 10 and cache.kv.seq_pos_max(0) == 9
    cache.crop(-3)
    assert cache.get_seq_length() == 7 and cache.kv.seq_pos_max(0) == 6

    model = _model("gemma2")
    ours, dyn = from_model(model, n_ctx=16), DynamicCache(config=model.config)
    for cache in (ours, dyn):
        _forward(model, cache, ids[:, :8])
        _forward(model, cache, ids[:, 8:10])
    before = ours.state_write()
    with pytest.raises(RuntimeError, match="activate_past_recording"):
        ours.crop(-2)
    with pytest.raises(RuntimeError, match="activate_past_recording"):
        dyn.crop(-2)
    assert ours.state_write() == before and ours.get_seq_length() == 10
    for cache in (ours, dyn):
        cache.activate_past_recording()
        assert cache.is_recording_past(0) and not cache.is_recording_past(1)
        _forward(model, cache, ids[:, 10:12])
        cache.crop(-2)
        assert cache.get_seq_length() == 10
    window = ours.kv.cache_of(0)
    assert window.seq_pos_min(0) == 10 - 6 + 1 and window.seq_pos_max(0) == 9      # back to the window
    torch.testing.assert_close(_forward(model, ours, ids[:, 10:11]), _forward(model, dyn, ids[:, 10:11]),
                               rtol=0, atol=1e-5)


def test_bad_crop_and_reorder_arguments_change_nothing():
    """crop takes an int (or what stands for one: a numpy int, a 0-d tensor); reorder_cache
    integer row indices in range, one per row. Anything else raises and changes nothing."""
    model = _model("llama")
    ids, mask = _inputs((0, 3), length=10)
    cache = from_model(model, n_ctx=30)
    _generate(model, ids, mask, cache, n_new=2)
    before, n = cache.state_write(), cache.get_seq_length()
    for bad in (1.5, -1.5, "x", None, [1]):
        with pytest.raises(TypeError):
            cache.crop(bad)
    for bad, err in ((torch.tensor([0.0, 1.0]), TypeError), (torch.tensor([True, False]), TypeError),
                     (torch.tensor([5, 0]), IndexError), (torch.tensor([-1, 0]), IndexError),
                     (torch.tensor([0]), ValueError), ([0, 1, 1], ValueError)):
        with pytest.raises(err):
            cache.reorder_cache(bad)
    assert cache.state_write() == before and cache.get_seq_length() == n
    cache.crop(np.int64(-1))
    cache.crop(torch.tensor(-1))
    assert cache.get_seq_length() == n - 2
    cache.reorder_cache(torch.tensor([[1, 1]]))                   # beams may repeat a row
    k = cache.layers[0].keys
    assert torch.equal(k[0], k[1])


def test_a_state_the_cache_cannot_take_changes_nothing():
    """state_read of a state the cache cannot take (more indices per row than n_ctx, another
    dtype, batch size or model, damaged bytes) raises and leaves the cache as it was: not
    created when it was not, holding its rows when it held some."""
    from kvcache import StateError

    model, other = _model("llama"), _model("gemma2")
    ids, mask = _inputs((0, 3), length=10)
    source = from_model(model, n_ctx=30)
    _generate(model, ids, mask, source, n_new=2)
    blob = source.state_write()                                   # 11 indices per row
    bad = [(from_model(model, n_ctx=8), dict(batch_size=2, dtype=torch.float32), ValueError, "n_ctx"),
           (from_model(model, n_ctx=30), dict(batch_size=2, dtype=torch.float16), StateError, "type"),
           (from_model(model, n_ctx=60), dict(batch_size=1, dtype=torch.float32), StateError, "sequence"),
           (from_model(other, n_ctx=30), dict(batch_size=2, dtype=torch.float32), StateError, None)]
    for cache, kw, err, msg in bad:
        with pytest.raises(err, match=msg):
            cache.state_read(blob, **kw)
        assert cache.kv is None and cache.get_seq_length() == 0
    small = from_model(model, n_ctx=8)
    seq, _ = _generate(model, ids[:, :4], mask[:, :4], small, n_new=2)
    held = small.state_write()
    for data, err in ((blob, ValueError), (blob[:100] + bytes(50), StateError)):
        with pytest.raises(err):
            small.state_read(data)
        assert small.state_write() == held and small.get_seq_length() == 5
    # the rows it held go on as from a cache restored from them
    restored = from_model(model, n_ctx=8)
    restored.state_read(held, batch_size=2, dtype=torch.float32)
    mask2 = torch.cat([mask[:, :4], torch.ones(2, 2, dtype=mask.dtype)], 1)
    _same(_generate(model, seq, mask2, small, n_new=2), _generate(model, seq, mask2, restored, n_new=2))


def _forward_hooked(model, cache, ids, hook):
    """Logits of a prompt forward (all but the last 3 tokens), then of one-token forwards,
    with hook(cache) called inside the first of those, after decoder layer 0 (between two
    layers' update calls), its result kept."""
    got, logits = [], []
    n0 = ids.shape[1] - 3
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        model(ids[:, :n0], past_key_values=cache)
        for j in range(n0, ids.shape[1]):
            h = model.model.layers[0].register_forward_hook(lambda *a: got.append(hook(cache))) if j == n0 else None
            try:
                logits.append(model(ids[:, j:j + 1], past_key_values=cache).logits.detach())
            finally:
                if h is not None:
                    h.remove()
    return logits, got[0]


@pytest.mark.parametrize("kind", ["llama", "gemma2"])
@pytest.mark.parametrize("grad", [True, False], ids=["autograd", "no_grad"])
@pytest.mark.usefixtures("cat_max")
def test_a_snapshot_between_two_layers_leaves_the_forward_alone(kind, grad):
    """state_write and copy.deepcopy from a forward hook of layer 0 (the forward's later layers
    not yet written) read only: the forward and the next ones give DynamicCache's logits, and
    the snapshot holds the forwards before it: a copy made then continues as the cache itself
    did. crop and reorder_cache then raise RuntimeError and change nothing; a crop that changes
    nothing does nothing."""
    import copy

    model = _model(kind)
    ids = torch.randint(1, 128, (2, 11), generator=torch.Generator().manual_seed(7))
    with torch.set_grad_enabled(grad):
        want, _ = _forward_hooked(model, DynamicCache(config=model.config), ids, lambda c: None)

        def refused(cache):
            before, n = cache.state_write(), cache.get_seq_length()
            cache.crop(0)
            with pytest.raises(RuntimeError, match="crop during a forward"):
                cache.crop(-1)
            with pytest.raises(RuntimeError, match="reorder_cache during a forward"):
                cache.reorder_cache(torch.tensor([1, 0]))
            with pytest.raises(RuntimeError, match="batch_select_indices during a forward"):
                cache.batch_select_indices(torch.tensor([1, 0]))
            assert cache.state_write() == before and cache.get_seq_length() == n
            return before

        for snapshot in (lambda c: c.state_write(), copy.deepcopy, refused):
            cache = from_model(model, n_ctx=16)
            got, snap = _forward_hooked(model, cache, ids, snapshot)
            for a, b in zip(got, want):
                torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
            assert cache.get_seq_length() == 11
            if isinstance(snap, bytes):
                snap_cache = from_model(model, n_ctx=16)
                snap_cache.state_read(snap, batch_size=2, dtype=torch.float32)
                snap = snap_cache
            assert snap.get_seq_length() == 8                  # the prompt: the forward under way is not in it
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                for j in range(8, 11):
                    out = model(ids[:, j:j + 1], past_key_values=snap).logits.detach()
                    torch.testing.assert_close(out, want[j - 8], rtol=0, atol=1e-5)


def test_a_snapshot_between_two_layers_of_short_rows():
    """By hand, the hot path of short rows (autograd off, layers in order): a state saved after
    layer 0 of a decode step is the state before that step, byte for byte; the step's layer 1
    then gets every index of its own (none of them zeros) and the length stays right."""
    cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2)
    cache = KVCache(cfg, 16, batch_size=2, dtype=torch.float32)
    with torch.no_grad():
        prompt = [_kv(2, 3, il) for il in range(2)]
        for il in range(2):
            cache.update(*prompt[il], il)
        before = cache.state_write()
        step = [_kv(2, 1, 10 + il) for il in range(2)]
        cache.update(*step[0], 0)
        assert cache.state_write() == before
        k1, v1 = cache.update(*step[1], 1)
    assert torch.equal(k1, torch.cat([prompt[1][0], step[1][0]], 2))
    assert torch.equal(v1, torch.cat([prompt[1][1], step[1][1]], 2))
    assert cache.get_seq_length() == 4


class _Refusing(torch.Tensor):
    """K/V whose writes fail part way through update (after the checks of shape and dtype)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in (torch.cat, torch.Tensor.copy_, torch.Tensor.permute):
            raise RuntimeError("refused")
        return super().__torch_function__(func, types, args, kwargs or {})


@pytest.mark.parametrize("kind", ["llama", "gemma2"])
@pytest.mark.parametrize("grad", [True, False], ids=["autograd", "no_grad"])
@pytest.mark.usefixtures("cat_max")
def test_a_failed_update_changes_nothing(kind, grad):
    """update with a layer index that is no int of a layer (1.0, -1, 4, "0") or K/V its writes
    refuse, on a forward's first layer and a later one: TypeError / IndexError / the write's
    error, and the cache as it was (length, state); the next forwards return exactly the keys
    written. A first update that fails leaves the cache not created. A numpy int is an index."""
    cfg = _model(kind).config
    n_layers = cfg.num_hidden_layers
    cache = KVCache(cfg, 16)
    k, v = _kv(2, 3, 0)
    with torch.set_grad_enabled(grad):
        for bad, err in ((1.0, TypeError), (0.0, TypeError), ("0", TypeError), (-1, IndexError),
                         (n_layers, IndexError)):
            with pytest.raises(err):
                cache.update(k, v, bad)
        with pytest.raises(RuntimeError, match="refused"):
            cache.update(k.as_subclass(_Refusing), v.as_subclass(_Refusing), 0)
        assert cache.kv is None and cache.get_seq_length() == 0
        seen = {il: [] for il in range(n_layers)}
        for step, q in enumerate([3] + [1] * 6):
            n0 = cache.get_seq_length()
            for il in range(n_layers):
                k, v = _kv(2, q, 10 * step + il)
                n, state = cache.get_seq_length(), cache.state_write() if step else None
                bad_ones = [(1.0 * il, TypeError), (-1, IndexError), (n_layers, IndexError)]
                if step:
                    bad_ones.append(((k.as_subclass(_Refusing), v.as_subclass(_Refusing)), RuntimeError))
                for bad, err in bad_ones:
                    with pytest.raises(err):
                        if isinstance(bad, tuple):
                            cache.update(*bad, il)
                        else:
                            cache.update(k, v, bad)
                    assert cache.get_seq_length() == n
                    if state is not None:
                        assert cache.state_write() == state
                seen[il].append((k, v))
                got_k, got_v = cache.update(k, v, np.int64(il))
                lo = max(n0 - cfg.sliding_window + 1, 0) if cache.is_sliding[il] else 0     # the window's keys
                assert torch.equal(got_k, torch.cat([s[0] for s in seen[il]], 2)[:, :, lo:])
                assert torch.equal(got_v, torch.cat([s[1] for s in seen[il]], 2)[:, :, lo:])
        assert cache.get_seq_length() == 9


def test_a_state_with_holes_in_its_rows_is_refused():
    """state_read of rows holding indices 0, 1, 3 (a server's, say): ValueError naming the
    hole, the cache as it was (not created, or holding its rows); it would otherwise fail every
    update after it."""
    import kvcache

    cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2)
    server = kvcache.UnifiedCache(kv_size=32, n_layer=2, n_embd_k_gqa=16, n_embd_v_gqa=16, type_k="f32",
                                  type_v="f32", v_trans=False, n_seq_max=2)
    for b in range(2):
        assert server.find_slot(kvcache.UBatch([0, 1, 3], [b] * 3))
        for il in range(2):
            server.store(il, np.ones((3, 16), np.float32), np.ones((3, 16), np.float32))
        server.commit()
    holes = server.state_write()
    fresh = KVCache(cfg, 16)
    with pytest.raises(ValueError, match="holes"):
        fresh.state_read(holes, batch_size=2, dtype=torch.float32)
    assert fresh.kv is None and fresh.get_seq_length() == 0
    held = KVCache(cfg, 16, batch_size=2, dtype=torch.float32)
    for grad in (False, True):
        with torch.set_grad_enabled(grad):
            for il in range(2):
                held.update(*_kv(2, 2, il), il)
            state, n = held.state_write(), held.get_seq_length()
            with pytest.raises(ValueError, match="holes"):
                held.state_read(holes)
            assert held.state_write() == state and held.get_seq_length() == n
    held.update(*_kv(2, 1, 5), 0)
    with pytest.raises(ValueError, match="holes"):
        held.state_read(holes)                          # between two layers: that forward goes on
    k1, _ = held.update(*_kv(2, 1, 6), 1)
    assert k1.shape[2] == 5 and held.get_seq_length() == 5
    # a sliding-window part without index 6 of the 9 of each row: the next forward attends to 4 .. 8
    gcfg = transformers.Gemma2Config(num_hidden_layers=4, head_dim=8, sliding_window=6, hidden_size=32,
                                     num_attention_heads=4, num_key_value_heads=2)
    source = KVCache(gcfg, 16, batch_size=2, dtype=torch.float32)
    with torch.no_grad():
        for il in range(4):
            source.update(*_kv(2, 9, il), il)
    for b in range(2):
        source.kv.swa.seq_rm(b, 6, 7)
    fresh = KVCache(gcfg, 16)
    with pytest.raises(ValueError, match="sliding-window layers hold indices"):
        fresh.state_read(source.state_write(), batch_size=2, dtype=torch.float32)
    assert fresh.kv is None


@pytest.mark.parametrize("kw,err,name", [
    (dict(n_ctx=16.9), TypeError, "n_ctx"), (dict(n_ctx="16"), TypeError, "n_ctx"),
    (dict(n_ctx=2**31), ValueError, "n_ctx"), (dict(n_pad=2.5), TypeError, "n_pad"), (dict(n_pad=0), ValueError, "n_pad"),
    (dict(n_pad=-1), ValueError, "n_pad"), (dict(n_batch=1.5), TypeError, "n_batch"),
    (dict(n_batch=0), ValueError, "n_batch"), (dict(n_batch=True), TypeError, "n_batch"),
    (dict(batch_size=2.7, dtype=torch.float32), TypeError, "batch_size"),
])
def test_bad_sizes_are_refused_by_the_constructor(kw, err, name):
    """The constructor's sizes are ints in range, checked when the cache is made (not
    truncated, nor refused at the first update); state_read's batch_size likewise."""
    cfg = transformers.Gemma2Config(num_hidden_layers=4, head_dim=8, sliding_window=6, hidden_size=32,
                                    num_attention_heads=4, num_key_value_heads=2)
    kw = dict(kw)
    n_ctx = kw.pop("n_ctx", 16)
    with pytest.raises(err, match=name):
        KVCache(cfg, n_ctx, **kw)
    if name == "batch_size":
        cache = KVCache(cfg, 16)
        with pytest.raises(err, match=name):
            cache.state_read(b"", batch_size=kw["batch_size"], dtype=torch.float32)
        assert cache.kv is None
