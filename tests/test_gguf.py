"""Cache geometry from GGUF models: the models llama.cpp wrote the interop blobs with (their
manifests, cache-size log lines and state blobs), and tiny models written here with the gguf
package (per-layer heads, sliding-window layouts, RoPE scaling and factors, Mamba, bad files)."""
import dataclasses
import json
import os
import struct

import numpy as np
import pytest

import kvcache
from kvcache import ISWACache, ModelGeometry, RecurrentCache, RecurrentCache2025, RecurrentCache2026, RopeParams, UnifiedCache, from_gguf, read_gguf

from conftest import need_module
from interop_data import interop_dir

gguf = need_module("test", "gguf")


INTEROP = interop_dir()
FOLDERS = ["llama_fa0", "llama_fa1", "llama_q8_fa1", "llama_bf16_fa1", "gemma2_fa0", "mamba"]
TYPE_NAMES = {0: "f32", 1: "f16", 8: "q8_0", 30: "bf16"}


# --- the interop models ----------------------------------------------------------------------

def manifest(folder, blob="state.bin"):
    return json.loads((INTEROP / folder / (blob + ".json")).read_text())


def cache_from_manifest(folder):
    man = manifest(folder)
    ctx = man["context"]
    return from_gguf(INTEROP / "models" / man["model"]["file"], ctx["n_ctx_requested"],
                     n_seq_max=ctx["n_seq_max"], type_k=TYPE_NAMES[ctx["type_k"]],
                     type_v=TYPE_NAMES[ctx["type_v"]], flash_attn=ctx["flash_attn"], n_batch=ctx["n_batch"])


def parts(c):
    """The unified caches of c with the manifest's section names."""
    if isinstance(c, UnifiedCache):
        return {"kv": c}
    return {"base": c.base, "swa": c.swa}


def strip_context(data):
    """Skip llama.cpp's whole-context header (arch, outputs, logits, embeddings)."""
    (n,) = struct.unpack_from("<I", data, 0)
    off = 4 + n
    (n_out,) = struct.unpack_from("<I", data, off)
    off += 4 + 4 * n_out
    (n_logits,) = struct.unpack_from("<Q", data, off)
    off += 8 + 4 * n_logits
    (n_embd,) = struct.unpack_from("<Q", data, off)
    return data[off + 8 + 4 * n_embd:]


def mib(nbytes):
    return f"{nbytes / (1024.0 * 1024.0):7.2f}"


@pytest.mark.parametrize("folder", FOLDERS)
def test_geometry_matches_the_manifest(folder):
    man = manifest(folder)
    c = cache_from_manifest(folder)
    if man["memory_kind"] == "recurrent":
        assert isinstance(c, RecurrentCache)
        geo = man["geometry"][0]
        assert c.size == geo["mem_size"] and c.n_layer == len(geo["layers"])
        assert c.n_embd_k == [L["n_embd_r"] for L in geo["layers"]]
        assert c.n_embd_v == [L["n_embd_s"] for L in geo["layers"]]
        assert (c.type_k, c.type_v) == (TYPE_NAMES[geo["layers"][0]["r_type"]], TYPE_NAMES[geo["layers"][0]["s_type"]])
        return
    ctx = man["context"]
    for sec in man["geometry"]:
        u = parts(c)[sec["name"]]
        assert u.size == sec["kv_size"] and u.v_trans == sec["v_trans"] == ctx["v_trans"]
        assert u.n_pad == ctx["n_pad"] and u.n_seq_max == ctx["n_seq_max"]
        assert (u.n_swa, u.swa_type) == (sec["n_swa"], sec["swa_type"])
        assert u.layers == tuple(L["il"] for L in sec["layers"])
        for L in sec["layers"]:
            il = L["il"]
            assert (u.type_k, u.type_v) == (TYPE_NAMES[L["type_k"]], TYPE_NAMES[L["type_v"]])
            assert u.k(il).nbytes == u.size * L["k_size_row"]
            if u.v_trans:
                assert u.v(il).shape == (L["n_embd_v_gqa"], u.size) and u.v(il).itemsize == L["v_size_el"]
            else:
                assert u.v(il).nbytes == u.size * L["v_size_row"]


