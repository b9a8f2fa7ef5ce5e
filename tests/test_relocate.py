"""Relocation of a range of positions (kvcache.relocate, PrefixStore.load(at=...); docs/store.md).

A chunk computed at positions 0 .. n-1 by a tiny transformers Llama (random weights) and moved to
37 .. 36 + n has, in every layer, the K a computation of the chunk at 37 gives (within the stated
tolerance: the rotation is rounded twice), its V, and the next token's logits; a move equals,
bit for bit, the cache's own K-shift of the same cells (seq_add + update); what cannot be moved is
refused and leaves the cache as it was."""
from __future__ import annotations


import numpy as np
import pytest

import kvcache
from kvcache import StateError, UBatch
from kvcache.relocate import SeqRange, get_range, set_range
from kvcache.store import PrefixStore, StoreError

AT = 37
# |K moved - K computed at 37| <= atol + rtol |K| (keys of magnitude < 1): f32 rows rotated twice in
# single precision (seen: 4e-7); f16 rows rounded to half precision before and after the rotation
# (seen: 5e-4, two half-precision steps). The next token's logits within LOGITS_TOL (seen: 1e-7, 3e-5).
TOL = {"f32": (1e-5, 1e-5), "f16": (2e-3, 2e-3)}
LOGITS_TOL = {"f32": 1e-5, "f16": 1e-3}


def _random_rows(c, n, seed=0):
    rng = np.random.default_rng(seed)
    for il in c.layers:
        k = rng.standard_normal((n, 64)).astype(np.float32)
        v = rng.standard_normal(k.shape).astype(np.float32)
        c.store(il, kvcache.quantize(k, "q8_0") if np.asarray(c.k(il)).dtype == np.uint8 else k, v)


def _cache(semantics="2026", v_trans=False, type_k="f32", type_v=None, size=64, rope=True, **kw):
    rp = kvcache.RopeParams(32, mode="neox") if rope else None
    return kvcache.UnifiedCache(size, 2, 64, 64, type_k=type_k, type_v=type_v or (type_k if type_k != "q8_0" else "f32"),
                                v_trans=v_trans, n_seq_max=2, semantics=semantics, n_embd_head_k=32, rope=rp, **kw)


def _fill(c, seq, pos, seed=0):
    assert c.find_slot(UBatch(list(pos), [seq] * len(pos)))
    _random_rows(c, len(pos), seed)
    if c.semantics == "2025":
        c.commit()


def _snapshot(c):
    """Everything a failed move must leave as it was: cells, head, and every K/V byte."""
    cells = c.cells() if c.n_stream == 1 else c.stream_cells()[0]
    mem = [np.asarray(c.k(il)).copy() for il in c.layers] + [np.asarray(c.v(il)).copy() for il in c.layers]
    return c.state_write(-1), c.head, cells.pos.copy(), cells.seq_mask.copy(), mem


def _same(a, b):
    assert a[0] == b[0] and a[1] == b[1]
    assert np.array_equal(a[2], b[2]) and np.array_equal(a[3], b[3])
    for x, y in zip(a[4], b[4]):
        assert np.array_equal(x.view(np.uint8), y.view(np.uint8))


# --- a move is the cache's own K-shift ------------------------------------------------------------

@pytest.mark.parametrize("semantics", ["2025", "2026"])
@pytest.mark.parametrize("v_trans", [False, True])
@pytest.mark.parametrize("type_k", ["f32", "f16", "q8_0"])
def test_a_move_equals_the_in_place_k_shift(semantics, v_trans, type_k):
    c = _cache(semantics, v_trans, type_k)
    _fill(c, 0, range(10))
    rng = get_range(c, 0, 2, 8)
    assert rng.n_tokens == 6 and rng.p0 == 2
    _fill(c, 1, range(5), seed=1)
    assert set_range(c, 1, rng, 5) == 6
    assert list(c.seq_cells(1)[1]) == list(range(11))
    moved = get_range(c, 1, 5, 11)
    shifted = _shifted_in_place(c, 3)
    for a, b in zip(moved.k, shifted.k):
        assert np.array_equal(a, b)
    for a, b, v0 in zip(moved.v, shifted.v, rng.v):
        assert np.array_equal(a, b) and np.array_equal(a, v0)


