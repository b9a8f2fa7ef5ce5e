"""The prefix store with caches other than a plain unified one (docs/store.md, "Which caches"):
iSWA (the base cache's rows of every chunk, the SWA cache's window before a chunk's end),
recurrent (the state at a chunk's end), hybrid (both), hybrid with a sliding window (the window
and the state), and cells with 2-D positions. Exact rows
back, a damaged part is a miss that changes nothing, a directory of another kind is refused;
tiny transformers models (Gemma2, Mamba, LFM2 with and without a window) get the next-token logits of recomputation from
a prefix loaded back from the store."""
import os

import numpy as np
import pytest

import kvcache
from kvcache import HybridCache, RecurrentCache, StateError, UBatch
from kvcache.store import PrefixStore, StoreError, read_meta
from lfm2_model import lfm2_chunk

C = 8


def rows(n, width, seed, scale=1.0):
    return (np.arange(n * width, dtype=np.float32).reshape(n, width) * 1e-3 + seed * scale)


def iswa(swa_full=False, n_swa=6, semantics="2026", **kw):
    return kvcache.ISWACache(512, 3, 16, 16, swa_layers=[1], n_swa=n_swa, type_k="f32", type_v="f32",
                             v_trans=False, n_seq_max=2, n_batch=8, swa_full=swa_full, semantics=semantics, **kw)


def fill_iswa(c, s, toks, p0=0, step=8):
    for a in range(p0, p0 + len(toks), step):
        b = min(a + step, p0 + len(toks))
        ub = UBatch(list(range(a, b)), [s] * (b - a), tokens=toks[a - p0:b - p0])
        assert c.find_slot(ub)
        for il in range(3):
            c.store(il, rows(b - a, 16, 1000 * s + a + il * 0.5), -rows(b - a, 16, 1000 * s + a + il * 0.5))
        if hasattr(c, "commit"):
            c.commit()


def part_rows(part, s):
    cells, pos = part.seq_cells(s)
    o = np.argsort(pos)
    return pos[o], [(np.array(part.k(il))[cells[o]], np.array(part.v(il))[cells[o]]) for il in part.layers]


def snapshot(c):
    parts = [c.base, c.swa] if hasattr(c, "base") else [c.attn] if hasattr(c, "attn") else [c]
    out = []
    for p in parts:
        if hasattr(p, "seq_cells"):
            out.append(p.cells())
        else:
            out.append([p.seq_pos_max(s) for s in range(p.n_seq_max)])
    if hasattr(c, "recr"):
        out.append([c.recr.seq_pos_max(s) for s in range(c.n_seq_max)])
    return out


@pytest.mark.parametrize("semantics", ["2025", "2026"])
def test_iswa_round_trip_keeps_base_rows_and_the_window(tmp_path, semantics):
    small = semantics == "2026"                     # 2025 prunes with the ranges of its own batch split
    src = iswa(semantics=semantics, swa_full=not small)
    toks = list(range(1, 303))                      # 37 whole chunks and 6 tokens: more than the SWA cache (256)
    fill_iswa(src, 0, toks)
    st = PrefixStore(src, tmp_path / "st", chunk_tokens=C)
    assert st.geometry.kind == "iswa" and st.geometry.version == 2
    assert read_meta(tmp_path / "st")["version"] == 2
    got = st.save(src, 0, toks)
    N = 296
    assert got == N                                # the last chunk's window is still held
    for where in ("host", "disk"):
        s2 = st if where == "host" else PrefixStore(src, tmp_path / "st", chunk_tokens=C)
        dst = iswa(semantics=semantics, swa_full=not small)
        assert s2.match(toks) == N
        assert s2.load(dst, 1, toks) == N
        pos, want = part_rows(src.base, 0)
        pos2, have = part_rows(dst.base, 1)
        assert list(pos2) == list(range(N))
        for (k1, v1), (k2, v2) in zip(want, have):
            np.testing.assert_array_equal(k1[:N], k2)
            np.testing.assert_array_equal(v1[:N], v2)
        wpos, wrows = part_rows(dst.swa, 1)
        assert list(wpos) == list(range(N - 6 + 1, N))     # what a query at N sees
        spos, srows = part_rows(src.swa, 0)
        sel = np.searchsorted(spos, wpos)
        np.testing.assert_array_equal(srows[0][0][sel], wrows[0][0])
        np.testing.assert_array_equal(srows[0][1][sel], wrows[0][1])
        assert dst.seq_pos_max(1) == N - 1
    # a chunk end is a usable prefix exactly when the SWA cache still held its window at the save
    held = set(src.swa.seq_cells(0)[1].tolist())
    for p in range(C, N + 1, C):
        usable = all(q in held for q in range(p - 6 + 1, p))
        assert st.match(toks[:p]) == (p if usable else 0)
    assert not small or st.match(toks[:8]) == 0     # a small SWA cache overwrote the first windows


