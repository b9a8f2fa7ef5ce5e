"""kvcache.HybridCache with a sliding window: today's llama.cpp's llama_memory_hybrid_iswa (LFM2
with attention.sliding_window), whose attention part is an iSWA pair (ISWACache2026) and whose
recurrent part is the recurrent memory, driven by the rules of both: the recurrent part first, a
ubatch in all three caches or in none, a sequence's range the intersection of the recurrent
part's and the SWA cache's, a state of base, SWA and recurrent parts (the SWA cache's and the
recurrent part's with LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY)."""
import numpy as np
import pytest

import kvcache


def lfm2_swa(**kw):
    """LFM2 with a window of 4: layers 0 and 2 short convolutions, 1 and 3 attention, both
    windowed (as llama.cpp's loader marks LFM2's attention layers), so the base cache holds the
    cells and no layer."""
    args = dict(kv_size=256, n_layer=4, recurrent_layers=[0, 2], n_embd_k_gqa=8, n_embd_v_gqa=8, n_embd_r=16,
                n_embd_s=0, n_seq_max=4, type_k="f32", type_v="f32", n_swa=4, n_batch=8)
    args.update(kw)
    return kvcache.HybridCache(**args)


def decode(h, s, p0, n, rng=None):
    rng = rng or np.random.default_rng(s * 100 + p0)
    for ub in list(h.ubatches(list(range(p0, p0 + n)), [s] * n, 8)):
        assert h.find_slot(ub)
        for il in h.attn_layers:
            h.store(il, rng.standard_normal((ub.n_tokens, 8)).astype(np.float32),
                    rng.standard_normal((ub.n_tokens, 8)).astype(np.float32))
        for il in h.recurrent_layers:
            h.store_state(il, rng.standard_normal((ub.n_seqs, 16)).astype(np.float32))


def counts(h):
    return h.attn.base.used, h.attn.swa.used, h.recr.used


def test_parts():
    h = lfm2_swa()
    assert isinstance(h.attn, kvcache.ISWACache2026) and h.n_swa == 4 and h.swa_layers == (1, 3)
    assert h.attn.base.layers == () and h.attn.swa.layers == (1, 3) and h.attn.n_seq_max == 4
    # today's SWA cache: pad(min(kv_size, n_swa * n_seq_max + n_ubatch), 256); swa_full by default
    assert h.attn.size_base == 256 and h.attn.size_swa == 256 and h.attn.swa_full
    assert lfm2_swa(kv_size=1024, swa_full=False).attn.size_swa == 256
    assert h.attn.base.n_pad == h.attn.swa.n_pad == 1
    assert h.total_size == h.attn.total_size + h.recr.total_size
    assert "n_swa=4" in repr(h)
    # a window on some attention layers only: the others in the base cache
    g = lfm2_swa(swa_layers=[3])
    assert g.attn.base.layers == (1,) and g.attn.swa.layers == (3,) and g.swa_layers == (3,)
    with pytest.raises(ValueError, match="not attention layers"):
        lfm2_swa(swa_layers=[0])
    with pytest.raises(ValueError, match="without a sliding window"):
        lfm2_swa(n_swa=0, swa_layers=[1])
    plain = lfm2_swa(n_swa=0)
    assert isinstance(plain.attn, kvcache.UnifiedCache2026) and plain.n_swa == 0 and plain.swa_layers == ()


def test_decode_positions_and_rollback():
    h = lfm2_swa(n_rs_seq=2)
    decode(h, 0, 0, 10)
    decode(h, 0, 10, 3)
    assert counts(h) == (13, 13, 1)
    # the recurrent part holds the last position, the SWA cache the window's: their intersection
    assert (h.seq_pos_min(0), h.seq_pos_max(0)) == (12, 12)
    assert h.attn.seq_pos_min(0) == h.attn.swa.seq_pos_min(0) == 0
    before = counts(h)
    assert h.seq_rm(0, 2, 5) is False and counts(h) == before, "a cut inside the state changes nothing"
    assert h.rollback_ok(0, 2) and h.seq_rm(0, 11, -1)
    assert (h.seq_pos_max(0), h.attn.base.seq_pos_max(0), h.attn.swa.seq_pos_max(0)) == (10, 10, 10)
    assert h.seq_rm(0) and counts(h) == (0, 0, 0)


def test_find_slot_in_all_or_none():
    # the base cache full first (kv_size 8 < the SWA cache's 256): nothing placed anywhere
    h = lfm2_swa(kv_size=8)
    decode(h, 0, 0, 6)
    state = h.state_write()
    assert not h.find_slot(kvcache.UBatch([0, 1, 2], [1], n_seq_tokens=3))
    assert h.state_write() == state and counts(h) == (6, 6, 1)
    assert h.prepare([kvcache.UBatch([6, 7], [0], n_seq_tokens=2)]) is not None
    assert h.prepare([kvcache.UBatch([6, 7, 8], [0], n_seq_tokens=3)]) is None
    assert h.state_write() == state
    # the recurrent part refuses (no cell for a fifth sequence): nothing placed either
    with pytest.raises(ValueError):
        h.find_slot(kvcache.UBatch([0], [4]))
    assert h.state_write() == state