def _shifted_in_place(c, delta):
    """Positions 2 .. 7 of sequence 0 (of 0 .. 9) moved by delta in place: seq_add queues the
    shift, update() rotates K with the cache's RoPE."""
    c.seq_rm(0, 8, 10)
    c.seq_rm(0, 0, 2)
    c.seq_add(0, 2, 8, delta)
    c.update()
    return get_range(c, 0, 2 + delta, 8 + delta)


def test_a_move_by_zero_needs_no_rope_and_copies_the_rows():
    c = _cache(rope=False)
    _fill(c, 0, range(8))
    rng = get_range(c, 0, 0, 8)
    c.seq_rm(0)
    assert set_range(c, 1, rng, 0) == 8
    again = get_range(c, 1, 0, 8)
    for a, b in zip(rng.k + rng.v, again.k + again.v):
        assert np.array_equal(a, b)


def test_a_move_into_another_cache_of_the_same_geometry():
    src, dst = _cache(v_trans=True), _cache("2025", v_trans=False)
    _fill(src, 1, range(12))
    _fill(dst, 0, range(3), seed=2)
    assert set_range(dst, 0, get_range(src, 1, 4, 12), 3) == 8
    assert list(dst.seq_cells(0)[1]) == list(range(11))


# --- refused, the cache as it was ---------------------------------------------------------------

@pytest.mark.parametrize("semantics", ["2025", "2026"])
def test_bad_ranges_are_refused(semantics):
    c = _cache(semantics)
    _fill(c, 0, range(10))
    before = _snapshot(c)
    with pytest.raises(ValueError, match="empty"):
        get_range(c, 0, 5, 5)
    with pytest.raises(ValueError, match="p0"):
        get_range(c, 0, -1, 5)
    with pytest.raises(ValueError, match="position 10 is not held"):
        get_range(c, 0, 8, 12)
    with pytest.raises(TypeError, match="p1"):
        get_range(c, 0, 0, 2.5)
    rng = get_range(c, 0, 0, 4)
    _same(before, _snapshot(c))
    twice = _cache(semantics)
    _fill(twice, 1, range(5))
    _fill(twice, 1, range(3, 8), seed=1)          # positions 3 and 4 twice in sequence 1
    with pytest.raises(ValueError, match="several cells"):
        get_range(twice, 1, 0, 8)

    with pytest.raises(ValueError, match="already holds position 8"):
        set_range(c, 0, rng, 8)       # the sequence holds 8 and 9
    with pytest.raises(ValueError, match="at = -1"):
        set_range(c, 1, rng, -1)
    with pytest.raises(ValueError, match="seq_id"):
        set_range(c, 2, rng, 20)
    with pytest.raises(TypeError, match="SeqRange"):
        set_range(c, 1, object(), 20)
    with pytest.raises(ValueError, match="tokens must hold 4"):
        set_range(c, 1, rng, 20, tokens=[1, 2])
    with pytest.raises(TypeError, match="rope"):
        set_range(c, 1, rng, 20, rope="neox")
    other = _cache(semantics, type_k="f16")
    with pytest.raises(ValueError, match="types and layers"):
        set_range(other, 1, rng, 20)
    cut = SeqRange(rng.type_k, rng.type_v, rng.layers, 0, rng.k, rng.v[:1])
    with pytest.raises(ValueError, match="V rows"):
        set_range(c, 1, cut, 20)
    _same(before, _snapshot(c))


@pytest.mark.parametrize("semantics", ["2025", "2026"])
def test_no_room_changes_nothing(semantics):
    c = _cache(semantics, size=32)
    _fill(c, 0, range(20))
    _refused(c, lambda: set_range(c, 1, get_range(c, 0, 0, 16), 40), StateError, "no room")


def _refused(c, call, exc, match):
    """call raises exc (matching match) and c is as it was."""
    before = _snapshot(c)
    with pytest.raises(exc, match=match):
        call()
    _same(before, _snapshot(c))