def test_iswa_with_a_full_swa_cache_keeps_every_window():
    src = iswa(swa_full=True)
    toks = list(range(1, 33))
    fill_iswa(src, 0, toks, step=32)
    st = PrefixStore(src, chunk_tokens=C)
    assert st.save(src, 0, toks) == 32
    for n in (8, 16, 24, 32):
        assert st.match(toks[:n]) == n
    dst = iswa(swa_full=True)
    assert st.load(dst, 0, toks[:17]) == 16
    assert list(part_rows(dst.swa, 0)[0]) == list(range(11, 16))


def rec(checkpoints=8, **kw):
    c = RecurrentCache(2, 2, 6, 4, type_k="f32", type_v="f32", semantics="2026", **kw)
    c.enable_prefix_reuse(checkpoints=checkpoints)
    return c


def run_rec(c, s, toks, a, b):
    assert c.find_slot(UBatch(list(range(a, b)), [s], n_seq_tokens=b - a))
    for il in range(2):
        c.store(il, rows(1, 6, sum(toks[:b]) + il), rows(1, 4, -b - il))


def test_recurrent_states_at_chunk_ends(tmp_path):
    c = rec()
    toks = list(range(3, 3 + 20))
    run_rec(c, 0, toks, 0, 8)
    assert c.checkpoint(0, toks) == 8
    run_rec(c, 0, toks, 8, 16)
    assert c.checkpoint(0, toks) == 16
    want16 = [(np.array(c.k(il)[c.seq_cells(0)[0]]) if hasattr(c, "seq_cells") else None) for il in range(2)]
    run_rec(c, 0, toks, 16, 20)
    st = PrefixStore(c, tmp_path / "st", chunk_tokens=C)
    assert st.geometry.kind == "recurrent"
    assert st.save(c, 0, toks) == 16                # the states after 8 and 16 tokens (20: no chunk end)
    assert st.match(toks) == 16 and st.match(toks[:12]) == 8
    d = rec()
    d2 = PrefixStore(d, tmp_path / "st", chunk_tokens=C)
    assert d2.load(d, 1, toks, max_tokens=19) == 16
    assert d.seq_pos_max(1) == 15
    # the state after 16 tokens, exactly: the checkpoint's bytes
    assert d._store_state(1) == (16, c._store_checkpoint(toks[:16]))
    with pytest.raises(ValueError, match="holds a state"):
        d2.load(d, 1, toks)
    del want16


def test_recurrent_own_state_at_a_chunk_end_and_without_reuse():
    c = RecurrentCache(2, 2, 6, 4, type_k="f32", type_v="f32", semantics="2026")   # no checkpoints
    toks = list(range(1, 17))
    run_rec(c, 0, toks, 0, 16)
    st = PrefixStore(c, chunk_tokens=C)
    assert st.save(c, 0, toks) == 16                # the sequence's own state, after 16 tokens
    assert st.match(toks[:15]) == 0                 # the state after 8 was never taken
    d = RecurrentCache(2, 2, 6, 4, type_k="f32", type_v="f32", semantics="2026")
    assert st.load(d, 0, toks) == 16
    assert d._store_state(0) == c._store_state(0)


def hyb(**kw):
    h = HybridCache(64, 4, [0, 2], 8, 8, 12, 4, n_seq_max=2, type_k="f32", type_v="f32", v_trans=False, **kw)
    h.enable_prefix_reuse(checkpoints=8)
    return h


