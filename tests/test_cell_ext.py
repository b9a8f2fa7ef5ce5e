"""The per-cell extension of today's llama.cpp (M-RoPE and per-layer-embedding models): a 2-D
position and a token id per cell, set by ubatches, used by the mask of 2-D ubatches and carried
by the states (docs/state.md, "Layouts")."""
import struct

import numpy as np
import pytest

import kvcache
from kvcache import statefile
from kvcache._core import SEQ_MAGIC, describe_state, layout_info
import kvcache.inspect
from kvcache.convert import convert

N_EMBD = 4          # f32 K / V rows of 16 bytes
SIZE = 256


def cache(**kw):
    args = dict(kv_size=SIZE, n_layer=2, n_embd_k_gqa=N_EMBD, n_embd_v_gqa=N_EMBD, type_k="f32", type_v="f32",
                n_seq_max=4, semantics="2026", cell_ext=True)
    args.update(kw)
    return kvcache.UnifiedCache(**args)


def ext_bytes(layout):
    return layout_info(layout)["cell_ext"]


def section(cells, ext, n_layer=2, v_trans=True, seed=0):
    """One stream section by hand: cells [(pos, [ids], (x, y, tok))], the extension's ext bytes
    after n_seq_id, then V layout, layer count, per layer K (f32 rows), then per layer V."""
    rng = np.random.default_rng(seed)
    cc = len(cells)
    out = [struct.pack("<I", cc)]
    for pos, ids, (x, y, tok) in cells:
        out.append(struct.pack("<iI", pos, len(ids)))
        if ext:
            out.append(struct.pack("<ii", x, y) + (struct.pack("<i", tok) if ext == 12 else b""))
        out.append(struct.pack(f"<{len(ids)}i", *ids))
    out.append(struct.pack("<II", int(v_trans), n_layer))
    for _ in range(n_layer):
        out.append(struct.pack("<iQ", 0, 4 * N_EMBD) + rng.random((cc, N_EMBD), dtype=np.float32).tobytes())
    for _ in range(n_layer):
        if v_trans:
            out.append(struct.pack("<iII", 0, 4, N_EMBD) + rng.random((N_EMBD, cc), dtype=np.float32).tobytes())
        else:
            out.append(struct.pack("<iQ", 0, 4 * N_EMBD) + rng.random((cc, N_EMBD), dtype=np.float32).tobytes())
    return b"".join(out)


CELLS = [(0, [0], (0, 0, 11)), (1, [0, 1], (3, 4, 12)), (1, [0], (7, -2, 13)), (2, [1], (0, 5, -1)),
         (5, [2], (2 ** 31 - 1, -(2 ** 31), 14))]

EXT_LAYOUTS = ["2026-03", "2026-05", "2026-06", "2026"]


@pytest.mark.parametrize("layout", EXT_LAYOUTS)
def test_whole_state_by_hand_reads_and_writes_back(layout):
    e = ext_bytes(layout)
    assert e == (12 if layout == "2026" else 8)
    blob = struct.pack("<I", 1) + section(CELLS, e)
    c = cache()
    assert c.state_read(blob, layout=layout, exact=True) == len(blob)
    cells = c.cells()
    for i, (pos, ids, (x, y, tok)) in enumerate(CELLS):
        assert cells.pos[i] == pos and cells.seq_ids(i) == ids
        assert cells.ext[i].tolist() == [x, y, tok if e == 12 else -1]
    assert c.state_write(layout=layout) == blob
    # found from the bytes too
    d = cache()
    d.state_read(blob)
    assert d.cells() == cells


