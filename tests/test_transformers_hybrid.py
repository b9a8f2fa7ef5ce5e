"""Hybrid models from transformers configs: ``from_transformers_config`` gives LFM2 (and its
MoE, and LFM2.5's audio tokenizer with its sliding window), Granite 4 (GraniteMoeHybrid), Bamba
(converted as Granite 4), Jamba, Falcon-H1, Nemotron-H and Qwen3-Next the HybridCache that
``from_gguf(..., semantics="2026", kv_unified=True)`` gives the GGUF file llama.cpp's converter
writes for the same config (its metadata written here from the config's numbers, as the
converter does: vendor/llama.cpp/conversion of llama-cpp-python 0.3.36). Configs only; nothing is
downloaded."""
import pytest

from conftest import need, need_module

transformers = need_module("transformers", "transformers")
if int(transformers.__version__.split(".")[0]) < 5:
    need("transformers", f"transformers 5.x is needed, {transformers.__version__} is installed")
gguf = need_module("test", "gguf")

import kvcache  # noqa: E402
from kvcache.geometry import from_transformers_config, read_transformers_config  # noqa: E402

N_EMBD, N_HEAD, N_KV, HEAD = 64, 4, 2, 16
COMMON = dict(hidden_size=N_EMBD, num_attention_heads=N_HEAD, num_key_value_heads=N_KV, intermediate_size=128,
              max_position_embeddings=1024, vocab_size=300)


def _configs():
    T = transformers
    return {
        # layers 0 and 2 short convolutions
        "lfm2": T.Lfm2Config(num_hidden_layers=4, layer_types=["conv", "full_attention", "conv", "full_attention"],
                             conv_L_cache=3, **COMMON),
        # LFM2.5's audio tokenizer: the one LFM2 whose converter writes its window
        "lfm2_swa": T.Lfm2Config(num_hidden_layers=4, layer_types=["conv", "full_attention", "conv", "full_attention"],
                                 conv_L_cache=3, sliding_window=8, architectures=["Lfm25AudioTokenizer"], **COMMON),
        "lfm2_moe": T.Lfm2MoeConfig(num_hidden_layers=4, conv_L_cache=3,
                                    layer_types=["conv", "full_attention", "conv", "full_attention"], **COMMON),
        # Granite 4: Mamba-2 layers 0, 2, 3 (legacy layer names), no RoPE
        "granitemoehybrid": T.GraniteMoeHybridConfig(
            num_hidden_layers=4, layer_types=["mamba", "attention", "mamba", "mamba"], mamba_n_heads=8,
            mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, **COMMON),
        "granitemoehybrid_rope": T.GraniteMoeHybridConfig(
            num_hidden_layers=4, layer_types=["linear_attention", "full_attention"] * 2, mamba_n_heads=8,
            mamba_n_groups=1, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, position_embedding_type="rope",
            **COMMON),
        # Bamba: Granite 4's layers with RoPE on (over attn_rotary_emb dimensions)
        "bamba": T.BambaConfig(num_hidden_layers=4, attn_layer_indices=[1], mamba_n_heads=8, mamba_d_head=16,
                               mamba_n_groups=1, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, attn_rotary_emb=8,
                               **COMMON),
        # Jamba: attention where il % period == offset, Mamba (one group-less B and C) elsewhere
        "jamba": T.JambaConfig(num_hidden_layers=4, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                               expert_layer_offset=1, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2,
                               mamba_dt_rank=4, **COMMON),
        # Falcon-H1: a Mamba-2 mixer and attention in every layer
        "falcon_h1": T.FalconH1Config(num_hidden_layers=3, head_dim=HEAD, mamba_d_ssm=96, mamba_n_heads=6,
                                      mamba_d_head=16, mamba_n_groups=1, mamba_d_state=16, mamba_d_conv=4, **COMMON),
        # Nemotron-H: feed-forward layers in neither part
        "nemotron_h": T.NemotronHConfig(layers_block_type=["mamba", "mlp", "attention", "mamba"], head_dim=HEAD,
                                        ssm_state_size=16, mamba_num_heads=8, mamba_head_dim=16, n_groups=2,
                                        conv_kernel=4, **{k: v for k, v in COMMON.items()}),
        # Qwen3-Next: every 4th layer full attention, gated delta nets elsewhere; partial RoPE
        "qwen3_next": T.Qwen3NextConfig(num_hidden_layers=8, head_dim=HEAD, linear_conv_kernel_dim=4,
                                        linear_key_head_dim=8, linear_value_head_dim=16, linear_num_key_heads=2,
                                        linear_num_value_heads=4, **COMMON),
    }