@pytest.mark.parametrize("folder", FOLDERS)
def test_sizes_match_llama_log_lines(folder):
    """llama.cpp prints each cache's size when it creates it; the caches from_gguf builds have
    the same cells, layers and bytes."""
    man = manifest(folder)
    lines = man["llama_log_cache_lines"]
    c = cache_from_manifest(folder)
    if isinstance(c, RecurrentCache):
        assert (f"mem_size = {c.size}, n_seq_max = {c.n_seq_max}, type_r = '{c.type_k}', "
                f"type_s = '{c.type_v}', n_layer = {c.n_layer}") in lines[0]
        want = (f"KV self size  = {mib(c.total_size)} MiB, R ({c.type_k}): {mib(c.size_k_bytes)} MiB, "
                f"S ({c.type_v}): {mib(c.size_v_bytes)} MiB")
        assert any(want in line for line in lines)
        return
    sizes = [line for line in lines if ": size = " in line]
    assert len(sizes) == len(man["geometry"])
    for sec, line in zip(man["geometry"], sizes):
        u = parts(c)[sec["name"]]
        want = (f"size = {mib(u.total_size)} MiB ({u.size:6d} cells, {len(u.layers):3d} layers, "
                f"{u.n_seq_max:2d} seqs), K ({u.type_k}): {mib(u.size_k_bytes)} MiB, "
                f"V ({u.type_v}): {mib(u.size_v_bytes)} MiB")
        assert want in line


def check_cells(c, sections, seq_id):
    for sec in sections:
        u = parts(c)[sec.get("name", "kv")] if not isinstance(c, RecurrentCache) else c
        if isinstance(u, RecurrentCache):
            cells = u.cells()
            got = sorted((int(cells["pos"][i]), cells["seq_id"][i]) for i in range(u.size) if cells["seq_id"][i])
            want = sorted((e["pos"], e["seq_ids"] if seq_id == -1 else [seq_id]) for e in sec["cells"])
        else:
            got = sorted((p, s) for _, p, s, _ in u.cells().nonempty())
            want = sorted((e["pos"], e["seq_ids"] if seq_id == -1 else [seq_id]) for e in sec["cells"])
        assert got == want


@pytest.mark.parametrize("folder", FOLDERS)
@pytest.mark.parametrize("blob", ["seq0.bin", "seq1.bin", "seq2.bin", "seq3.bin", "state.bin"])
def test_llama_blobs_restore_into_the_cache_from_gguf(folder, blob):
    man = manifest(folder, blob)
    data = (INTEROP / folder / blob).read_bytes()
    if blob == "state.bin":
        data = strip_context(data)
    seq_id = man["seq_id"]
    c = cache_from_manifest(folder)
    assert c.state_read(data, seq_id, layout="2025") == len(data)
    check_cells(c, man["expected"]["sections"], seq_id)
    assert c.state_write(seq_id, layout="2025") == data


# --- tiny models written here ----------------------------------------------------------------