def run_hyb(h, s, toks, a, b):
    assert h.find_slot(UBatch(list(range(a, b)), [s], n_seq_tokens=b - a, tokens=toks[a:b]))
    for il in (1, 3):
        h.store(il, rows(b - a, 8, a + il), -rows(b - a, 8, a + il))
    for il in (0, 2):
        h.store_state(il, rows(1, 12, sum(toks[:b]) + il), rows(1, 4, b))


def test_hybrid_rows_and_the_state_at_a_chunk_end(tmp_path):
    h = hyb()
    toks = list(range(5, 25))
    run_hyb(h, 0, toks, 0, 8)
    assert h.checkpoint(0, toks) == 8
    run_hyb(h, 0, toks, 8, 20)
    st = PrefixStore(h, tmp_path / "st", chunk_tokens=C)
    assert st.geometry.kind == "hybrid"
    assert st.save(h, 0, toks) == 8                 # rows of 16 tokens, a state after 8 only
    assert st.match(toks) == 8
    g = hyb()
    assert PrefixStore(g, tmp_path / "st", chunk_tokens=C).load(g, 1, toks) == 8
    assert g.seq_pos_max(1) == 7 and g.attn.seq_pos_max(1) == 7
    pos, want = part_rows(h.attn, 0)
    _, have = part_rows(g.attn, 1)
    for (k1, v1), (k2, v2) in zip(want, have):
        np.testing.assert_array_equal(k1[:8], k2)
        np.testing.assert_array_equal(v1[:8], v2)
    assert g.recr._store_state(1) == (8, h.recr._store_checkpoint(toks[:8]))


def test_hybrid_attach_and_release_through_the_store():
    h = hyb()
    toks = list(range(5, 21))
    run_hyb(h, 0, toks, 0, 8)
    h.checkpoint(0, toks)
    run_hyb(h, 0, toks, 8, 16)
    st = PrefixStore(h, chunk_tokens=C)
    st.release(h, 0, toks)                          # saved (a state after 8 and after 16), then released
    h.prefix_evict(n_cells=64, n_checkpoints=8)     # the cache forgets: the store has it
    assert h.prefix_match(toks + [1]) == 0
    assert st.attach(h, 1, toks + [1]) == 16
    h._prefix_check()


def whyb(swa_full=True):
    """The toy hybrid with a sliding window of 4 on its attention layers (all in the SWA cache)."""
    return hyb(n_swa=4, n_batch=8, swa_full=swa_full)


@pytest.mark.parametrize("swa_full", [True, False])
def test_windowed_hybrid_keeps_the_window_and_the_state(tmp_path, swa_full):
    h = whyb(swa_full)
    toks = list(range(5, 25))
    run_hyb(h, 0, toks, 0, 8)
    assert h.checkpoint(0, toks) == 8
    run_hyb(h, 0, toks, 8, 16)
    st = PrefixStore(h, tmp_path / "st", chunk_tokens=C)
    g = st.geometry
    assert (g.kind, g.layers, len(g.swa_layers), g.n_swa) == ("hybrid_iswa", (), 2, 4)
    assert "hybrid_iswa cache" in g.describe() and "SWA layers" in g.describe()
    assert st.save(h, 0, toks) == 16                # the window and the state after 8 and after 16
    names = sorted(os.path.splitext(f)[1] for _, _, fs in os.walk(tmp_path / "st" / "chunks") for f in fs)
    assert names == [".kve", ".kve", ".kvs", ".kvs"]     # the base cache holds no layer: no rows
    assert st.match(toks[:15]) == 8 and st.match(toks) == 16
    d = whyb(swa_full)
    assert PrefixStore(d, tmp_path / "st", chunk_tokens=C).load(d, 1, toks) == 16
    assert d.seq_pos_max(1) == 15 and d.attn.base.seq_pos_max(1) == 15
    pos, want = part_rows(h.attn.swa, 0)
    wpos, have = part_rows(d.attn.swa, 1)
    assert wpos.tolist() == [13, 14, 15]            # the window a query at 16 sees
    sel = np.searchsorted(pos, wpos)
    for (k1, v1), (k2, v2) in zip(want, have):
        np.testing.assert_array_equal(k1[sel], k2)
        np.testing.assert_array_equal(v1[sel], v2)
    assert d.recr._store_state(1) == h.recr._store_state(0)
    with pytest.raises(ValueError, match="loads into an empty sequence"):
        PrefixStore(d, tmp_path / "st", chunk_tokens=C).load(d, 1, toks)
    with pytest.raises(StoreError, match="at= is refused"):
        PrefixStore(d, tmp_path / "st", chunk_tokens=C).load(d, 0, toks, at=4)
    with pytest.raises(StoreError, match="not the store's"):
        st.save(hyb(), 0, toks)                     # the same hybrid without a window
    with pytest.raises(StoreError, match="another geometry"):
        PrefixStore(hyb(), tmp_path / "st", chunk_tokens=C)