@pytest.mark.parametrize("layout", EXT_LAYOUTS)
def test_sequence_state_by_hand_restores_the_saved_ext(layout):
    e = ext_bytes(layout)
    seq = [(p, [2], (p + 10, p + 20, p + 30)) for p in range(5)]
    body = struct.pack("<I", 1) + section(seq, e)
    prefixed = layout_info(layout)["prefix"]
    blob = (struct.pack("<Ii", SEQ_MAGIC, 2) if prefixed else b"") + body
    c = cache()
    # cells of another sequence in the way: the state goes into any free cells
    c.find_slot(kvcache.UBatch(pos=[0, 1, 2], seq_id=[1, 1, 1], tokens=[1, 2, 3]))
    c.state_read(blob, 3, layout=layout)
    cells = c.cells()
    held = np.flatnonzero(cells.holds(3))
    assert cells.pos[held].tolist() == list(range(5))
    assert cells.ext[held].tolist() == [[p + 10, p + 20, p + 30 if e == 12 else -1] for p in range(5)]
    assert cells.ext[np.flatnonzero(cells.holds(1))].tolist() == [[0, 0, 1], [0, 0, 2], [0, 0, 3]]
    # written back as sequence 2 (its cells as they were), byte for byte
    d = cache()
    d.state_read(blob, 2, layout=layout)
    assert d.state_write(2, layout=layout) == blob


def test_old_layouts_read_with_default_ext_and_refuse_writing():
    c = cache()
    ub = kvcache.UBatch(pos=[0, 1], seq_id=[0, 0], tokens=[4, 5], pos_x=[1, 2], pos_y=[3, 4])
    c.find_slot(ub)
    for layout in ("2025", "2025-08"):
        blob = (struct.pack("<I", 1) if layout == "2025-08" else b"") + section([(0, [0], (0, 0, 0)),
                                                                                 (1, [0], (0, 0, 0))], 0)
        d = cache()
        d.find_slot(ub)
        d.state_read(blob, layout=layout)
        assert d.cells().ext[:3].tolist() == [[0, 0, -1]] * 3
        with pytest.raises(ValueError, match="per-cell extension"):
            c.state_write(layout=layout)
        with pytest.raises(ValueError, match="per-cell extension"):
            c.state_size(0, layout=layout)
        with pytest.raises(ValueError, match="per-cell extension"):
            c.state_write_into(bytearray(1 << 16), layout=layout)


@pytest.mark.parametrize("layout", EXT_LAYOUTS)
def test_corrupt_or_truncated_ext_states_change_nothing(layout):
    e = ext_bytes(layout)
    blob = struct.pack("<I", 1) + section(CELLS, e)
    c = cache()
    c.find_slot(kvcache.UBatch(pos=[0, 1, 2, 3], seq_id=[0, 0, 1, 1], tokens=[1, 2, 3, 4], pos_x=[0, 1, 2, 3],
                               pos_y=[1, 1, 1, 1]))
    before, state = c.cells(), c.state_write()
    cut_points = sorted(set(range(0, 4 + 4 + len(CELLS) * (8 + e + 8))) | {len(blob) - 1})
    for n in cut_points:
        with pytest.raises(kvcache.StateError):
            c.state_read(blob[:n], layout=layout)
        assert c.cells() == before and c.state_write() == state
    # a cell's id out of range after its extension
    bad = bytearray(blob)
    struct.pack_into("<i", bad, 4 + 4 + 8 + e, 9)
    with pytest.raises(kvcache.StateError, match="out of range"):
        c.state_read(bytes(bad), layout=layout)
    assert c.cells() == before
    # the state read as if it had no extension: the cells do not parse
    if e == 12:
        with pytest.raises(kvcache.StateError):
            c.state_read(blob, layout="2026-06", exact=True)
        assert c.cells() == before


def test_ubatch_sets_ext_and_ple_token():
    c = cache()
    c.find_slot(kvcache.UBatch(pos=[0, 1], seq_id=[0, 0], tokens=[7, 8]))
    c.find_slot(kvcache.UBatch(pos=[2, 3], seq_id=[0, 0], pos_x=[5, 6], pos_y=[1, 2]))
    c.find_slot(kvcache.UBatch(pos=[4], seq_id=[0]))   # neither: the extension stays as it was (the default)
    assert c.cells().ext[:5].tolist() == [[0, 0, 7], [0, 0, 8], [5, 1, -1], [6, 2, -1], [0, 0, -1]]
    p = cache(ple_token=99)
    assert p.ple_token == 99 and cache().ple_token is None
    p.find_slot(kvcache.UBatch(pos=[0, 1], seq_id=[0, 0]))
    p.find_slot(kvcache.UBatch(pos=[2], seq_id=[0], tokens=[3]))
    assert p.cells().ext[:3].tolist() == [[0, 0, 99], [0, 0, 99], [0, 0, 3]]