def write_model(path, arch, n_layer=4, n_embd=64, n_head=4, n_head_kv=2, kv=None, tensors=None):
    """A GGUF file with the metadata of a tiny model (and optional float32 tensors)."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(512)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(128)
    if n_head is not None:
        w.add_head_count(n_head)
    if n_head_kv is not None:
        w.add_head_count_kv(n_head_kv)
    for key, value in (kv or {}).items():
        key = key.format(arch=arch)
        if isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        elif isinstance(value, (list, tuple)):
            if all(isinstance(x, bool) for x in value):
                w.add_array(key, list(value))
            else:
                w.add_array(key, [int(x) for x in value])
        else:
            w.add_uint32(key, value)
    for name, arr in (tensors or {}).items():
        w.add_tensor(name, np.asarray(arr, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_llama_like_per_layer_heads(tmp_path):
    p = write_model(tmp_path / "m.gguf", "llama", n_layer=3, n_embd=192, n_head=6, n_head_kv=None,
                    kv={"{arch}.attention.head_count_kv": [2, 1, 3], "{arch}.rope.freq_base": 500000.0})
    g = read_gguf(p)
    assert (g.arch, g.n_layer, g.n_embd_head_k, g.n_embd_head_v) == ("llama", 3, 32, 32)
    assert g.n_head_kv == (2, 1, 3) and g.n_embd_k_gqa == (64, 32, 96) == g.n_embd_v_gqa
    assert g.swa_type == "none" and not g.recurrent
    assert (g.rope.n_rot, g.rope.mode, g.rope.freq_base, g.rope.freq_scale) == (32, 0, 500000.0, 1.0)
    c = from_gguf(p, 100, n_seq_max=2)
    assert isinstance(c, UnifiedCache)
    assert (c.size, c.n_pad, c.v_trans, c.n_seq_max) == (128, 32, True, 2)
    assert [c.k(il).shape[1] for il in c.layers] == [64, 32, 96]
    assert c.n_embd_head_k == (32, 32, 32) and repr(c.rope) == repr(g.rope)
    fa = from_gguf(p, 100, flash_attn=True, type_k="bf16", type_v="q8_0")
    assert (fa.size, fa.n_pad, fa.v_trans, fa.type_k, fa.type_v) == (256, 256, False, "bf16", "q8_0")
    assert from_gguf(p, 0).size == 512          # 0: the training context


def test_todays_context_defaults(tmp_path):
    """semantics "2026": n_pad 1, n_ctx padded to 256, a stream of PAD_256(n_ctx / n_seq_max) cells
    per sequence unless unified, flash attention "auto" (a V not transposed); the live sizes of
    FACTS: (256, 4 seqs) -> 4 x 256, (1000, 3) -> 3 x 512, unified (300, 256 seqs) -> 512."""
    p = write_model(tmp_path / "m.gguf", "llama", n_layer=2, n_embd=64, n_head=4, n_head_kv=2)
    c = from_gguf(p, 256, n_seq_max=4, semantics="2026")
    assert (c.semantics, c.n_stream, c.size, c.n_pad, c.v_trans, c.kv_unified) == ("2026", 4, 256, 1, False, False)
    assert from_gguf(p, 1000, n_seq_max=3, semantics="2026").size == 512
    u = from_gguf(p, 300, n_seq_max=256, semantics="2026", kv_unified=True)
    assert (u.n_stream, u.size) == (1, 512)
    assert from_gguf(p, 300, semantics="2026", flash_attn=False).v_trans
    assert (from_gguf(p, 100).semantics, from_gguf(p, 100).size) == ("2025", 128)
    with pytest.raises(ValueError):
        from_gguf(p, 100, kv_unified=False)
    with pytest.raises(ValueError):
        from_gguf(p, 100, semantics="2027")
    swa = write_model(tmp_path / "g.gguf", "gemma2", n_layer=2,
                      kv={"{arch}.attention.key_length": 16, "{arch}.attention.value_length": 16})
    g = read_gguf(swa)
    # today's iSWA pair: both caches 2026, a stream per sequence, full-size SWA cache by default
    c = from_gguf(swa, 256, n_seq_max=4, semantics="2026")
    assert isinstance(c, ISWACache) and (c.semantics, c.n_stream, c.size_base, c.size_swa, c.swa_full) == \
        ("2026", 4, 256, 256, True)
    assert (c.swa.semantics, c.swa.n_swa, c.base.n_swa, c.base.n_pad, c.swa.v_trans) == ("2026", g.n_swa, 0, 1, False)
    # and sized by the window: PAD_256(min(kv_size, n_swa * n_seq_max + n_ubatch)) over one stream
    c = from_gguf(swa, 2048, n_seq_max=2, semantics="2026", kv_unified=True, swa_full=False, n_batch=64)
    assert (c.n_stream, c.size_base, c.size_swa) == (1, 2048, -(-min(2048, g.n_swa * 2 + 64) // 256) * 256)


def test_key_and_value_lengths_and_partial_rotation(tmp_path):
    p = write_model(tmp_path / "m.gguf", "phi2", n_layer=2, n_embd=64, n_head=2, n_head_kv=2,
                    kv={"{arch}.attention.key_length": 40, "{arch}.attention.value_length": 24,
                        "{arch}.rope.dimension_count": 16})
    g = read_gguf(p)
    assert g.n_embd_k_gqa == (80, 80) and g.n_embd_v_gqa == (48, 48)
    assert (g.rope.n_rot, g.rope.mode) == (16, 2)


def test_rope_scaling(tmp_path):
    p = write_model(tmp_path / "m.gguf", "qwen2", kv={
        "{arch}.rope.scaling.type": "yarn", "{arch}.rope.scaling.factor": 4.0,
        "{arch}.rope.scaling.original_context_length": 4096, "{arch}.rope.freq_base": 1000000.0})
    r = read_gguf(p).rope
    assert (r.mode, r.freq_scale, r.ext_factor, r.n_ctx_orig, r.freq_base) == (2, 0.25, 1.0, 4096, 1000000.0)
    p = write_model(tmp_path / "n.gguf", "llama", kv={"{arch}.rope.scale_linear": 2.0})
    r = read_gguf(p).rope
    assert (r.freq_scale, r.ext_factor, r.n_ctx_orig) == (0.5, 0.0, 512)
    p = write_model(tmp_path / "o.gguf", "llama", kv={"{arch}.rope.scaling.type": "none",
                                                     "{arch}.rope.scaling.factor": 8.0})
    assert read_gguf(p).rope.freq_scale == 1.0


def test_rope_frequency_factors(tmp_path):
    ff = np.linspace(1.0, 8.0, 8)
    p = write_model(tmp_path / "m.gguf", "llama", tensors={"rope_freqs.weight": ff})
    g = read_gguf(p)
    assert np.allclose(g.rope.freq_factors, ff) and g.rope_long is None
    short, long = np.full(8, 1.5), np.full(8, 3.0)
    p = write_model(tmp_path / "n.gguf", "phi3",
                    tensors={"rope_factors_short.weight": short, "rope_factors_long.weight": long})
    g = read_gguf(p)
    assert np.allclose(g.rope.freq_factors, short) and np.allclose(g.rope_long.freq_factors, long)
    # the long factors apply when a sequence's share of the context exceeds the training one
    assert np.allclose(g.make_cache(512).rope.freq_factors, short)
    assert np.allclose(g.make_cache(1024).rope.freq_factors, long)
    assert np.allclose(g.make_cache(1024, n_seq_max=2).rope.freq_factors, short)
    bad = write_model(tmp_path / "b.gguf", "llama", tensors={"rope_freqs.weight": np.ones(5)})
    with pytest.raises(ValueError, match="frequency factors"):
        read_gguf(bad)


def test_gemma2_defaults_and_window(tmp_path):
    g = read_gguf(write_model(tmp_path / "a.gguf", "gemma2", n_layer=5,
                              kv={"{arch}.attention.key_length": 16, "{arch}.attention.value_length": 16}))
    assert (g.n_swa, g.swa_type, g.swa_layers) == (4096, "standard", (0, 2, 4))
    assert g.rope.mode == 2 and g.rope.layer_freq_base is None
    g = read_gguf(write_model(tmp_path / "b.gguf", "gemma2", kv={"{arch}.attention.sliding_window": 8}))
    assert (g.n_swa, g.swa_layers) == (8, (0, 2))


def test_gemma3_pattern_and_window_rope(tmp_path):
    g = read_gguf(write_model(tmp_path / "a.gguf", "gemma3", n_layer=8, kv={
        "{arch}.attention.sliding_window": 512, "{arch}.rope.freq_base": 1000000.0,
        "{arch}.rope.scaling.factor": 8.0}))
    assert (g.n_swa, g.swa_type, g.swa_layers) == (512, "standard", (0, 1, 2, 3, 4, 6, 7))
    r = g.rope
    # windowed layers use base 10000 and no scaling; full-attention layers the model's own
    assert r.freq_base_for(5) == 1000000.0 and r.freq_scale_for(5) == 0.125
    assert r.freq_base_for(0) == 10000.0 and r.freq_scale_for(0) == 1.0
    with pytest.raises(ValueError, match="sliding_window"):
        read_gguf(write_model(tmp_path / "b.gguf", "gemma3"))


def test_window_pattern_from_the_file(tmp_path):
    g = read_gguf(write_model(tmp_path / "a.gguf", "gemma3", n_layer=6, kv={
        "{arch}.attention.sliding_window": 64, "{arch}.attention.sliding_window_pattern": 3}))
    assert g.swa_layers == (0, 1, 3, 4)
    g = read_gguf(write_model(tmp_path / "b.gguf", "gemma3", n_layer=4, kv={
        "{arch}.attention.sliding_window": 64,
        "{arch}.attention.sliding_window_pattern": [True, False, False, True]}))
    assert g.swa_layers == (0, 3)
    # an architecture llama.cpp does not window ignores a bare sliding_window key
    g = read_gguf(write_model(tmp_path / "c.gguf", "llama", kv={"{arch}.attention.sliding_window": 64}))
    assert g.swa_type == "none" and g.swa_layers == ()


def test_llama4_chunked(tmp_path):
    g = read_gguf(write_model(tmp_path / "a.gguf", "llama4", n_layer=8))
    assert (g.n_swa, g.swa_type, g.swa_layers) == (8192, "chunked", (0, 1, 2, 4, 5, 6))
    g = read_gguf(write_model(tmp_path / "b.gguf", "llama4", kv={"{arch}.attention.sliding_window": 0}))
    assert g.swa_type == "none"


def test_mamba(tmp_path):
    p = write_model(tmp_path / "m.gguf", "mamba", n_layer=2, n_head=0, n_head_kv=None, kv={
        "{arch}.ssm.conv_kernel": 4, "{arch}.ssm.inner_size": 96, "{arch}.ssm.state_size": 8,
        "{arch}.ssm.time_step_rank": 4})
    g = read_gguf(p)
    assert g.recurrent and g.rope is None
    assert (g.n_embd_k_s, g.n_embd_v_s) == (3 * 96, 8 * 96)
    c = from_gguf(p, 1000, n_seq_max=3, type_k="q8_0")
    assert isinstance(c, RecurrentCache)
    assert (c.size, c.type_k, c.type_v, c.n_embd_k, c.n_embd_v) == (3, "f32", "f32", [288, 288], [768, 768])
    assert c.semantics == "2025"


def test_mamba_today(tmp_path):
    """semantics "2026" makes today's recurrent cache (llama.cpp keeps no rollback snapshots for
    Mamba: n_rs_seq asked for is not kept, as for the hybrids without them)."""
    p = write_model(tmp_path / "m.gguf", "mamba", n_layer=2, n_head=0, n_head_kv=None, kv={
        "{arch}.ssm.conv_kernel": 4, "{arch}.ssm.inner_size": 96, "{arch}.ssm.state_size": 8,
        "{arch}.ssm.time_step_rank": 4})
    c = from_gguf(p, 1000, n_seq_max=3, semantics="2026", n_rs_seq=2)
    assert isinstance(c, RecurrentCache2026)
    assert (c.semantics, c.n_rs_seq, c.size) == ("2026", 0, 3)
    assert isinstance(from_gguf(p, 1000, semantics="2025"), RecurrentCache2025)


def test_mamba_missing_state_size(tmp_path):
    p = write_model(tmp_path / "m.gguf", "mamba", n_head=0, n_head_kv=None,
                    kv={"{arch}.ssm.conv_kernel": 4, "{arch}.ssm.inner_size": 96})
    with pytest.raises(ValueError, match="mamba.ssm.state_size"):
        read_gguf(p)


def test_bad_files(tmp_path):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a model at all" * 10)
    with pytest.raises(ValueError, match="GGUF"):
        read_gguf(junk)
    with pytest.raises(FileNotFoundError):
        read_gguf(tmp_path / "missing.gguf")
    w = gguf.GGUFWriter(str(tmp_path / "nolayers.gguf"), "llama")
    w.add_embedding_length(64)
    w.add_context_length(512)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="llama.block_count"):
        read_gguf(tmp_path / "nolayers.gguf")
    with pytest.raises(ValueError, match="architecture"):
        read_gguf(write_model(tmp_path / "u.gguf", "someformer"))
    with pytest.raises(ValueError, match="rwkv6"):
        read_gguf(write_model(tmp_path / "r.gguf", "rwkv6"))
    with pytest.raises(ValueError, match="entries"):
        read_gguf(write_model(tmp_path / "h.gguf", "llama", n_layer=3, n_head_kv=None,
                              kv={"{arch}.attention.head_count_kv": [2, 2]}))


def test_bad_cache_arguments(tmp_path):
    p = write_model(tmp_path / "m.gguf", "llama")
    with pytest.raises(TypeError, match="n_ctx"):
        from_gguf(p, "256")
    with pytest.raises(ValueError, match="n_seq_max"):
        from_gguf(p, 256, n_seq_max=0)
    with pytest.raises(TypeError, match="flash_attn"):
        from_gguf(p, 256, flash_attn="yes")
    with pytest.raises(ValueError, match="type_k"):
        from_gguf(p, 256, type_k="q9")


def test_shifted_keys_rotate_with_the_model_rope(tmp_path):
    """The cache from_gguf builds rotates shifted keys on update() with the model's RoPE."""
    p = write_model(tmp_path / "m.gguf", "qwen2", n_layer=2, n_embd=64, n_head=4, n_head_kv=2,
                    kv={"{arch}.rope.freq_base": 50000.0})
    c = from_gguf(p, 64, type_k="f32", type_v="f32")
    r = c.rope
    rng = np.random.default_rng(3)
    base = rng.standard_normal((4, 32)).astype(np.float32)
    at = lambda pos: _rotated(base, pos, r)          # noqa: E731
    assert c.find_slot(kvcache.UBatch([0, 1, 2, 3], [0] * 4))
    for il in c.layers:
        c.store(il, at([0, 1, 2, 3]), np.zeros((4, 32), np.float32))
    c.commit()
    c.seq_add(0, 0, -1, 7)
    assert c.update().rotated
    for il in c.layers:
        np.testing.assert_allclose(c.k(il)[:4], at([7, 8, 9, 10]), atol=2e-5)