def test_seq_ops_to_all_three():
    h = lfm2_swa()
    decode(h, 0, 0, 5)
    h.seq_cp(0, 1)
    assert h.seq_pos_max(1) == 4 and h.attn.base.seq_pos_max(1) == h.attn.swa.seq_pos_max(1) == 4
    h.seq_add(1, 0, -1, 3)
    assert (h.attn.base.seq_pos_max(0), h.attn.swa.seq_pos_max(0), h.recr.seq_pos_max(0)) == (7, 7, 7)
    h.seq_div(1, 0, -1, 2)
    assert (h.attn.base.seq_pos_max(1), h.attn.swa.seq_pos_max(1), h.recr.seq_pos_max(1)) == (3, 3, 3)
    h.seq_keep(1)
    assert h.seq_pos_max(0) == -1 and h.attn.swa.seq_pos_min(1) == 1
    h.clear()
    assert counts(h) == (0, 0, 0)
    # a copy across streams the attention part refuses: nothing changed in any part
    g = lfm2_swa(kv_unified=False)
    decode(g, 0, 0, 5)
    state = g.state_write()
    with pytest.raises(ValueError):
        g.seq_cp(0, 1, 0, 2)
    assert g.state_write() == state


def test_masks_and_indices_of_both_caches():
    h = lfm2_swa()
    decode(h, 0, 0, 9)
    ub = kvcache.UBatch([9], [0])
    assert h.find_slot(ub)
    base, swa = h.kq_mask(ub)
    want = h.attn.kq_mask(ub)
    assert np.array_equal(base, want[0]) and np.array_equal(swa, want[1])
    # the query at 9 sees 0..9 in the base cache, the last 4 positions through the window
    assert np.isfinite(base[0, 0, :10]).all() and np.isfinite(swa[0, 0, :10]).sum() == 4
    ib, isw = h.attention_indices(ub)
    assert sorted(ib.kv_indices.tolist()) == list(range(10)) and len(isw.kv_indices) == 4
    with pytest.raises(ValueError, match="reuse"):
        h.kq_mask(ub, reuse=True)


def test_state_layout_and_refusals():
    h = lfm2_swa(swa_layers=[3])
    decode(h, 0, 0, 12)
    decode(h, 2, 0, 5)
    # llama.cpp's order: the iSWA pair's state (base, then SWA), then the recurrent part's
    for s in (0, 2):
        blob = h.state_write(s)
        assert blob == h.attn.state_write(s) + h.recr.state_write(s, prefix=False)
        part = h.state_write(s, partial_only=True)
        assert part == h.attn.swa.state_write(s) + h.recr.state_write(s, prefix=False)
        assert len(part) == h.state_size(s, partial_only=True) and len(blob) == h.state_size(s)
    assert h.state_write() == h.attn.state_write() + h.recr.state_write()
    # the SWA cache's part leaves out the cells outside the window (layout "2026")
    swa_cells = int.from_bytes(h.attn.swa.state_write(0, prefix=False)[4:8], "little")
    assert swa_cells == 4
    # a failed read names the cache and changes none of the three
    g = lfm2_swa(swa_layers=[3])
    decode(g, 1, 0, 3)
    before = g.state_write()
    blob = h.state_write(0)
    cut = 8 + len(h.attn.base.state_write(0, prefix=False)) + 10
    with pytest.raises(kvcache.StateError, match="SWA cache"):
        g.state_read(blob[:cut], 0)
    assert g.state_write() == before
    plain = lfm2_swa(n_swa=0, swa_layers=None)
    with pytest.raises(kvcache.StateError):
        plain.state_read(blob, 0, exact=True)


def test_prefix_reuse_in_both_parts():
    """Prefix reuse turns on in the iSWA pair and the recurrent part together (the hits:
    tests/test_prefix_reuse_recurrent.py)."""
    h = lfm2_swa(swa_full=False)
    h.enable_prefix_reuse(checkpoints=2)
    assert h.prefix_reuse and h.attn.prefix_reuse and h.recr.prefix_reuse
    assert set(h.prefix_stats["attn"]) == {"base", "swa"} and h.prefix_match([1, 2, 3]) == 0
    h.disable_prefix_reuse()
    assert not (h.prefix_reuse or h.attn.prefix_reuse or h.recr.prefix_reuse)
    with pytest.raises(RuntimeError, match="prefix reuse is off"):
        h.prefix_attach(0, [1, 2, 3])