def test_the_command_line_reports_a_store_of_parts(tmp_path):
    from kvcache.cli.store import report

    h = hyb()
    toks = list(range(5, 21))
    run_hyb(h, 0, toks, 0, 8)
    h.checkpoint(0, toks)
    run_hyb(h, 0, toks, 8, 16)
    assert PrefixStore(h, tmp_path / "st", chunk_tokens=C).save(h, 0, toks) == 16
    r = report(str(tmp_path / "st"))
    assert (r["chunks"], r["end_parts"], r["prompts"], r["tokens"]) == (2, 2, 1, 16)
    assert r["geometry"].startswith("hybrid cache")


@pytest.mark.parametrize("kind", ["iswa", "recurrent", "hybrid", "hybrid_iswa"])
def test_a_damaged_part_is_a_miss_and_changes_nothing(tmp_path, kind):
    toks = list(range(1, 17))
    if kind == "iswa":
        src, dst = iswa(swa_full=True), iswa(swa_full=True)
        fill_iswa(src, 0, toks, step=16)
    elif kind == "recurrent":
        src, dst = rec(), rec()
        run_rec(src, 0, toks, 0, 8)
        src.checkpoint(0, toks)
        run_rec(src, 0, toks, 8, 16)
    else:
        src, dst = (hyb(), hyb()) if kind == "hybrid" else (whyb(), whyb())
        run_hyb(src, 0, toks, 0, 8)
        src.checkpoint(0, toks)
        run_hyb(src, 0, toks, 8, 16)
    PrefixStore(src, tmp_path / "st", chunk_tokens=C).save(src, 0, toks)
    st = PrefixStore(dst, tmp_path / "st", chunk_tokens=C, promote=False)
    keys = st.keys(toks)
    part = {"iswa": 0, "hybrid_iswa": 2}.get(kind, 1)    # the windowed hybrid: chunk 1's state
    victim = st._file(keys[1], part)
    data = bytearray(open(victim, "rb").read())
    data[len(data) // 2] ^= 0x40
    open(victim, "wb").write(bytes(data))
    with open(st._file(keys[0], 1), "r+b") as f:       # and the first chunk's end part cut short
        f.truncate(os.path.getsize(st._file(keys[0], 1)) - 3)
    before = snapshot(dst)
    assert st.load(dst, 1, toks) == 0                  # chunk 1 corrupt, chunk 0 truncated: a miss
    assert snapshot(dst) == before
    assert not os.path.exists(victim) and st.stats["corrupt_removed"] == 2
    assert st.stats["misses"] == 1


def test_another_kind_or_geometry_is_refused(tmp_path):
    PrefixStore(iswa(), tmp_path / "st", chunk_tokens=C)
    with pytest.raises(StoreError, match="another geometry"):
        PrefixStore(iswa(n_swa=4), tmp_path / "st", chunk_tokens=C)
    with pytest.raises(StoreError, match="another geometry"):
        PrefixStore(rec(), tmp_path / "st", chunk_tokens=C)
    with pytest.raises(StoreError, match="another geometry"):
        PrefixStore(kvcache.UnifiedCache(256, 3, 16, 16, type_k="f32", type_v="f32", v_trans=False,
                                         semantics="2026"), tmp_path / "st", chunk_tokens=C)
    st = PrefixStore(iswa(), chunk_tokens=C)
    with pytest.raises(StoreError, match="not the store's"):
        st.save(hyb(), 0, list(range(8)))
    with pytest.raises(StoreError, match="not the store's"):
        st.load(iswa(n_swa=4), 0, list(range(8)))


def ext_cache():
    return kvcache.UnifiedCache(64, 2, 4, 4, type_k="f32", type_v="f32", v_trans=False, n_seq_max=2,
                                semantics="2026", cell_ext=True)


def test_cells_with_2d_positions_keep_them(tmp_path):
    c = ext_cache()
    toks = list(range(1, 17))
    xs, ys = [t % 5 for t in toks], [t // 5 for t in toks]
    assert c.find_slot(UBatch(list(range(16)), [0] * 16, tokens=toks, pos_x=xs, pos_y=ys))
    for il in range(2):
        c.store(il, rows(16, 4, il), -rows(16, 4, il))
    st = PrefixStore(c, tmp_path / "st", chunk_tokens=C)
    assert st.geometry.ext and st.geometry.version == 2
    assert st.save(c, 0, toks) == 16
    assert st.match(toks) == 0                          # other 2-D positions: other chunks
    assert st.match(toks, pos_x=xs, pos_y=ys) == 16
    d = ext_cache()
    assert PrefixStore(d, tmp_path / "st", chunk_tokens=C).load(d, 1, toks, pos_x=xs, pos_y=ys) == 16
    cells, pos = d.seq_cells(1)
    o = np.argsort(pos)
    ext = d.cells().ext[cells[o]]
    assert ext[:, 0].tolist() == xs and ext[:, 1].tolist() == ys and ext[:, 2].tolist() == \
        c.cells().ext[c.seq_cells(0)[0][np.argsort(c.seq_cells(0)[1])]][:, 2].tolist()
    np.testing.assert_array_equal(np.array(d.k(1))[cells[o]], rows(16, 4, 1))
    with pytest.raises(StoreError, match="cell_ext"):
        PrefixStore(kvcache.UnifiedCache(64, 2, 4, 4, type_k="f32", type_v="f32", v_trans=False,
                                         semantics="2026"), chunk_tokens=C).save(c, 0, toks)


# --- real models ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def torch_tf():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    return torch, transformers


def _layers_kv(past):
    out = []
    for layer in past.layers:
        k, v = layer.keys[0], layer.values[0]
        out.append((k.transpose(0, 1).reshape(k.shape[1], -1).numpy(),
                    v.transpose(0, 1).reshape(v.shape[1], -1).numpy()))
    return out


def test_gemma2_prefix_from_the_store_gives_the_logits_of_recomputation(tmp_path, torch_tf):
    """Gemma2's sliding layers in a small SWA cache (swa_full=False): a prompt's chunks saved,
    the cache dropped, the prefix loaded from the directory into a fresh cache; the next tokens
    computed over the loaded rows (the sliding layers' rows before the window filled with noise)
    give the logits of recomputation."""
    torch, transformers = torch_tf
    torch.manual_seed(0)
    w = 8
    cfg = transformers.Gemma2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                    max_position_embeddings=512, sliding_window=w, query_pre_attn_scalar=16)
    model = transformers.Gemma2ForCausalLM(cfg).eval().to(torch.float32)
    sliding = [il for il, t in enumerate(cfg.layer_types) if t == "sliding_attention"]
    h, d = cfg.num_key_value_heads, cfg.head_dim

    def make():
        c = kvcache.ISWACache(512, cfg.num_hidden_layers, h * d, h * d, swa_layers=sliding, n_swa=w, type_k="f32",
                              type_v="f32", v_trans=False, n_seq_max=2, n_batch=8, swa_full=False, semantics="2026")
        c.enable_prefix_reuse()
        return c

    c = make()
    g = torch.Generator().manual_seed(1)
    first = torch.randint(0, cfg.vocab_size, (100,), generator=g).tolist()
    second = first[:96] + torch.randint(0, cfg.vocab_size, (5,), generator=g).tolist()
    with torch.no_grad():
        kv = _layers_kv(model(torch.tensor([first]), cache=transformers.DynamicCache(), use_cache=True).past_key_values)
    for a in range(0, len(first), 8):
        b = min(a + 8, len(first))
        assert c.find_slot(UBatch(list(range(a, b)), [0] * (b - a), tokens=first[a:b]))
        for il, (k, v) in enumerate(kv):
            c.store(il, k[a:b], v[a:b])
    st = PrefixStore(c, tmp_path / "st", chunk_tokens=16)
    assert st.release(c, 0, first) == len(first)
    del c                                               # the process ends: only the directory remains

    c = make()
    st = PrefixStore(c, tmp_path / "st", chunk_tokens=16)
    n = st.attach(c, 1, second)
    assert n == 96 and st.stats["disk_hits"] > 0
    past = transformers.DynamicCache()
    for il in range(cfg.num_hidden_layers):
        part = c.swa if il in sliding else c.base
        cells, pos = part.seq_cells(1)
        k = torch.randn(n, h * d, generator=g) * 100
        v = torch.randn(n, h * d, generator=g) * 100
        k[torch.from_numpy(pos.astype(np.int64))] = torch.from_numpy(np.asarray(part.k(il))[cells])
        v[torch.from_numpy(pos.astype(np.int64))] = torch.from_numpy(np.asarray(part.v(il))[cells])
        past.update(k.reshape(n, h, d).transpose(0, 1)[None].contiguous(),
                    v.reshape(n, h, d).transpose(0, 1)[None].contiguous(), il)
    with torch.no_grad():
        reused = model(torch.tensor([second[n:]]), cache=past, use_cache=True,
                       position_ids=torch.arange(n, len(second))[None], cache_position=torch.arange(n, len(second)))
        scratch = model(torch.tensor([second]))
    torch.testing.assert_close(reused.logits[0, -1], scratch.logits[0, -1], rtol=1e-5, atol=1e-5)


def test_mamba_state_from_the_store_gives_the_logits_of_recomputation(tmp_path, torch_tf):
    """A tiny Mamba whose states live in a RecurrentCache: states checkpointed at chunk ends,
    saved, the cache dropped; a request loaded from the store gets bit for bit the logits of the
    same request computed from scratch in the same chunks."""
    torch, transformers = torch_tf
    torch.manual_seed(0)
    cfg = transformers.MambaConfig(vocab_size=40, hidden_size=16, state_size=4, num_hidden_layers=2, conv_kernel=4,
                                   expand=2, use_mambapy=False)
    model = transformers.MambaForCausalLM(cfg).eval()
    di = cfg.intermediate_size

    def make():
        c = RecurrentCache(2, cfg.num_hidden_layers, di * cfg.conv_kernel, di * cfg.state_size, type_k="f32",
                           type_v="f32", semantics="2026")
        c.enable_prefix_reuse(checkpoints=4)
        return c

    def chunk(c, s, tokens, start, end):
        assert c.find_slot(UBatch(list(range(start, end)), [s], n_seq_tokens=end - start))
        plane, cell = divmod(int(c.s_copy()[0]), c.size)
        cache = transformers.DynamicCache(config=cfg)
        if not (plane == 0 and cell == c.rs_z):
            for il, layer in enumerate(cache.layers):
                conv = torch.from_numpy(np.array(c.k(il, plane)[cell])).reshape(1, di, cfg.conv_kernel)
                ssm = torch.from_numpy(np.array(c.v(il, plane)[cell])).reshape(1, di, cfg.state_size)
                layer.lazy_initialization(conv_states=conv, recurrent_states=ssm)
                layer.conv_states[0].copy_(conv)
                layer.recurrent_states[0].copy_(ssm)
                layer.has_previous_state[0] = True
                layer.cumulative_length_linear.fill_(start)
        with torch.no_grad():
            out = model(torch.tensor([tokens[start:end]]), cache=cache, use_cache=True)
        for il, layer in enumerate(cache.layers):
            c.store(il, layer.conv_states[0].reshape(1, -1).numpy(), layer.recurrent_states[0].reshape(1, -1).numpy())
        return out.logits[0, -1]

    a = [3, 5, 7, 9, 11, 13, 2, 4, 6, 8, 10, 12, 14, 16]
    c = make()
    chunk(c, 0, a, 0, 4)
    c.checkpoint(0, a)
    chunk(c, 0, a, 4, 8)
    c.checkpoint(0, a)
    chunk(c, 0, a, 8, len(a))
    PrefixStore(c, tmp_path / "st", chunk_tokens=4).release(c, 0, a)
    c = make()
    st = PrefixStore(c, tmp_path / "st", chunk_tokens=4)
    b = a[:10] + [21, 22, 23]
    assert st.attach(c, 1, b) == 8
    got = chunk(c, 1, b, 8, len(b))
    cache = transformers.DynamicCache(config=cfg)
    with torch.no_grad():
        for x, y in ((0, 4), (4, 8), (8, len(b))):
            want = model(torch.tensor([b[x:y]]), cache=cache, use_cache=True).logits[0, -1]
    assert torch.equal(got, want)


@pytest.mark.parametrize("n_swa,swa_full", [(0, False), (4, True), (4, False)])
def test_lfm2_prefix_from_the_store_gives_the_logits_of_recomputation(tmp_path, torch_tf, n_swa, swa_full):
    """A tiny LFM2 whose attention K/V and convolution states live in a HybridCache: a prompt
    saved (rows of every chunk, the state at the chunk end checkpointed), the cache dropped, the
    prefix loaded from the directory: bit for bit the logits of recomputation in the same chunks.
    With a sliding window of 4 (the attention part an iSWA pair whose base cache holds no layer)
    the store keeps the window before each chunk end instead of rows, and the recomputation is a
    fresh memory's."""
    torch, transformers = torch_tf
    from lfm2_model import tiny_lfm2

    torch.manual_seed(0)
    model, cfg = tiny_lfm2(transformers)
    width = cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads)
    window = dict(n_swa=n_swa, n_batch=8, swa_full=swa_full) if n_swa else {}

    def make():
        h = HybridCache(64, 4, [0, 2], width, width, cfg.hidden_size * cfg.conv_L_cache, 0, n_seq_max=2,
                        type_k="f32", type_v="f32", v_trans=False, **window)
        h.enable_prefix_reuse(checkpoints=4)
        return h

    def chunk(h, s, tokens, start, end):
        return lfm2_chunk(torch, transformers, model, cfg, h, s, tokens, start, end)

    a = [3, 5, 7, 9, 11, 13, 2, 4, 6, 8, 10, 12]
    h = make()
    for x, y in ((0, 4), (4, 8), (8, len(a))):
        chunk(h, 0, a, x, y)
        if y < len(a):
            h.checkpoint(0, a)
    PrefixStore(h, tmp_path / "st", chunk_tokens=4).release(h, 0, a)
    h = make()
    st = PrefixStore(h, tmp_path / "st", chunk_tokens=4)
    assert st.geometry.kind == ("hybrid_iswa" if n_swa else "hybrid")
    b = a[:10] + [21, 22]
    assert st.attach(h, 1, b) == 8
    got = chunk(h, 1, b, 8, len(b))
    fresh = make()
    cache = transformers.DynamicCache(config=cfg)
    with torch.no_grad():
        for x, y in ((0, 4), (4, 8), (8, len(b))):
            want = chunk(fresh, 0, b, x, y) if n_swa else \
                model(torch.tensor([b[x:y]]), cache=cache, use_cache=True).logits[0, -1]
    assert torch.equal(got, want)