def _rotated(k, pos, rope):
    out = k.copy()
    kvcache.rope_shift(out, "f32", 2, 16, np.asarray(pos), rope)
    return out


def test_geometry_is_a_value():
    g = ModelGeometry(arch="llama", n_layer=2, n_embd=32, n_ctx_train=64, n_head=(2, 2), n_head_kv=(1, 2),
                      n_embd_head_k=16, n_embd_head_v=8, rope=RopeParams(16))
    assert g.n_embd_k_gqa == (16, 32) and g.n_embd_v_gqa == (8, 16)
    c = g.make_cache(64, type_k="f32")
    assert [c.k(il).shape[1] for il in c.layers] == [16, 32]
    with pytest.raises(dataclasses.FrozenInstanceError):
        g.n_layer = 3


def test_gemma2_iswa_from_gguf():
    model = INTEROP / "models" / "tiny_gemma2.gguf"
    c = from_gguf(model, 256, n_seq_max=4, n_batch=64)
    assert isinstance(c, kvcache.ISWACache)
    assert (c.size_base, c.size_swa, c.swa_layers, c.n_swa) == (256, 96, (0, 2), 8) and not c.can_shift
    assert c.rope.mode == 2 and c.n_embd_head_k == (16,) * 4
    full = from_gguf(model, 256, n_seq_max=4, swa_full=True)
    assert full.size_swa == 256 and full.can_shift
    meta = from_gguf(model, 256, buffers=None)
    assert meta.buffers == "none" and meta.total_size == from_gguf(model, 256).total_size


