"""Geometry and RoPE from transformers configs: the cache kvcache builds for a config, and the
RoPE K-shift of ``rope_from_transformers`` against the model's own rotary embedding — a key
the model rotated at position p, shifted by kvcache by d, equals the key the model rotates at
p + d — for every supported rope_type, partial rotary, and Gemma 3's per-layer-type RoPE."""
import math
from types import SimpleNamespace

import numpy as np
import pytest

from conftest import need, need_module

torch = need_module("torch", "torch")
transformers = need_module("transformers", "transformers")
if int(transformers.__version__.split(".")[0]) < 5:
    need("transformers", f"transformers 5.x is needed, {transformers.__version__} is installed")

import kvcache  # noqa: E402
from kvcache.geometry import from_transformers_config, hf_attention, read_transformers_config, \
    rope_from_transformers  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb  # noqa: E402

HEADS, HEAD_DIM, THETA, ORIG = 2, 32, 500000.0, 256


def _llama(**rope):
    return transformers.LlamaConfig(hidden_size=HEADS * HEAD_DIM, num_attention_heads=HEADS, num_key_value_heads=HEADS,
                                    num_hidden_layers=2, max_position_embeddings=4 * ORIG, **rope)


def _hf_keys(rotary, k, pos, **kw):
    """k [n, heads, head_dim] rotated by the model's embedding at positions pos [n]."""
    x = torch.zeros(1, 1, k.shape[-1])
    cos, sin = rotary(x, torch.tensor([pos]), **kw)            # [1, n, head_dim]
    kt = k.permute(1, 0, 2)[None]                               # [1, heads, n, head_dim]
    _, out = apply_rotary_pos_emb(kt, kt, cos, sin)
    return out[0].permute(1, 0, 2).contiguous()


def _check_shift(cfg, rotary, params, layer=None, atol=2e-4, **kw):
    g = torch.Generator().manual_seed(1)
    n = 6
    k = torch.randn(n, HEADS, HEAD_DIM, generator=g)
    p0 = [0, 3, 17, 100, ORIG - 2, 2 * ORIG]
    d = [5, -3, 40, 900, 3, -ORIG]
    before = _hf_keys(rotary, k, p0, **kw)
    after = _hf_keys(rotary, k, [a + b for a, b in zip(p0, d)], **kw)
    rows = before.reshape(n, -1).numpy().copy()
    kvcache.rope_shift(rows, "f32", HEADS, HEAD_DIM, np.array(d, np.int32), params, layer=layer)
    np.testing.assert_allclose(rows, after.reshape(n, -1).numpy(), rtol=0, atol=atol)