def test_cells_empty_to_defaults_and_stream_copies_carry_ext():
    c = cache(kv_unified=False, n_seq_max=2)
    ub = kvcache.UBatch(pos=[0, 1, 2], seq_id=[0, 0, 0], tokens=[1, 2, 3], pos_x=[4, 5, 6], pos_y=[7, 8, 9])
    c.find_slot(ub)
    c.seq_cp(0, 1)
    s0, s1 = c.stream_cells()
    assert s1.ext[:3].tolist() == s0.ext[:3].tolist() == [[4, 7, 1], [5, 8, 2], [6, 9, 3]]
    c.seq_rm(0, 1, -1)
    s0, s1 = c.stream_cells()
    assert s0.ext[:3].tolist() == [[4, 7, 1], [0, 0, -1], [0, 0, -1]]
    assert s1.ext[:3].tolist() == [[4, 7, 1], [5, 8, 2], [6, 9, 3]]
    c.clear()
    assert all((s.ext == [0, 0, -1]).all() for s in c.stream_cells())


def test_arguments():
    with pytest.raises(ValueError, match="semantics='2026'"):
        kvcache.UnifiedCache(kv_size=32, n_layer=1, n_embd_k_gqa=4, n_embd_v_gqa=4, cell_ext=True)
    with pytest.raises(ValueError, match="cell_ext=True"):
        kvcache.UnifiedCache(kv_size=32, n_layer=1, n_embd_k_gqa=4, n_embd_v_gqa=4, semantics="2026", ple_token=3)
    with pytest.raises(TypeError):
        cache(cell_ext=1)
    with pytest.raises(ValueError, match="both"):
        kvcache.UBatch(pos=[0], seq_id=[0], pos_x=[0])
    with pytest.raises(ValueError, match="one value per token"):
        kvcache.UBatch(pos=[0, 1], seq_id=[0, 0], tokens=[1])
    with pytest.raises(ValueError, match="int32"):
        kvcache.UBatch(pos=[0], seq_id=[0], tokens=[2 ** 31])
    two_d = kvcache.UBatch(pos=[0], seq_id=[0], pos_x=[0], pos_y=[0])
    assert two_d.tokens is None and two_d.pos_x.tolist() == [0]
    plain = kvcache.UnifiedCache(kv_size=32, n_layer=1, n_embd_k_gqa=4, n_embd_v_gqa=4, n_pad=32, semantics="2026")
    assert not plain.cell_ext and cache().cell_ext
    assert plain.cells().ext is None
    with pytest.raises(ValueError, match="2-D positions"):
        plain.find_slot(two_d)
    with pytest.raises(ValueError, match="2-D positions"):
        plain.kq_mask(two_d)
    # token ids alone: any cache takes them (and one without the extension ignores them)
    assert plain.find_slot(kvcache.UBatch(pos=[0], seq_id=[0], tokens=[5]))
    iswa = kvcache.ISWACache(kv_size=256, n_layer=2, n_embd_k_gqa=4, n_embd_v_gqa=4, swa_layers=[1], n_swa=4,
                             semantics="2026", cell_ext=True)
    assert iswa.cell_ext and iswa.base.cell_ext and iswa.swa.cell_ext
    assert iswa.find_slot(kvcache.UBatch(pos=[0, 1], seq_id=[0, 0], pos_x=[1, 2], pos_y=[3, 4]))
    assert iswa.swa.cells().ext[:2].tolist() == [[1, 3, -1], [2, 4, -1]]
    blob = iswa.state_write(0)
    other = kvcache.ISWACache(kv_size=256, n_layer=2, n_embd_k_gqa=4, n_embd_v_gqa=4, swa_layers=[1], n_swa=4,
                              semantics="2026", cell_ext=True)
    other.state_read(blob, 0)
    assert other.state_write(0) == blob