def test_mrope_and_ple_models_get_the_per_cell_extension_today(tmp_path):
    p = write_model(tmp_path / "vl.gguf", "qwen2vl", kv={"{arch}.rope.dimension_sections": [16, 24, 24, 0]})
    g = read_gguf(p)
    assert g.cell_ext and g.ple_token is None
    c = from_gguf(p, 256, semantics="2026")
    assert c.cell_ext and c.ple_token is None
    assert not from_gguf(p, 256).cell_ext            # the seed's cells had no extension
    p = write_model(tmp_path / "ple.gguf", "llama", kv={"{arch}.ple.ngram_size": 3, "{arch}.ple.heads_per_ngram": 2,
                                                       "{arch}.ple.eos_token_id": 2})
    g = read_gguf(p)
    assert g.cell_ext and g.ple_token == 2
    p = write_model(tmp_path / "ple2.gguf", "llama", kv={"{arch}.ple.ngram_size": 3, "{arch}.ple.heads_per_ngram": 2,
                                                        "{arch}.ple.eos_token_id": 2, "{arch}.ple.image_token_id": 9})
    assert from_gguf(p, 256, semantics="2026").ple_token == 9
    p = write_model(tmp_path / "plain.gguf", "llama")
    assert not read_gguf(p).cell_ext and not from_gguf(p, 256, semantics="2026").cell_ext