# --- write-back at eviction ----------------------------------------------------------------------

def ufill(c, s, toks, seed):
    """Place toks at positions 0.. of s and store rows naming (seed, position, layer)."""
    n = len(toks)
    assert c.find_slot(UBatch(list(range(n)), [s] * n, tokens=toks))
    for il in c.layers:
        k = np.array([[seed * 1000 + p + il * 0.25 + j * 1e-3 for j in range(8)] for p in range(n)], np.float32)
        c.store(il, k, -k)


def useq(c, s):
    cells, pos = c.seq_cells(s)
    cells = cells[np.argsort(pos)]
    out = []
    for il in c.layers:
        v = np.asarray(c.v(il))
        out.append((np.array(c.k(il))[cells], (v[0][:, cells].T if c.v_trans else v[cells]).copy()))
    return sorted(pos.tolist()), out


@pytest.mark.parametrize("v_trans", [False, True])
def test_write_back_serves_a_prefix_the_index_evicted(tmp_path, v_trans):
    c = kvcache.UnifiedCache(64, 2, 8, 8, type_k="f32", type_v="f32", v_trans=v_trans, n_seq_max=2,
                             semantics="2026")
    c.enable_prefix_reuse()
    st = PrefixStore(c, tmp_path / "st", chunk_tokens=C)
    st.write_back(c)
    a = list(range(1, 38))                          # 4 whole chunks and 5 tokens
    ufill(c, 0, a, seed=1)
    _, want = useq(c, 0)
    assert c.prefix_release(0, a) == len(a)         # a plain release: the store has nothing yet
    assert st.match(a) == 0
    ufill(c, 1, list(range(100, 150)), seed=2)     # needs the room: the index evicts a's cells
    assert st.stats["evicted_saved"] == 4 and st.match(a) == 32
    assert c.prefix_match(a + [9]) < 32
    c.seq_rm(1, -1, -1)
    fresh = PrefixStore(c, tmp_path / "st", chunk_tokens=C)   # from the directory
    assert fresh.attach(c, 0, a + [9]) == 32
    pos, have = useq(c, 0)
    assert pos == list(range(32))
    for (k1, v1), (k2, v2) in zip(want, have):
        np.testing.assert_array_equal(k1[:32], k2)
        np.testing.assert_array_equal(v1[:32], v2)
    c._prefix_check()