ROPES = {
    "default": {},
    "linear": dict(rope_parameters=dict(rope_type="linear", factor=4.0, rope_theta=THETA)),
    "yarn": dict(rope_parameters=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=ORIG,
                                      rope_theta=THETA)),
    "yarn-attn-beta": dict(rope_parameters=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=ORIG,
                                                attention_factor=1.3, beta_fast=16, beta_slow=2, rope_theta=THETA)),
    "llama3": dict(rope_parameters=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                        original_max_position_embeddings=ORIG, rope_theta=THETA)),
    "longrope-short": dict(rope_parameters=dict(rope_type="longrope", short_factor=list(np.linspace(1, 2, HEAD_DIM // 2)),
                                                long_factor=list(np.linspace(1, 8, HEAD_DIM // 2)),
                                                original_max_position_embeddings=ORIG, rope_theta=THETA)),
    # within max_position_embeddings (4 * ORIG here: every position the check rotates) the plain rotation
    "dynamic": dict(rope_parameters=dict(rope_type="dynamic", factor=2.0, rope_theta=THETA)),
}


@pytest.mark.parametrize("name", list(ROPES))
def test_kvcache_shifts_keys_as_the_model_rotates_them(name):
    cfg = _llama(**ROPES[name])
    rotary = LlamaRotaryEmbedding(cfg)
    params = rope_from_transformers(cfg)
    assert params.mode == 2 and params.n_rot == HEAD_DIM          # neox, explicitly
    if name.startswith("longrope"):
        # the short factors: what the model uses in forwards within the original context
        x = torch.zeros(1, 1, HEAD_DIM)
        p = [0, 3, 17, 100, 50, 60]
        d = [5, -3, 40, 100, 3, 1]
        k = torch.randn(6, HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(2))
        before, after = _hf_keys(rotary, k, p), _hf_keys(rotary, k, [a + b for a, b in zip(p, d)])
        rows = before.reshape(6, -1).numpy().copy()
        kvcache.rope_shift(rows, "f32", HEADS, HEAD_DIM, np.array(d, np.int32), params)
        np.testing.assert_allclose(rows, after.reshape(6, -1).numpy(), rtol=0, atol=2e-4)
        del x
        return
    _check_shift(cfg, rotary, params)


def test_the_normal_layout_would_be_wrong():
    """The check can fail: llama.cpp's default mode ("normal") on keys transformers' Llama made."""
    cfg = _llama()
    params = rope_from_transformers(cfg)
    normal = kvcache.RopeParams(params.n_rot, mode="normal", freq_base=params.freq_base)
    with pytest.raises(AssertionError):
        _check_shift(cfg, LlamaRotaryEmbedding(cfg), normal)


def test_longrope_long_factors_past_the_original_context():
    cfg = _llama(**ROPES["longrope-short"])
    short, long = rope_from_transformers(cfg), rope_from_transformers(cfg, n_ctx_seq=4 * ORIG)
    a = np.asarray(short.freq_factors)
    b = np.asarray(long.freq_factors)
    np.testing.assert_allclose(a, np.linspace(1, 2, HEAD_DIM // 2), rtol=1e-6)
    np.testing.assert_allclose(b, np.linspace(1, 8, HEAD_DIM // 2), rtol=1e-6)


def test_dynamic_past_the_model_context_and_unknown_architectures_raise():
    cfg = _llama(**ROPES["dynamic"])
    assert rope_from_transformers(cfg, n_ctx_seq=4 * ORIG) is not None
    with pytest.raises(ValueError, match="dynamic"):
        rope_from_transformers(cfg, n_ctx_seq=4 * ORIG + 1)
    with pytest.raises(ValueError, match="dynamic"):
        kvcache.from_transformers_config(cfg, n_ctx=8 * ORIG)
    # why: past its context the model's own rotation is no longer the plain one
    rotary = LlamaRotaryEmbedding(cfg)
    k = torch.randn(2, HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(3))
    plain = _hf_keys(LlamaRotaryEmbedding(_llama()), k, [5, 8 * ORIG])
    assert not torch.allclose(_hf_keys(rotary, k, [5, 8 * ORIG]), plain, atol=1e-3)
    cfg = _llama()
    cfg.model_type = "no-such-model"
    with pytest.raises(ValueError, match="RoPE layout"):
        rope_from_transformers(cfg)


def test_partial_rotary_in_the_model_own_embedding():
    """Phi-3 style partial rotary: only the first n_rot dimensions turn."""
    cfg = transformers.Phi3Config(hidden_size=HEADS * HEAD_DIM, num_attention_heads=HEADS, num_key_value_heads=HEADS,
                                  num_hidden_layers=2, max_position_embeddings=4 * ORIG, partial_rotary_factor=0.5,
                                  pad_token_id=0)
    params = rope_from_transformers(cfg)
    assert params.n_rot == HEAD_DIM // 2 and params.mode == 2
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding, apply_rotary_pos_emb as phi3_rope
    rotary = Phi3RotaryEmbedding(cfg)
    k = torch.randn(3, HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(4))

    def rot(pos):
        cos, sin = rotary(torch.zeros(1, 1, HEAD_DIM), torch.tensor([pos]))
        kt = k.permute(1, 0, 2)[None]
        return phi3_rope(kt, kt, cos, sin)[1][0].permute(1, 0, 2).reshape(3, -1).numpy()

    rows = rot([1, 10, 30]).copy()
    kvcache.rope_shift(rows, "f32", HEADS, HEAD_DIM, np.array([4, 7, -20], np.int32), params)
    np.testing.assert_allclose(rows, rot([5, 17, 10]), rtol=0, atol=2e-4)


def test_gemma3_per_layer_type_rope():
    cfg = transformers.Gemma3TextConfig(hidden_size=64, num_attention_heads=HEADS, num_key_value_heads=HEADS,
                                        head_dim=HEAD_DIM, num_hidden_layers=6, sliding_window=16,
                                        max_position_embeddings=4 * ORIG)
    params = rope_from_transformers(cfg)
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding
    rotary = Gemma3RotaryEmbedding(cfg)
    sliding = cfg.layer_types.index("sliding_attention")
    full = cfg.layer_types.index("full_attention")
    assert params.freq_base_for(sliding) == 10000.0 and params.freq_base_for(full) == 1000000.0
    _check_shift(cfg, rotary, params, layer=sliding, layer_type="sliding_attention")
    _check_shift(cfg, rotary, params, layer=full, layer_type="full_attention")


def test_geometry_and_cache_from_a_config():
    cfg = transformers.Gemma2Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                    num_hidden_layers=4, sliding_window=32, max_position_embeddings=512)
    geo = read_transformers_config(cfg)
    assert geo.arch == "gemma2" and geo.n_layer == 4 and geo.n_embd_k_gqa == (32,) * 4
    assert geo.swa_layers == (0, 2) and geo.n_swa == 32 and geo.swa_type == "standard"
    c = from_transformers_config(cfg, n_ctx=256, n_seq_max=2, type_k="f32", type_v="f32")
    assert isinstance(c, kvcache.ISWACache) and c.swa_layers == (0, 2) and c.n_swa == 32
    assert not c.base.v_trans and c.rope.mode == 2 and c.n_embd_head_k == (16,) * 4
    llama = from_transformers_config(_llama(), n_ctx=100)
    assert isinstance(llama, kvcache.UnifiedCache) and llama.size == 128 and llama.rope.n_rot == HEAD_DIM
    # the attention factor of yarn is the model's business, not the shift's
    yarn = rope_from_transformers(_llama(**ROPES["yarn"]))
    assert yarn.attn_factor == 1.0 and yarn.ext_factor == 0.0 and not math.isnan(float(np.sum(yarn.freq_factors)))


def _plain_config(**kw):
    d = dict(model_type="llama", num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=64,
             head_dim=16, max_position_embeddings=512, rope_theta=10000.0)
    d.update(kw)
    return SimpleNamespace(**{k: v for k, v in d.items() if v is not ...})


_JAMBA = dict(model_type="jamba", attn_layer_offset=0, mamba_expand=2, mamba_d_state=16, mamba_d_conv=4)
_NESTED = {"full_attention": {"rope_type": "default"}, "sliding_attention": "linear"}


@pytest.mark.parametrize("kw, exc, match", [
    (dict(num_attention_heads=0, head_dim=None), ValueError, "num_attention_heads = 0"),
    (dict(hidden_size=2, head_dim=None), ValueError, "no head size"),
    (dict(hidden_size=..., head_dim=None), ValueError, "no hidden_size"),
    (dict(num_hidden_layers=...), ValueError, "no num_hidden_layers"),
    (dict(rope_scaling={"rope_type": "linear", "factor": 0.0}), ValueError, "factor = 0.0"),
    (dict(rope_scaling={"rope_type": "linear"}), ValueError, "without its factor"),
    (dict(rope_scaling="linear"), TypeError, "config.rope_scaling must be a dict"),
    (dict(rope_scaling=["linear"]), TypeError, "config.rope_scaling must be a dict"),
    (dict(rope_parameters=_NESTED), TypeError, r"config.rope_parameters\['sliding_attention'\]"),
    (dict(rope_scaling={"rope_type": 3}), TypeError, "rope_type must be a str"),
    (dict(rope_theta=float("nan")), ValueError, "rope_theta"),
    (dict(rope_theta="1e4"), TypeError, "rope_theta"),
    (dict(_JAMBA, attn_layer_period=0), ValueError, "attn_layer_period = 0"),
    (dict(_JAMBA, attn_layer_period=2, attn_layer_offset=2), ValueError, "attn_layer_offset = 2"),
    (dict(sliding_window=float("inf")), TypeError, "config.sliding_window must be an int"),
    (dict(partial_rotary_factor=float("inf")), ValueError, "partial_rotary_factor = inf"),
    (dict(partial_rotary_factor=2.0), ValueError, "partial_rotary_factor = 2.0"),
    (dict(max_position_embeddings=float("inf")), TypeError, "config.max_position_embeddings must be an int"),
    (dict(layer_types=5), TypeError, "config.layer_types must be a list"),
    (dict(num_hidden_layers=2**40), ValueError, "num_hidden_layers = 1099511627776"),
    # the layer count first, and bounded: no per-layer table of 10**8 entries is made
    (dict(num_hidden_layers=10**8, num_attention_heads=0), ValueError, "num_hidden_layers = 100000000"),
    (dict(num_hidden_layers=True), TypeError, "config.num_hidden_layers must be an int, not bool"),
    (dict(num_hidden_layers="8"), TypeError, "config.num_hidden_layers must be an int, not str"),
    (dict(num_hidden_layers=2.9), TypeError, "config.num_hidden_layers must be an int, not float"),
    (dict(num_key_value_heads=2.0), TypeError, "config.num_key_value_heads must be an int"),
    (dict(head_dim="16"), TypeError, "config.head_dim must be an int"),
])
def test_a_malformed_config_is_refused_at_once(kw, exc, match):
    cfg = _plain_config(**kw)
    with pytest.raises(exc, match=match):
        from_transformers_config(cfg, 64)
    if kw.get("model_type") != "jamba":
        with pytest.raises(exc, match=match):
            read_transformers_config(cfg)


def test_a_malformed_chunk_size_is_refused():
    cfg = _plain_config(layer_types=["chunked_attention", "full_attention"], attention_chunk_size=8.0)
    with pytest.raises(TypeError, match="config.attention_chunk_size must be an int"):
        hf_attention(cfg, chunked_as_sliding=True)
    cfg.attention_chunk_size = 8
    assert hf_attention(cfg, chunked_as_sliding=True)[4] == 8