# --- hostile files, written byte by byte ---------------------------------------------------------

_VT = {"u8": (0, "B"), "u32": (4, "I"), "i32": (5, "i"), "f32": (6, "f"), "bool": (7, "?"), "str": (8, None),
       "arr": (9, None), "u64": (10, "Q")}


def _gguf_str(text):
    b = text if isinstance(text, bytes) else text.encode()
    return struct.pack("<Q", len(b)) + b


def _gguf_value(vtype, value):
    if vtype == "str":
        return _gguf_str(value)
    if vtype == "arr":      # (item type, items) or (item type, items, claimed count)
        itype, items, *count = value
        body = b"".join(_gguf_value(itype, x) for x in items)
        return struct.pack("<IQ", _VT[itype][0], count[0] if count else len(items)) + body
    return struct.pack("<" + _VT[vtype][1], value)


def raw_gguf(path, kvs, version=3):
    """A GGUF file of metadata alone, as given: (key, type, value) entries, repeats and all."""
    body = b"".join(_gguf_str(k) + struct.pack("<I", _VT[t][0]) + _gguf_value(t, v) for k, t, v in kvs)
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", version, 0, len(kvs)) + body)
    return path


def llama_kvs(arch="llama", **over):
    """The metadata of a tiny model; over: {key with {arch}: (type, value) or None to drop it}."""
    kvs = {"general.architecture": ("str", arch), "{arch}.context_length": ("u32", 512),
           "{arch}.embedding_length": ("u32", 64), "{arch}.block_count": ("u32", 3),
           "{arch}.attention.head_count": ("u32", 4), "{arch}.attention.head_count_kv": ("u32", 2),
           "{arch}.rope.freq_base": ("f32", 10000.0)}
    kvs.update({k.replace("__", "."): v for k, v in over.items()})
    return [(k.format(arch=arch), *tv) for k, tv in kvs.items() if tv is not None]