def _write_converted(path, name, cfg):
    """The metadata llama.cpp's converter writes for cfg (what read_gguf reads)."""
    g = read_transformers_config(cfg)      # only for the llama.cpp name; the numbers are cfg's
    arch = g.arch
    w = gguf.GGUFWriter(str(path), arch)
    n_layer = len(cfg.layer_types) if name == "nemotron_h" else cfg.num_hidden_layers
    w.add_uint32(f"{arch}.block_count", n_layer)
    w.add_uint32(f"{arch}.embedding_length", cfg.hidden_size)
    w.add_uint32(f"{arch}.context_length", cfg.max_position_embeddings)
    w.add_uint32(f"{arch}.attention.head_count", cfg.num_attention_heads)
    kv = cfg.num_key_value_heads

    def ssm(conv, inner, state, groups, rank):
        w.add_uint32(f"{arch}.ssm.conv_kernel", conv)
        w.add_uint32(f"{arch}.ssm.inner_size", inner)
        w.add_uint32(f"{arch}.ssm.state_size", state)
        w.add_uint32(f"{arch}.ssm.time_step_rank", rank)
        if groups is not None:
            w.add_uint32(f"{arch}.ssm.group_count", groups)

    if name.startswith("lfm2"):
        w.add_array(f"{arch}.attention.head_count_kv", [kv if t != "conv" else 0 for t in cfg.layer_types])
        w.add_uint32(f"{arch}.shortconv.l_cache", cfg.conv_L_cache)
        if name == "lfm2_swa":
            w.add_uint32(f"{arch}.attention.sliding_window", cfg.sliding_window)
    elif name == "bamba":
        w.add_array(f"{arch}.attention.head_count_kv", [kv if t == "full_attention" else 0 for t in cfg.layer_types])
        ssm(cfg.mamba_d_conv, cfg.mamba_expand * cfg.hidden_size, cfg.mamba_d_state, cfg.mamba_n_groups,
            cfg.mamba_n_heads)
        w.add_uint32(f"{arch}.rope.dimension_count", cfg.attn_rotary_emb)
        w.add_bool(f"{arch}.rope.scaling.finetuned", True)
    elif name.startswith("granitemoehybrid"):
        w.add_array(f"{arch}.attention.head_count_kv", [kv if t == "full_attention" else 0 for t in cfg.layer_types])
        ssm(cfg.mamba_d_conv, cfg.mamba_expand * cfg.hidden_size, cfg.mamba_d_state, cfg.mamba_n_groups,
            cfg.mamba_n_heads)
        w.add_bool(f"{arch}.rope.scaling.finetuned", cfg.position_embedding_type == "rope")
    elif name == "jamba":
        off, period = cfg.attn_layer_offset, cfg.attn_layer_period
        w.add_array(f"{arch}.attention.head_count_kv",
                    [kv if il >= off and (il - off) % period == 0 else 0 for il in range(n_layer)])
        ssm(cfg.mamba_d_conv, cfg.mamba_expand * cfg.hidden_size, cfg.mamba_d_state, None, cfg.mamba_dt_rank)
    elif name == "falcon_h1":
        w.add_uint32(f"{arch}.attention.head_count_kv", kv)
        w.add_uint32(f"{arch}.attention.key_length", cfg.head_dim)
        w.add_uint32(f"{arch}.attention.value_length", cfg.head_dim)
        ssm(cfg.mamba_d_conv, cfg.mamba_d_ssm, cfg.mamba_d_state, cfg.mamba_n_groups, cfg.mamba_n_heads)
    elif name == "nemotron_h":
        types = cfg.layer_types
        w.add_array(f"{arch}.attention.head_count_kv", [kv if t == "full_attention" else 0 for t in types])
        w.add_array(f"{arch}.feed_forward_length",
                    [cfg.intermediate_size if t in ("mlp", "moe") else 0 for t in types])
        w.add_uint32(f"{arch}.attention.key_length", cfg.head_dim)
        w.add_uint32(f"{arch}.attention.value_length", cfg.head_dim)
        ssm(cfg.conv_kernel, cfg.mamba_num_heads * cfg.mamba_head_dim, cfg.ssm_state_size, cfg.n_groups,
            cfg.mamba_num_heads)
    elif name == "qwen3_next":
        w.add_uint32(f"{arch}.attention.head_count_kv", kv)
        w.add_uint32(f"{arch}.attention.key_length", cfg.head_dim)
        w.add_uint32(f"{arch}.attention.value_length", cfg.head_dim)
        ssm(cfg.linear_conv_kernel_dim, cfg.linear_value_head_dim * cfg.linear_num_value_heads,
            cfg.linear_key_head_dim, cfg.linear_num_key_heads, cfg.linear_num_value_heads)
        w.add_array(f"{arch}.attention.recurrent_layers", [int(t == "linear_attention") for t in cfg.layer_types])
        partial = cfg.rope_parameters.get("partial_rotary_factor", 0.25)
        w.add_uint32(f"{arch}.rope.dimension_count", int(cfg.head_dim * partial))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# (attention layers, recurrent layers, R width, S width, rollback snapshots kept, RoPE dimensions)