def expected_mask(cells, ub, n_kv):
    """The rule, stated over the whole table: token t sees cell j when j holds t's sequence at a
    position not after t's and, at t's own position, not 2-D after t's (y first, then x)."""
    pos, ext = cells.pos[:n_kv], cells.ext[:n_kv]
    out = np.zeros((ub.n_tokens, n_kv), dtype=bool)
    for t in range(ub.n_tokens):
        s, p1 = ub.seq_id[t][0], ub.pos[t]
        seen = cells.holds(s)[:n_kv] & (pos >= 0) & (pos <= p1)
        if ub.pos_x is not None:
            x, y = ub.pos_x[t], ub.pos_y[t]
            later = (ext[:, 1] > y) | ((ext[:, 1] == y) & (ext[:, 0] > x))
            seen &= ~((pos == p1) & later)
        out[t] = seen
    return out


@pytest.mark.parametrize("seed", range(12))
def test_masks_of_2d_ubatches_follow_the_rule(seed):
    rng = np.random.default_rng(seed)
    c = cache(n_seq_max=3)
    for step in range(6):
        n = int(rng.integers(1, 40))
        p0 = step * 3
        pos = p0 + rng.integers(0, 4, n)            # many tokens at one position: an image's
        sid = rng.integers(0, 3, n)
        two_d = rng.random() < 0.7
        kw = dict(pos_x=rng.integers(-2, 5, n), pos_y=rng.integers(-2, 5, n)) if two_d else {}
        ub = kvcache.UBatch(pos=pos, seq_id=sid, tokens=rng.integers(0, 1000, n), **kw)
        assert c.find_slot(ub)
        for dtype in ("bool", "f32", "f16"):
            m = np.asarray(c.kq_mask(ub, dtype=dtype))[0]
            seen = m if dtype == "bool" else m == 0
            assert np.array_equal(seen, expected_mask(c.cells(), ub, m.shape[1]))
        # one buffer reused across 2-D and plain masks of the same shape stays right
        out = np.empty((1, n, c.n_kv_per_stream[0]), dtype=bool)
        plain = kvcache.UBatch(pos=pos, seq_id=sid)
        for k, u in enumerate((plain, ub, plain, ub, ub)):
            # a new buffer is written whole first: reuse names the buffer the cache last wrote
            got = np.asarray(c.kq_mask(u, dtype="bool", out=out, reuse=k > 0))[0]
            assert np.array_equal(got, expected_mask(c.cells(), u, got.shape[1]))


def test_non_causal_masks_ignore_2d():
    c = cache()
    ub = kvcache.UBatch(pos=[0, 0, 0], seq_id=[0, 0, 0], pos_x=[0, 1, 2], pos_y=[0, 0, 0])
    c.find_slot(ub)
    m = np.asarray(c.kq_mask(ub, causal=False, dtype="bool"))[0]
    assert m[:, :3].all()
    m = np.asarray(c.kq_mask(ub, dtype="bool"))[0]
    assert m[:, :3].tolist() == [[True, False, False], [True, True, False], [True, True, True]]


@pytest.mark.parametrize("layout", EXT_LAYOUTS)
def test_cache_less_readers_find_the_extension(layout, tmp_path):
    c = cache()
    c.find_slot(kvcache.UBatch(pos=[0, 1, 1], seq_id=[0, 0, 0], tokens=[3, 4, 5], pos_x=[0, 0, 1],
                               pos_y=[0, 0, 0]))
    whole = c.state_write(layout=layout)
    d = describe_state(whole[4:], ext_bytes(layout))
    assert d["ext"].tolist() == [[0, 0, 3], [0, 0, 4], [1, 0, 5]] if layout == "2026" else \
        [[0, 0, -1], [0, 0, -1], [1, 0, -1]]
    r = kvcache.inspect.report_bytes(c.state_write(0, layout=layout))
    assert r["framing"]["cell_ext"] == ext_bytes(layout) and layout in r["layouts"]
    for lay in EXT_LAYOUTS:
        cv = convert(c.state_write(0, layout=layout), lay, seq_id=0)
        d = cache()
        d.state_read(cv.data, 0, layout=lay)
        toks = [3, 4, 5] if layout == lay == "2026" else [-1, -1, -1]
        assert d.cells().ext[:3].tolist() == [[0, 0, toks[0]], [0, 0, toks[1]], [1, 0, toks[2]]]
    with pytest.raises(kvcache.StateError, match="no room"):
        convert(c.state_write(0, layout=layout), "2025")
    path = tmp_path / "seq.ggsq"
    statefile.write_sequence_file(path, c, seq_id=0, tokens=[3, 4, 5], layout=layout)
    f = statefile.load(path)
    d = cache()
    f.restore(d, seq_id=1)
    want = c.cells().ext[:3].copy()
    if layout != "2026":
        want[:, 2] = -1
    assert d.cells().pos[:3].tolist() == [0, 1, 1] and d.cells().ext[:3].tolist() == want.tolist()