def test_a_range_past_the_held_positions_names_the_first_missing_at_once():
    c = _cache()
    _fill(c, 0, list(range(10)) + list(range(12, 20)))
    with pytest.raises(ValueError, match=r"position 10 is not held; 2 positions of the range are not"):
        get_range(c, 0, 0, 20)
    with pytest.raises(ValueError, match=r"position 10 is not held; 999982 positions"):
        get_range(c, 0, 0, 10**6)
    # the message is made from the held positions only, not from the 2**31 - 1 of the range (a set of
    # every position of it ran out of memory)
    with pytest.raises(ValueError, match=r"position 10 is not held; 2147483629 positions"):
        get_range(c, 0, 0, 2**31 - 1)


def _hand_made(rng, **kw):
    d = dict(type_k=rng.type_k, type_v=rng.type_v, layers=rng.layers, p0=rng.p0, k=rng.k, v=rng.v)
    d.update(kw)
    return SeqRange(**d)


@pytest.mark.parametrize("semantics", ["2025", "2026"])
def test_a_hand_made_range_is_checked_before_the_cache_changes(semantics):
    # 40 cells, the first 10 freed: 16 cells do not fit there and a placement would move head to 40
    c = _cache(semantics, size=128)
    _fill(c, 0, range(40))
    c.seq_rm(0, 0, 10)
    rng = get_range(c, 0, 10, 26)
    f64 = tuple(np.full(k.shape, 300.7) for k in rng.k)
    for bad, exc, match in [
            (_hand_made(rng, p0=2**40), ValueError, r"rng\.p0 = 1099511627776 is outside"),
            (_hand_made(rng, p0=2**31 - 2), ValueError, r"rng\.p0"),     # p0 + 16 passes the last position
            (_hand_made(rng, p0=-1), ValueError, r"rng\.p0 = -1"),
            (_hand_made(rng, p0=2.5), TypeError, r"rng\.p0 must be an int, not float"),
            (_hand_made(rng, p0=float("nan")), TypeError, r"rng\.p0 must be an int"),
            (_hand_made(rng, p0=True), TypeError, r"rng\.p0 must be an int, not bool"),
            (_hand_made(rng, k=f64), TypeError, r"rng\.k\[0\] must be a uint8 numpy array .* float64"),
            (_hand_made(rng, v=(rng.v[0], np.zeros(rng.v[1].shape))), TypeError, r"rng\.v\[1\] .* float64"),
            (_hand_made(rng, k=tuple(k.tolist() for k in rng.k)), TypeError, r"rng\.k\[0\] .* not list"),
            (_hand_made(rng, k=(rng.k[0], rng.k[1][:, :8])), ValueError, r"rng\.k\[1\] has shape \(16, 8\)"),
            (_hand_made(rng, v=(rng.v[0], rng.v[1][:3])), ValueError, r"rng\.v\[1\] has shape \(3, 256\)"),
            (_hand_made(rng, k=iter(rng.k)), ValueError, r"K rows \(rng\.k\)")]:
        _refused(c, lambda: set_range(c, 1, bad, 3), exc, match)
    assert set_range(c, 1, rng, 3) == 16


def test_what_cannot_be_moved_is_refused():
    plain = _cache(rope=False)
    _fill(plain, 0, range(8))
    rng = get_range(plain, 0, 0, 8)
    _refused(plain, lambda: set_range(plain, 1, rng, 3), ValueError, "ALiBi or absolute position")
    # without the head size the rotation cannot be made
    nohead = kvcache.UnifiedCache(64, 2, 64, 64, type_k="f32", type_v="f32", v_trans=False, n_seq_max=2,
                                  semantics="2026")
    with pytest.raises(ValueError, match="n_embd_head_k"):
        set_range(nohead, 1, rng, 3, rope=kvcache.RopeParams(32))
    swa = _cache(n_swa=16, swa_type="standard")
    with pytest.raises(ValueError, match="sliding window"):
        set_range(swa, 1, rng, 3)
    ext = _cache(cell_ext=True)
    with pytest.raises(StoreError, match="M-RoPE"):
        get_range(ext, 0, 0, 1)
    meta = kvcache.UnifiedCache(64, 2, 64, 64, type_k="f32", type_v="f32", v_trans=False, n_seq_max=2,
                                semantics="2026", buffers="none")
    with pytest.raises(StoreError, match="no K/V memory"):
        set_range(meta, 1, rng, 3)
    iswa = kvcache.ISWACache(64, 2, 64, 64, swa_layers=[1], n_swa=8, type_k="f32", type_v="f32", v_trans=False,
                             n_seq_max=2, semantics="2026")
    with pytest.raises(StoreError, match="iSWA, recurrent or hybrid"):
        get_range(iswa, 0, 0, 1)
    store = PrefixStore(plain, chunk_tokens=4)
    with pytest.raises(StoreError, match="UnifiedCache"):
        store.load(object(), 0, list(range(8)), at=3)
    with pytest.raises(ValueError, match="at = -3"):
        store.load(plain, 0, list(range(8)), at=-3)