def test_handoff_carries_all_three():
    from kvcache.handoff import copy_regions

    src = lfm2_swa(swa_layers=[3])
    decode(src, 0, 0, 11)
    dst = lfm2_swa(swa_layers=[3])
    decode(dst, 1, 0, 4)
    other = dst.state_write(1)
    x = src.seq_export(0)
    with dst.seq_import_begin(x.header, 2) as imp:
        with pytest.raises(RuntimeError):
            dst.seq_rm(1)
        copy_regions(x.regions, imp.regions)
        imp.commit()
    want = lfm2_swa(swa_layers=[3])
    want.state_read(src.state_write(0), 2)
    assert dst.state_write(2) == want.state_write(2) and dst.state_write(1) == other


def _lfm2_gguf(path, arch="lfm2", window=4):
    """The metadata of a 4-layer LFM2 (layers 0 and 2 short convolutions) with a window."""
    from conftest import need_module

    gguf = need_module("test", "gguf")
    w = gguf.GGUFWriter(str(path), arch)
    w.add_uint32(f"{arch}.block_count", 4)
    w.add_uint32(f"{arch}.embedding_length", 64)
    w.add_uint32(f"{arch}.context_length", 1024)
    w.add_uint32(f"{arch}.attention.head_count", 4)
    w.add_array(f"{arch}.attention.head_count_kv", [0, 2, 0, 2])
    w.add_uint32(f"{arch}.shortconv.l_cache", 3)
    w.add_uint32(f"{arch}.attention.sliding_window", window)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_swa_full_default_is_llama_cpps(tmp_path):
    """Every constructor of a cache with a SWA cache takes swa_full=None as its semantics'
    default: today's True (llama_context_default_params, which llama-cpp-python's Llama leaves
    as it is), the 2025 semantics' False."""
    from kvcache._core import swa_full_arg
    from kvcache.plan import plan_hybrid, plan_iswa

    assert (swa_full_arg(None, "2026"), swa_full_arg(None, "2025")) == (True, False)
    assert swa_full_arg(False, "2026") is False and swa_full_arg(True, "2025") is True
    with pytest.raises(TypeError, match="swa_full"):
        swa_full_arg("yes", "2026")
    assert lfm2_swa().attn.swa_full and lfm2_swa(swa_full=None).attn.swa_full
    assert not lfm2_swa(swa_full=False).attn.swa_full
    path = _lfm2_gguf(tmp_path / "lfm2.gguf")
    assert kvcache.from_gguf(path, 512, semantics="2026").attn.swa_full
    assert plan_hybrid(512, 4, [0, 2], 32, 32, 128, n_swa=4).sizing["swa_full"] is True
    iswa = dict(kv_size=256, n_layer=2, n_embd_k_gqa=8, n_embd_v_gqa=8, swa_layers=[0], n_swa=4)
    assert kvcache.ISWACache(**iswa, semantics="2026").swa_full
    assert not kvcache.ISWACache(**iswa).swa_full
    assert plan_iswa(256, 2, 8, swa_layers=[0], n_swa=4, semantics="2026").sizing["swa_full"] is True
    assert plan_iswa(256, 2, 8, swa_layers=[0], n_swa=4).sizing["swa_full"] is False
    try:    # the 0.3.36 bindings where they are installed
        import llama_cpp
    except ImportError:
        return
    assert llama_cpp.llama_context_default_params().swa_full is True


def test_from_gguf_and_plan(tmp_path, capsys):
    from kvcache import cli
    from kvcache.plan import plan_hybrid

    path = _lfm2_gguf(tmp_path / "lfm2.gguf")
    g = kvcache.read_gguf(path)
    assert (g.n_swa, g.swa_type, g.swa_layers, g.attn_layers) == (4, "standard", (1, 3), (1, 3))
    h = kvcache.from_gguf(path, 512, n_seq_max=2, semantics="2026", n_batch=64, swa_full=False, kv_unified=True)
    assert isinstance(h.attn, kvcache.ISWACache2026) and (h.n_swa, h.swa_layers) == (4, (1, 3))
    assert (h.attn.size_base, h.attn.size_swa, h.attn.n_batch) == (512, 256, 64)
    # LFM2-MoE's loader reads no window: the key changes nothing there
    moe = kvcache.read_gguf(_lfm2_gguf(tmp_path / "moe.gguf", arch="lfm2moe"))
    assert moe.n_swa == 0 and moe.swa_layers == ()
    # the plan: the pair's lines, then the recurrent memory's
    p = plan_hybrid(512, 4, [0, 2], 32, 32, 128, n_seq_max=2, n_swa=4, n_batch=64, swa_full=False)
    assert [c.name for c in p.caches] == ["base", "swa", "recurrent"] and p.total_bytes == h.total_size
    assert p.cache("base").layers == () and [lp.il for lp in p.cache("swa").layers] == [1, 3]
    assert p.llama_log[0] == "llama_kv_cache_iswa: creating non-SWA KV cache, size = 512 cells"
    assert cli.main(["plan", str(path), "--n-ctx", "512", "--n-seq-max", "2", "--semantics", "2026",
                     "--no-swa-full", "--n-ubatch", "64"]) == 0
    out = capsys.readouterr().out
    assert "iSWA pair" in out and "window 4" in out
