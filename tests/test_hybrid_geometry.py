"""The geometry of hybrid models (attention + recurrent layers) read from GGUF files: which layers
llama.cpp 0.3.36 makes recurrent and which keep K/V, the recurrent row sizes, the rollback
snapshots it allows, the HybridCache from_gguf builds and what ``kvcache plan`` prints."""
import json
import subprocess
import sys

import pytest

from conftest import kvcache_env, need_module

import kvcache
from kvcache.plan import plan_hybrid

gguf = need_module("test", "gguf")


def write_gguf(path, arch, n_layer, n_head_kv, **keys):
    """A metadata-only GGUF file of an architecture (read_gguf reads nothing else)."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_uint32(f"{arch}.block_count", n_layer)
    w.add_uint32(f"{arch}.embedding_length", 64)
    w.add_uint32(f"{arch}.context_length", 1024)
    w.add_uint32(f"{arch}.attention.head_count", 4)
    w.add_array(f"{arch}.attention.head_count_kv", n_head_kv)
    for k, v in keys.items():
        name = f"{arch}.{k}"
        if isinstance(v, list):
            w.add_array(name, v)
        else:
            w.add_uint32(name, v)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


MAMBA2 = {"ssm.conv_kernel": 4, "ssm.inner_size": 128, "ssm.state_size": 16, "ssm.group_count": 2,
          "ssm.time_step_rank": 8}
# R = (d_conv - 1) * (d_inner + 2 * n_group * d_state), S = d_state * d_inner
R_MAMBA2, S_MAMBA2 = 3 * (128 + 2 * 2 * 16), 16 * 128


@pytest.mark.parametrize("arch, n_head_kv, keys, recr, attn, r, s, rollback", [
    ("granitehybrid", [0, 2, 0, 0], MAMBA2, (0, 2, 3), (1,), R_MAMBA2, S_MAMBA2, False),
    ("jamba", [0, 0, 2, 0], {k: v for k, v in MAMBA2.items() if k != "ssm.group_count"}, (0, 1, 3), (2,),
     3 * 128, S_MAMBA2, False),
    ("plamo2", [2, 0, 2, 0], MAMBA2, (1, 3), (0, 2), R_MAMBA2, S_MAMBA2, False),
    ("falcon-h1", [2, 2, 2], MAMBA2, (0, 1, 2), (0, 1, 2), R_MAMBA2, S_MAMBA2, False),
    # Nemotron-H: the feed-forward layers (n_ff > 0, no heads) are in neither part
    ("nemotron_h", [0, 0, 2, 0], {**MAMBA2, "feed_forward_length": [0, 256, 0, 0]}, (0, 3), (2,), R_MAMBA2,
     S_MAMBA2, True),
    # Qwen3-Next: every 4th layer is full attention (full_attention_interval, default 4)
    ("qwen3next", [2] * 8, MAMBA2, (0, 1, 2, 4, 5, 6), (3, 7), R_MAMBA2, S_MAMBA2, False),
    ("qwen3next", [2] * 4, {**MAMBA2, "full_attention_interval": 2}, (0, 2), (1, 3), R_MAMBA2, S_MAMBA2, False),
])
def test_hybrid_layers(tmp_path, arch, n_head_kv, keys, recr, attn, r, s, rollback):
    path = write_gguf(tmp_path / f"{arch}.gguf", arch, len(n_head_kv), n_head_kv, **keys)
    g = kvcache.read_gguf(path)
    assert g.hybrid and (g.recurrent_layers, g.attn_layers) == (recr, attn)
    assert (g.n_embd_k_s, g.n_embd_v_s, g.rs_rollback) == (r, s, rollback)
    h = kvcache.from_gguf(path, 512, n_seq_max=2, semantics="2026", n_rs_seq=3)
    assert isinstance(h, kvcache.HybridCache)
    assert (h.recurrent_layers, h.attn_layers) == (recr, attn)
    assert h.n_rs_seq == (3 if rollback else 0), "llama.cpp sets n_rs_seq to 0 where it allows no rollback"
    assert h.recr.n_embd_k == [r] * len(recr) and h.recr.n_embd_v == [s] * len(recr)
    with pytest.raises(ValueError, match="semantics '2026'"):
        kvcache.from_gguf(path, 512)


def test_lfm2_as_llama_cpp_builds_it(shared_dir):
    """The interop-hybrid model: the geometry and sizes of its manifest (llama.cpp's own)."""
    base = shared_dir / "interop-hybrid" / "models"
    if not base.is_dir():
        pytest.skip(f"{base} not found")
    m = json.loads((shared_dir / "interop-hybrid" / "lfm2_c_rollback" / "seq0.bin.json").read_text())
    g = kvcache.read_gguf(base / "tiny_lfm2.gguf")
    assert list(g.recurrent_layers) == m["model"]["recurrent_layers"]
    assert list(g.attn_layers) == m["model"]["attn_layers"]
    assert (g.n_embd_k_s, g.n_embd_v_s) == (m["model"]["shortconv"]["n_embd_r"], m["model"]["shortconv"]["n_embd_s"])
    ctx = m["context"]
    h = kvcache.from_gguf(base / "tiny_lfm2.gguf", ctx["n_ctx"], n_seq_max=ctx["n_seq_max"], semantics="2026",
                          kv_unified=ctx["kv_unified"], flash_attn=ctx["flash_attn"], n_rs_seq=ctx["n_rs_seq"])
    attn, recr = m["geometry"]["attn"], m["geometry"]["recr"]
    assert h.attn.size == attn["kv_size_per_stream"] and h.attn.v_trans == attn["v_trans"]
    assert h.recr.size == recr["mem_size"] and h.n_rs_seq == recr["n_rs_seq"]
    assert h.recr.k(0).nbytes // h.recr.size == recr["layers"][0]["r_size_row"]
    assert h.recr.size * (1 + h.n_rs_seq) == recr["rows_per_tensor"]


def test_plan_hybrid():
    p = plan_hybrid(256, 4, [0, 2], 32, 32, 128, 0, n_seq_max=4, n_rs_seq=4)
    assert p.variant == "hybrid" and [c.name for c in p.caches] == ["kv", "recurrent"]
    kv, rs = p.caches
    assert kv.kv_size == 256 and [lp.il for lp in kv.layers] == [1, 3]
    assert rs.kv_size == 4 and rs.total_bytes == 2 * 4 * 5 * 512
    h = kvcache.HybridCache(256, 4, [0, 2], 32, 32, 128, 0, n_seq_max=4, n_rs_seq=4)
    assert (kv.total_bytes, rs.total_bytes) == (h.attn.total_size, h.recr.total_size)
    assert any("llama_memory_recurrent: size =" in line and "4 rs_seq" in line for line in p.llama_log)
    assert any(line.startswith("llama_kv_cache: size =") and "2 layers" in line for line in p.llama_log)


def test_cli_plan_of_a_hybrid_model(tmp_path):
    path = write_gguf(tmp_path / "lfm2.gguf", "lfm2", 4, [0, 2, 0, 2], **{"shortconv.l_cache": 3})
    run = [sys.executable, "-m", "kvcache", "plan", str(path), "--n-ctx", "256", "--n-seq-max", "4"]
    out = subprocess.run(run + ["--semantics", "2026", "--kv-unified", "--n-rs-seq", "4"], capture_output=True,
                         text=True, env=kvcache_env())
    assert out.returncode == 0, out.stderr
    assert "hybrid memory (attention + recurrent)" in out.stdout
    assert "attention: 256 cells, layers 1,3" in out.stdout and "recurrent: 4 cells" in out.stdout
    assert "llama_memory_recurrent: size =" in out.stdout
    bad = subprocess.run(run, capture_output=True, text=True, env=kvcache_env())
    assert bad.returncode != 0 and "give --semantics 2026" in bad.stderr