# --- the prefix store -----------------------------------------------------------------------------

@pytest.mark.parametrize("tier", ["host", "disk"])
def test_the_store_loads_a_prefix_after_other_cells(tier, tmp_path):
    src = _cache()
    doc = list(range(100, 116))
    _fill(src, 0, range(16))
    path = tmp_path / "st" if tier == "disk" else None
    PrefixStore(src, path, chunk_tokens=8).save(src, 0, doc)
    store = PrefixStore(src, path, chunk_tokens=8, host_bytes=1 << 20 if tier == "host" else 0)
    if tier == "host":
        store.save(src, 0, doc)
    dst = _cache("2025")
    _fill(dst, 1, range(AT), seed=3)
    before = _snapshot(dst)
    with pytest.raises(ValueError, match="already holds position 36"):
        store.load(dst, 1, doc, at=AT - 1)
    _same(before, _snapshot(dst))
    assert store.load(dst, 1, doc + [7], at=AT) == 16
    assert list(dst.seq_cells(1)[1]) == list(range(AT + 16))
    want = get_range(src, 0, 0, 16)
    c2 = _cache()
    set_range(c2, 0, want, AT)
    got, ref = get_range(dst, 1, AT, AT + 16), get_range(c2, 0, AT, AT + 16)
    for a, b in zip(got.k + got.v, ref.k + ref.v):
        assert np.array_equal(a, b)
    assert store.stats["chunks_loaded"] == 2


# --- against a model --------------------------------------------------------------------------------