EXPECTED = {
    "lfm2": ((1, 3), (0, 2), 64 * 2, 0, True, HEAD),
    "lfm2_swa": ((1, 3), (0, 2), 64 * 2, 0, True, HEAD),
    "lfm2_moe": ((1, 3), (0, 2), 64 * 2, 0, True, HEAD),
    "bamba": ((1,), (0, 2, 3), 3 * (128 + 2 * 16), 16 * 128, False, 8),
    "granitehybrid": ((1,), (0, 2, 3), 3 * (128 + 2 * 2 * 16), 16 * 128, False, None),
    "granitehybrid_rope": ((1, 3), (0, 2), 3 * (128 + 2 * 16), 16 * 128, False, HEAD),
    "jamba": ((1, 3), (0, 2), 3 * 128, 16 * 128, False, None),
    "falcon_h1": ((0, 1, 2), (0, 1, 2), 3 * (96 + 2 * 16), 16 * 96, False, HEAD),
    "nemotron_h": ((2,), (0, 3), 3 * (128 + 2 * 2 * 16), 16 * 128, True, None),
    "qwen3_next": ((3, 7), (0, 1, 2, 4, 5, 6), 3 * (2 * 2 * 8 + 4 * 16), 8 * 16 * 4, False, HEAD // 4),
}


@pytest.mark.parametrize("name", ["lfm2", "lfm2_swa", "lfm2_moe", "granitemoehybrid", "granitemoehybrid_rope", "bamba",
                                  "jamba", "falcon_h1", "nemotron_h", "qwen3_next"])
def test_hybrid_config_is_the_converted_gguf(tmp_path, name):
    cfg = _configs()[name]
    key = name.replace("granitemoehybrid", "granitehybrid")
    attn, recr, r, s, rollback, n_rot = EXPECTED[key]
    g = read_transformers_config(cfg)
    assert g.hybrid and (g.attn_layers, g.recurrent_layers) == (attn, recr)
    assert (g.n_embd_k_s, g.n_embd_v_s, g.rs_rollback) == (r, s, rollback)
    assert (g.rope.n_rot if g.rope else None) == n_rot
    h = from_transformers_config(cfg, 300, n_seq_max=3, n_rs_seq=2)
    path = _write_converted(tmp_path / f"{name}.gguf", name, cfg)
    ref = kvcache.from_gguf(path, 300, n_seq_max=3, semantics="2026", kv_unified=True, flash_attn=True, n_rs_seq=2)
    assert isinstance(h, kvcache.HybridCache) and isinstance(ref, kvcache.HybridCache)
    for attr in ("n_layer", "attn_layers", "recurrent_layers", "n_seq_max", "n_rs_seq", "total_size", "n_swa",
                 "swa_layers"):
        assert getattr(h, attr) == getattr(ref, attr), attr
    assert h.n_rs_seq == (2 if rollback else 0)
    # with a window, llama_memory_hybrid_iswa: an iSWA pair of every attention layer
    assert (h.n_swa, h.swa_layers) == ((8, attn) if name == "lfm2_swa" else (0, ()))
    if h.n_swa:     # the same SWA cache: today's swa_full (True) unless asked otherwise
        assert h.attn.swa_full is ref.attn.swa_full is True
        assert from_transformers_config(cfg, 300, swa_full=False).attn.swa_full is False
    cells = h.attn.base if h.n_swa else h.attn
    ref_cells = ref.attn.base if ref.n_swa else ref.attn
    assert (cells.size, cells.n_stream, cells.v_trans) == (ref_cells.size, 1, False) == (512, 1, ref_cells.v_trans)
    assert (h.recr.size, h.recr.n_embd_k, h.recr.n_embd_v) == (ref.recr.size, ref.recr.n_embd_k, ref.recr.n_embd_v)
    assert h.recr.n_embd_k == [r] * len(recr) and h.recr.n_embd_v == [s] * len(recr)
    # the K-shift's RoPE: the same rotated dimensions (transformers' layout is its own: see
    # rope_from_transformers), none where llama.cpp shifts nothing
    rg = kvcache.read_gguf(path).rope
    assert (rg.n_rot if rg else None) == n_rot


def test_hybrid_config_errors():
    # Zamba and Zamba2: llama.cpp has no such architecture (its converter maps none)
    for cfg in (transformers.Zamba2Config(), transformers.ZambaConfig()):
        with pytest.raises(ValueError, match="llama.cpp .* has no Zamba2? model"):
            from_transformers_config(cfg, 256)
    # a window only for the architecture whose converter writes it
    plain = _configs()["lfm2"]
    plain.sliding_window = 8
    assert read_transformers_config(plain).n_swa == 0
    cfg = _configs()["lfm2"]
    with pytest.raises(ValueError, match="n_rs_seq"):
        from_transformers_config(transformers.LlamaConfig(hidden_size=64, num_attention_heads=4,
                                                          num_hidden_layers=2), 256, n_rs_seq=2)
    cfg.layer_types = ["conv", "sliding_attention", "conv", "full_attention"]
    with pytest.raises(ValueError, match="sliding_attention"):
        read_transformers_config(cfg)