def test_states_without_cells_are_found_without_a_layout():
    c = cache()
    for seq_id in (-1, 0):
        for layout in EXT_LAYOUTS:
            blob = c.state_write(seq_id, layout=layout)
            d = cache()
            assert d.state_read(blob, seq_id) == len(blob)
    iswa = kvcache.ISWACache(kv_size=256, n_layer=2, n_embd_k_gqa=4, n_embd_v_gqa=4, swa_layers=[1], n_swa=4,
                             semantics="2026", cell_ext=True)
    iswa.state_read(iswa.state_write(0), 0)
    iswa.state_read(iswa.state_write())


@pytest.mark.parametrize("simple", [True, False])
def test_batch_splits_carry_tokens_and_2d_positions(simple):
    """A Batch's splits carry the token ids and 2-D positions of their tokens (gathered by the
    split's ids), so ubatches from a Batch set a cache's extensions as the same ubatches built by
    hand do; a Batch refuses what a UBatch refuses."""
    pos = [0, 1, 2, 0, 1, 3]
    seq = [0, 0, 0, 1, 1, 0]
    tok = [10, 11, 12, 20, 21, 13]
    px, py = [0, 1, 2, 5, 6, 3], [0, 0, 1, 5, 5, 2]
    b = kvcache.Batch(pos, seq, simple_split=simple, tokens=tok, pos_x=px, pos_y=py)
    split = list(b.ubatches(4))
    assert sum(u.n_tokens for u in split) == len(pos)
    kw = dict(kv_size=32, n_layer=1, n_embd_k_gqa=8, n_embd_v_gqa=8, n_seq_max=2, n_pad=1, semantics="2026",
              cell_ext=True)
    via_batch, by_hand = kvcache.UnifiedCache(**kw), kvcache.UnifiedCache(**kw)
    for u in split:
        ids = u.ids
        assert u.tokens.tolist() == [tok[i] for i in ids]
        assert u.pos_x.tolist() == [px[i] for i in ids] and u.pos_y.tolist() == [py[i] for i in ids]
        assert via_batch.find_slot(u)
        groups = [u.seq_id[g] for g in range(u.n_seqs)]
        same = kvcache.UBatch(u.pos, groups, u.n_seq_tokens, tokens=[tok[i] for i in ids],
                              pos_x=[px[i] for i in ids], pos_y=[py[i] for i in ids])
        assert by_hand.find_slot(same)
    assert via_batch.cells().ext.tolist() == by_hand.cells().ext.tolist()
    assert sorted(map(tuple, via_batch.cells().ext[:6].tolist())) == sorted(zip(px, py, tok))
    assert via_batch.state_write(-1) == by_hand.state_write(-1)
    plain = kvcache.Batch(pos, seq, simple_split=simple)
    assert all(u.tokens is None and u.pos_x is None for u in plain.ubatches(4))
    with pytest.raises(ValueError, match="pos_x and pos_y"):
        kvcache.Batch(pos, seq, pos_x=px)
    with pytest.raises(ValueError, match="tokens must have one value per token"):
        kvcache.Batch(pos, seq, tokens=tok[:-1])