@pytest.mark.parametrize("type_kv", ["f32", "f16"])
def test_a_chunk_moved_to_37_matches_a_computation_at_37(type_kv):
    """The rows of a chunk computed at 0 .. 31 and moved to 37 .. 68, against the chunk computed at
    37 .. 68 (alone: a RoPE model's rows depend only on relative positions, so they differ by the
    rotation alone), and the logits of a next token computed over either."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from kvcache.geometry import rope_from_transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   max_position_embeddings=256)
    model = transformers.LlamaForCausalLM(cfg).eval().to(torch.float32)
    h, d = cfg.num_key_value_heads, cfg.head_dim
    g = torch.Generator().manual_seed(1)
    doc = torch.randint(0, cfg.vocab_size, (32,), generator=g).tolist()
    system = torch.randint(0, cfg.vocab_size, (AT,), generator=g).tolist()
    nxt = 5

    def rows(past):
        return [(layer.keys[0].transpose(0, 1).reshape(-1, h * d).numpy(),
                 layer.values[0].transpose(0, 1).reshape(-1, h * d).numpy()) for layer in past.layers]

    def computed(tokens, p0):
        with torch.no_grad():
            return rows(model(torch.tensor([tokens]), position_ids=torch.arange(p0, p0 + len(tokens))[None],
                              use_cache=True).past_key_values)

    c = kvcache.UnifiedCache(256, 2, h * d, h * d, type_k=type_kv, type_v=type_kv, v_trans=False, n_seq_max=2,
                             semantics="2026", n_embd_head_k=d, rope=rope_from_transformers(model))
    assert c.find_slot(UBatch(list(range(32)), [0] * 32, tokens=doc))
    for il, (k, v) in enumerate(computed(doc, 0)):
        c.store(il, k, v)
    store = PrefixStore(c, chunk_tokens=16)
    assert store.save(c, 0, doc) == 32
    # sequence 1: another prompt's 37 tokens, then the document from the store
    assert c.find_slot(UBatch(list(range(AT)), [1] * AT, tokens=system))
    for il, (k, v) in enumerate(computed(system, 0)):
        c.store(il, k, v)
    assert store.load(c, 1, doc, at=AT) == 32
    moved = get_range(c, 1, AT, AT + 32)
    dt = np.float32 if type_kv == "f32" else np.float16
    rtol, atol = TOL[type_kv]
    fresh = computed(doc, AT)
    for il, (k, v) in enumerate(fresh):
        np.testing.assert_allclose(moved.k[il].view(dt).astype(np.float32), k.astype(dt).astype(np.float32),
                                   rtol=rtol, atol=atol)
        np.testing.assert_allclose(moved.v[il].view(dt).astype(np.float32), v.astype(dt).astype(np.float32),
                                   rtol=rtol, atol=atol)
    # the next token over the moved rows, against the document and the token computed at 37 ..
    past = transformers.DynamicCache()
    for il in range(cfg.num_hidden_layers):
        k = torch.from_numpy(moved.k[il].view(dt).astype(np.float32)).reshape(32, h, d).transpose(0, 1)[None]
        v = torch.from_numpy(moved.v[il].view(dt).astype(np.float32)).reshape(32, h, d).transpose(0, 1)[None]
        past.update(k.contiguous(), v.contiguous(), il)
    with torch.no_grad():
        out = model(torch.tensor([[nxt]]), cache=past, position_ids=torch.tensor([[AT + 32]]))
        ref = model(torch.tensor([doc + [nxt]]), position_ids=torch.arange(AT, AT + 33)[None])
    torch.testing.assert_close(out.logits[0, -1], ref.logits[0, -1], rtol=LOGITS_TOL[type_kv], atol=LOGITS_TOL[type_kv])


@pytest.mark.parametrize("v_trans", [False, True])
def test_a_move_between_streams(v_trans):
    """A cache of one stream per sequence (kv_unified=False): the rows are read from and written
    to each sequence's own stream."""
    c = _cache(v_trans=v_trans, kv_unified=False)
    assert c.n_stream == 2
    _fill(c, 0, range(10))
    part = get_range(c, 0, 2, 8)
    _fill(c, 1, range(4), seed=4)
    assert set_range(c, 1, part, 4) == 6
    moved = get_range(c, 1, 4, 10)
    shifted = _shifted_in_place(c, 2)
    for a, b in zip(moved.k + moved.v, shifted.k + shifted.v):
        assert np.array_equal(a, b)


def test_a_load_at_another_start_is_refused_for_every_other_cache_kind():
    """The stores of an iSWA, recurrent or hybrid cache, or of cells with 2-D positions, refuse
    at= before reading a chunk, naming why, and leave the cache as it was."""
    iswa = kvcache.ISWACache(64, 2, 64, 64, swa_layers=[1], n_swa=8, type_k="f32", type_v="f32", v_trans=False,
                             n_seq_max=2, semantics="2026")
    rec = kvcache.RecurrentCache(2, 2, 6, 4, type_k="f32", type_v="f32", semantics="2026")
    hyb = kvcache.HybridCache(64, 4, [0, 2], 8, 8, 12, 4, n_seq_max=2, type_k="f32", type_v="f32", v_trans=False)
    ext = _cache(cell_ext=True)
    for cache, why in ((iswa, "SWA layers hide and reuse cells"), (rec, "recurrent state sums up"),
                       (hyb, "recurrent state sums up"), (ext, "2-D positions")):
        store = PrefixStore(cache, chunk_tokens=4)
        state = cache.state_write(-1)
        with pytest.raises(StoreError, match=f"at= is refused .*{why}"):
            store.load(cache, 0, list(range(8)), at=3)
        assert cache.state_write(-1) == state
        assert store.stats["misses"] == 0