def test_write_back_paths_salts_and_off():
    c = kvcache.UnifiedCache(64, 1, 8, 8, type_k="f32", type_v="f32", v_trans=False, n_seq_max=2, semantics="2026")
    c.enable_prefix_reuse()
    st = PrefixStore(c, chunk_tokens=C)
    st.write_back(c, salts=["t1"])
    ufill(c, 0, list(range(1, 17)), seed=1)
    c.prefix_release(0, salt="t1")
    ufill(c, 0, list(range(50, 66)), seed=2)
    c.prefix_release(0, salt="other")             # a salt the store does not know
    assert c.prefix_evict(64) == 32
    assert st.match(list(range(1, 17)), salt="t1") == 16
    assert st.stats["evicted_saved"] == 2 and st.stats["evicted_skipped"] == 1
    st.write_back(c, on=False)
    ufill(c, 0, list(range(70, 86)), seed=3)
    c.prefix_release(0)
    c.prefix_evict(64)
    assert st.match(list(range(70, 86))) == 0
    with pytest.raises(RuntimeError, match="prefix reuse is off"):
        st.write_back(kvcache.UnifiedCache(64, 1, 8, 8, type_k="f32", type_v="f32", v_trans=False,
                                           semantics="2026"))
    with pytest.raises(StoreError, match="not the store's"):
        other = kvcache.UnifiedCache(64, 2, 8, 8, type_k="f32", type_v="f32", v_trans=False, semantics="2026")
        other.enable_prefix_reuse()
        st.write_back(other)


def test_write_back_at_the_cap_of_a_release():
    c = kvcache.UnifiedCache(64, 1, 8, 8, type_k="f32", type_v="f32", v_trans=False, n_seq_max=2, semantics="2026")
    c.enable_prefix_reuse(cap=20)
    st = PrefixStore(c, chunk_tokens=C)
    st.write_back(c)
    a, b = list(range(1, 17)), list(range(40, 56))
    ufill(c, 0, a, seed=1)
    c.prefix_release(0)
    ufill(c, 0, b, seed=2)
    c.prefix_release(0)                           # past the cap: a goes, and is written back
    assert st.match(a) == 16 and st.match(b) == 0