def test_a_fifo_is_refused_at_once(tmp_path):
    fifo = tmp_path / "m.gguf"
    os.mkfifo(fifo)
    # held open at both ends, so that a reader that opens it anyway does not block the test
    hold = os.open(fifo, os.O_RDWR | os.O_NONBLOCK)
    try:
        with pytest.raises(OSError, match=f"{fifo}: not a regular file"):
            read_gguf(fifo)
    finally:
        os.close(hold)
    with pytest.raises(IsADirectoryError):
        read_gguf(tmp_path)


@pytest.mark.parametrize("itype,items,count", [("u8", [], 10**6), ("u8", [1, 2], 2**40), ("u32", [1], 2**62),
                                               ("str", ["a", "b"], 10**6), ("str", ["a", "b"], 3),
                                               ("arr", [], 10**5)])
def test_array_counts_the_file_does_not_hold(tmp_path, itype, items, count):
    p = raw_gguf(tmp_path / "m.gguf", llama_kvs() + [("x", "arr", (itype, items, count))])
    with pytest.raises(ValueError, match=f"{p}: the value of 'x' .*runs past the end of the file"):
        read_gguf(p)


def test_truncated_and_malformed_metadata(tmp_path):
    good = raw_gguf(tmp_path / "m.gguf", llama_kvs()).read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(good[:-2])
    with pytest.raises(ValueError, match="'llama.rope.freq_base' runs past the end"):
        read_gguf(cut)
    with pytest.raises(ValueError, match="not a GGUF file"):
        read_gguf(_empty(tmp_path))
    with pytest.raises(ValueError, match="GGUF version 7"):
        read_gguf(raw_gguf(tmp_path / "v7.gguf", llama_kvs(), version=7))
    bad = good.replace(struct.pack("<I", 6) + struct.pack("<f", 10000.0), struct.pack("<I", 13) + b"\0" * 4)
    (tmp_path / "t.gguf").write_bytes(bad)
    with pytest.raises(ValueError, match="'llama.rope.freq_base' has the unknown GGUF type 13"):
        read_gguf(tmp_path / "t.gguf")


def _empty(tmp_path):
    p = tmp_path / "empty.gguf"
    p.write_bytes(b"")
    return p


def test_a_repeated_key_is_refused(tmp_path):
    p = raw_gguf(tmp_path / "m.gguf", llama_kvs() + [("llama.block_count", "u32", 3)])
    with pytest.raises(ValueError, match="the metadata key 'llama.block_count' appears twice"):
        read_gguf(p)


@pytest.mark.parametrize("vtype,value,msg", [
    ("u32", 0, r"= 0 is outside \[1, 65536\]"), ("u32", 65537, r"= 65537 is outside \[1, 65536\]"),
    ("u64", 2**63, "is outside"), ("f32", float("inf"), "f32, expected an integer"),
    ("f32", 2.7, "f32, expected an integer"), ("bool", True, "bool, expected an integer"),
    ("str", "3", "string, expected an integer")])
def test_block_count_is_an_integer_of_a_model(tmp_path, vtype, value, msg):
    p = raw_gguf(tmp_path / "m.gguf", llama_kvs(**{"{arch}__block_count": (vtype, value)}))
    with pytest.raises(ValueError, match=f"{p}: llama.block_count {'' if msg[0] == '=' else '.*'}{msg}"):
        from_gguf(p, 256)


@pytest.mark.parametrize("arch,over,key", [
    ("deepseek2", {"{arch}__rope__scaling__factor": ("f32", float("inf"))}, "deepseek2.rope.scaling.factor"),
    ("deepseek2", {"{arch}__rope__scaling__factor": ("f32", 1e-30)}, "deepseek2.rope.scaling.factor"),
    ("llama", {"{arch}__rope__scaling__factor": ("f32", -2.0)}, "llama.rope.scaling.factor"),
    ("llama", {"{arch}__rope__freq_base": ("f32", float("nan"))}, "llama.rope.freq_base"),
    ("qwen3next", {"{arch}__full_attention_interval": ("u32", 0), "{arch}__ssm__conv_kernel": ("u32", 4),
                   "{arch}__ssm__inner_size": ("u32", 128), "{arch}__ssm__state_size": ("u32", 16)},
     "qwen3next.full_attention_interval"),
    ("gemma2", {"{arch}__attention__sliding_window_pattern": ("f32", float("inf"))},
     "gemma2.attention.sliding_window_pattern"),
    ("gemma2", {"{arch}__attention__sliding_window_pattern": ("arr", ("str", ["1", "0", "1"]))},
     "gemma2.attention.sliding_window_pattern"),
    ("llama", {"{arch}__attention__head_count": ("f32", float("inf"))}, "llama.attention.head_count"),
    ("llama", {"{arch}__attention__head_count_kv": ("arr", ("f32", [float("inf")] * 3))},
     "llama.attention.head_count_kv"),
    ("llama", {"{arch}__attention__head_count": ("arr", ("str", ["4", "4", "4"]))}, "llama.attention.head_count"),
    ("llama", {"{arch}__attention__key_length": ("i32", -16)}, "llama.attention.key_length"),
    ("llama", {"{arch}__rope__dimension_sections": ("arr", ("bool", [True, False]))},
     "llama.rope.dimension_sections"),
])
def test_metadata_of_the_wrong_type_or_out_of_range(tmp_path, arch, over, key):
    p = raw_gguf(tmp_path / "m.gguf", llama_kvs(arch, **over))
    with pytest.raises(ValueError, match=f"{p}: {key}"):
        read_gguf(p)


def test_a_bool_key_holds_a_bool(tmp_path):
    ssm = {"{arch}__ssm__conv_kernel": ("u32", 4), "{arch}__ssm__inner_size": ("u32", 128),
           "{arch}__ssm__state_size": ("u32", 16), "{arch}__attention__head_count_kv": ("arr", ("u32", [0, 2, 0]))}
    p = raw_gguf(tmp_path / "m.gguf", llama_kvs("granitehybrid", **ssm,
                                                **{"{arch}__rope__scaling__finetuned": ("bool", False)}))
    assert read_gguf(p).rope is None
    p = raw_gguf(tmp_path / "s.gguf", llama_kvs("granitehybrid", **ssm,
                                                **{"{arch}__rope__scaling__finetuned": ("str", "false")}))
    with pytest.raises(ValueError, match="granitehybrid.rope.scaling.finetuned has the GGUF type string, expected a bool"):
        read_gguf(p)


def _with_vocabulary(path, n_tokens, endianess=None):
    """A tiny llama whose tokenizer holds n_tokens tokens, scores and types (a real model's
    metadata is mostly these), with RoPE factors, in the given byte order."""
    kw = {} if endianess is None else {"endianess": endianess}
    w = gguf.GGUFWriter(str(path), "llama", **kw)
    w.add_context_length(512)
    w.add_embedding_length(64)
    w.add_block_count(4)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_token_list([f"token {i}".encode() for i in range(n_tokens)])
    w.add_token_scores([float(i) for i in range(n_tokens)])
    w.add_token_types([1] * n_tokens)
    w.add_custom_alignment(64)
    w.add_tensor("token_embd.weight", np.zeros((3, 64), np.float32))
    w.add_tensor("rope_freqs.weight", np.linspace(1.0, 8.0, 8).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("endianess", [None, "big"])
def test_a_vocabulary_is_stepped_over_and_tensors_found_past_it(tmp_path, endianess):
    """The metadata is read in one walk that steps over a tokenizer's arrays (a vocabulary of
    128K tokens took seconds to decode, item by item, and none of it is read); the RoPE factors
    are found after them at the file's alignment, in either byte order."""
    if endianess == "big":
        endianess = gguf.GGUFEndian.BIG
    small = read_gguf(_with_vocabulary(tmp_path / "s.gguf", 10, endianess))
    big = read_gguf(_with_vocabulary(tmp_path / "b.gguf", 200_000, endianess))
    assert (big.arch, big.n_layer, big.n_embd_k_gqa, big.n_ctx_train) == (small.arch, small.n_layer,
                                                                           small.n_embd_k_gqa, small.n_ctx_train)
    assert np.allclose(big.rope.freq_factors, np.linspace(1.0, 8.0, 8))
    assert np.allclose(small.rope.freq_factors, np.linspace(1.0, 8.0, 8))
    assert big.n_layer == 4 and big.n_embd_k_gqa == (32,) * 4
