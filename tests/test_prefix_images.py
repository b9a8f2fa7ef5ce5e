"""Prefix reuse past images (docs/prefix-reuse.md, "Cells with the extension"): with M-RoPE an
image's tokens share one position and are told apart by their 2-D positions, and the text after
an image sits one past its largest x or y (mtmd's and transformers' Qwen2-VL layout). The index
keeps a prompt in the order its tokens see each other, so a request that agrees with a held
prompt through and past an image reuses all of it.

Rows are fingerprints of the (token, position, x, y) quadruples of the prompt up to and including
the row's own: "an attached cell holds the K/V of the same computation from scratch" is checked
exactly. A tiny transformers Qwen2-VL language model checks the same with real M-RoPE attention."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvcache
from kvcache import UBatch, UnifiedCache

from test_prefix_reuse import E, fingerprint


def _cache(kv_size=128, **kw):
    c = UnifiedCache(kv_size, 1, E, E, type_k="f32", type_v="f32", v_trans=False, n_seq_max=4, n_pad=32,
                     semantics="2026", cell_ext=True, **kw)
    c.enable_prefix_reuse()
    return c


def image_id(image: int, i: int) -> int:
    """The placeholder token of an image's i-th token: the image identifies itself by its ids."""
    return 100_000 + 1000 * image + i


def layout(segments, start=0):
    """A prompt laid out as mtmd lays it out with M-RoPE: ("text", [tokens]) at positions p, p+1,
    ... (x = y = p), ("image", id, nx, ny) as nx * ny tokens at one position p0, x = p0 + col,
    y = p0 + row, row by row, the next position p0 + max(nx, ny). Returns (tokens, pos, xs, ys,
    is_image), lists, and the next position."""
    toks, pos, xs, ys, img = [], [], [], [], []
    p = start
    for seg in segments:
        if seg[0] == "text":
            for t in seg[1]:
                toks.append(t)
                pos.append(p)
                xs.append(p)
                ys.append(p)
                img.append(False)
                p += 1
        else:
            _, ident, nx, ny = seg
            for i in range(nx * ny):
                toks.append(image_id(ident, i))
                pos.append(p)
                xs.append(p + i % nx)
                ys.append(p + i // nx)
                img.append(True)
            p += max(nx, ny)
    return (toks, pos, xs, ys, img), p


def quads(prompt, upto):
    toks, pos, xs, ys = prompt[:4]
    return [v for j in range(upto) for v in (toks[j], pos[j], xs[j], ys[j])]


def compute(c, s, prompt, start, chunks=(1 << 30,), stop=None):
    """Place prompt[start:stop] for sequence s in ubatches of the sizes in chunks (cycled; an
    image's tokens never share a ubatch with text, as mtmd decodes them), image tokens without
    token ids, and store each row as the fingerprint of the prompt up to it. Returns whether it
    all fitted."""
    toks, pos, xs, ys, img = prompt
    stop = len(toks) if stop is None else stop
    j, k = start, 0
    while j < stop:
        n = min(chunks[k % len(chunks)], stop - j)
        k += 1
        end = j
        while end < j + n and img[end] == img[j]:
            end += 1
        ub = UBatch(pos[j:end], [s] * (end - j), tokens=None if img[j] else toks[j:end], pos_x=xs[j:end],
                    pos_y=ys[j:end])
        if not c.find_slot(ub):
            return False
        rows = np.stack([fingerprint(quads(prompt, q + 1)) for q in range(j, end)])
        c.store(0, rows, rows)
        j = end
    return True


def check_rows(c, s, prompt):
    """Every cell of s holds the fingerprint of the prompt up to its token (cells in the order
    their tokens see each other: by position, then row, then column)."""
    cells, pos = c.seq_cells(s)
    ext = c.cells().ext[cells]
    order = sorted(range(len(cells)), key=lambda i: (pos[i], ext[i][1], ext[i][0]))
    k = np.asarray(c.k(0))
    assert len(cells) <= len(prompt[0])
    for j, i in enumerate(order):
        assert (pos[i], ext[i][0], ext[i][1]) == (prompt[1][j], prompt[2][j], prompt[3][j])
        np.testing.assert_array_equal(k[cells[i]], fingerprint(quads(prompt, j + 1)))


def args(prompt, upto=None):
    toks, pos, xs, ys = (list(v[:upto]) for v in prompt[:4])
    return toks, dict(pos=pos, pos_x=xs, pos_y=ys)


def extend(prompt, more):
    return tuple(a + b for a, b in zip(prompt, more))


# --- a chat's next turn reuses the image and everything after it ----------------------------------

def test_the_next_turn_reuses_the_image_and_the_text_after_it():
    c = _cache()
    first, p = layout([("text", [1, 2, 3]), ("image", 7, 3, 2), ("text", [4, 5, 6])])
    assert first[1] == [0, 1, 2] + [3] * 6 + [6, 7, 8]          # the text after the image jumps to 3 + 3
    assert compute(c, 0, first, 0, chunks=(3, 4))               # the image in two ubatches
    assert c.prefix_release(0, tokens=first[0]) == len(first[0])
    # the next turn: the first prompt, its answer and a new message
    more, _ = layout([("text", [40, 41, 42, 43])], start=p)
    second = extend(first, more)
    toks, kw = args(second)
    assert c.prefix_match(toks, **kw) == len(first[0])
    k = c.prefix_attach(1, toks, **kw)
    assert k == len(first[0])
    cells, pos = c.seq_cells(1)
    assert sorted(pos.tolist()) == sorted(first[1])              # the cells sit at their positions again
    assert sorted(map(tuple, c.cells().ext[cells][:, :2].tolist())) == sorted(zip(first[2], first[3]))
    assert compute(c, 1, second, k)
    check_rows(c, 1, second)
    assert c.prefix_release(1, tokens=second[0]) == len(second[0])
    assert c.prefix_stats["cells"] == len(second[0])
    c._prefix_check()


def test_a_request_with_another_image_reuses_the_text_before_it():
    c = _cache()
    first, _ = layout([("text", [1, 2, 3]), ("image", 7, 2, 2), ("text", [4])])
    assert compute(c, 0, first, 0)
    assert c.prefix_release(0, tokens=first[0]) == 8
    other, _ = layout([("text", [1, 2, 3]), ("image", 8, 2, 2), ("text", [4])])
    toks, kw = args(other)
    assert c.prefix_match(toks, **kw) == 3                       # the other image's ids differ
    # the same image at another place in the prompt: its 2-D positions differ
    moved, _ = layout([("text", [1, 2, 3, 9]), ("image", 7, 2, 2), ("text", [4])])
    toks, kw = args(moved)
    assert c.prefix_match(toks, **kw) == 3
    # positions not given are 0, 1, ...: the text and the image's first token (at 3) agree
    assert c.prefix_match(first[0] + [5], pos_x=first[2] + [9], pos_y=first[3] + [9]) == 4
    c._prefix_check()


def test_attach_may_end_inside_an_image():
    c = _cache()
    first, _ = layout([("text", [1, 2]), ("image", 3, 3, 3), ("text", [4])])
    assert compute(c, 0, first, 0)
    assert c.prefix_release(0, tokens=first[0]) == 12
    # a request whose image differs from the 6th token on (ids are the request's own)
    second = tuple(list(v) for v in first)
    second[0][2 + 5] = 77
    toks, kw = args(second)
    k = c.prefix_attach(1, toks, **kw)
    assert k == 2 + 5
    assert sorted(c.seq_cells(1)[1].tolist()) == [0, 1] + [2] * 5
    assert compute(c, 1, second, k)                              # the image's rest at its own position
    check_rows(c, 1, second)
    c._prefix_check()


def test_pin_and_evict_with_repeated_positions():
    c = _cache()
    first, _ = layout([("text", [1]), ("image", 2, 2, 2), ("text", [3, 4])])
    assert compute(c, 0, first, 0)
    assert c.prefix_release(0, tokens=first[0]) == 7
    toks, kw = args(first)
    pin = c.prefix_pin(toks, **kw)
    with pytest.raises(ValueError, match="holds 2 of the 7"):
        c.prefix_pin(toks, pos=list(range(7)), pos_x=kw["pos_x"], pos_y=kw["pos_y"])
    assert c.prefix_evict(100) == 0                              # pinned
    c.prefix_unpin(pin)
    assert c.prefix_evict(100) == 7
    assert c.prefix_match(toks, **kw) == 0
    c._prefix_check()


# --- what ends the prompt kept --------------------------------------------------------------------

def test_a_gap_anywhere_but_after_an_image_ends_what_is_kept():
    c = _cache()
    first, _ = layout([("text", [1, 2]), ("image", 5, 2, 2), ("text", [3, 4, 5, 6])])
    assert compute(c, 0, first, 0)
    # positions 5 .. 6 removed: the text at 7 saw them
    c.seq_rm(0, 5, 7)
    assert c.prefix_release(0, tokens=first[0]) == 7
    # text right after the image, at 3 (not mtmd's layout): the image is kept, not the text
    toks = [1, 2] + [image_id(5, i) for i in range(4)] + [3]
    pos = [0, 1, 2, 2, 2, 2, 3]
    xs = [0, 1, 2, 3, 2, 3, 3]
    ys = [0, 1, 2, 2, 3, 3, 3]
    assert c.find_slot(UBatch(pos, [1] * 7, tokens=toks, pos_x=xs, pos_y=ys))
    c.prefix_evict(100)
    assert c.prefix_release(1) == 6
    c._prefix_check()


def test_two_tokens_at_one_2d_position_end_what_is_kept():
    c = _cache()
    toks, pos, xs, ys = [1, 2, 3, 4, 5], [0, 1, 1, 1, 3], [0, 1, 2, 2, 3], [0, 1, 1, 1, 3]
    assert c.find_slot(UBatch(pos, [0] * 5, tokens=toks, pos_x=xs, pos_y=ys))
    assert c.prefix_release(0) == 2                              # (2, 1) twice: each saw the other
    c._prefix_check()


def test_a_recomputed_image_row_ends_what_is_kept_at_the_rows_computed_before_it():
    c = _cache()
    first, _ = layout([("text", [1]), ("image", 4, 2, 2), ("text", [2])])
    assert compute(c, 0, first, 0, chunks=(1, 2, 2, 1))
    c.seq_rm(0, 1, 2)                                            # the whole image goes (its position)
    assert compute(c, 0, first, 1, chunks=(2, 2))                # and is computed again, after the text
    assert c.prefix_release(0, tokens=first[0]) == 5             # the text after it was computed before
    c._prefix_check()


# --- bad input ----------------------------------------------------------------------------------

def test_bad_positions_raise_and_change_nothing():
    c = _cache()
    first, _ = layout([("text", [1, 2]), ("image", 1, 2, 2), ("text", [3])])
    assert compute(c, 0, first, 0)
    assert c.prefix_release(0, tokens=first[0]) == 7
    toks, kw = args(first)
    before = (c.prefix_stats, c.used)
    for call in (lambda **a: c.prefix_match(toks, **a), lambda **a: c.prefix_attach(1, toks, **a),
                 lambda **a: c.prefix_pin(toks, **a)):
        with pytest.raises(ValueError, match=r"pos must hold one value per token \(7\), got 3"):
            call(pos=[0, 1, 2], pos_x=kw["pos_x"], pos_y=kw["pos_y"])
        with pytest.raises(ValueError, match=r"pos must hold values in"):
            call(pos=[1 << 40] * 7)
        with pytest.raises(TypeError, match="pos"):
            call(pos="0123456")
        assert (c.prefix_stats, c.used) == before and c.seq_pos_max(1) == -1
    plain = kvcache.UnifiedCache(64, 1, E, E, semantics="2026")
    plain.enable_prefix_reuse()
    with pytest.raises(ValueError, match="cell_ext=False"):
        plain.prefix_match([1, 2], pos=[0, 1])
    iswa = kvcache.ISWACache(64, 2, E, E, swa_layers=[1], n_swa=4, semantics="2026")
    iswa.enable_prefix_reuse()
    with pytest.raises(ValueError, match="cell_ext=False"):
        iswa.prefix_attach(0, [1, 2], pos=[0, 1])
    assert iswa.seq_pos_max(0) == -1


# --- an iSWA pair whose caches both keep the prompt ---------------------------------------------

def test_iswa_with_full_swa_cache_reuses_past_the_image_in_both_caches():
    c = kvcache.ISWACache(128, 2, E, E, swa_layers=[1], n_swa=4, swa_full=True, n_seq_max=3, semantics="2026",
                          cell_ext=True)
    c.enable_prefix_reuse()
    first, p = layout([("text", [1, 2, 3]), ("image", 7, 3, 2), ("text", [4, 5])])
    toks, pos, xs, ys, img = first
    assert c.find_slot(UBatch(pos[:3], [0] * 3, tokens=toks[:3], pos_x=xs[:3], pos_y=ys[:3]))
    assert c.find_slot(UBatch(pos[3:9], [0] * 6, pos_x=xs[3:9], pos_y=ys[3:9]))
    assert c.find_slot(UBatch(pos[9:], [0] * 2, tokens=toks[9:], pos_x=xs[9:], pos_y=ys[9:]))
    assert c.prefix_release(0, tokens=toks) == 11
    second = extend(first, layout([("text", [9])], start=p)[0])
    t2, kw = args(second)
    assert c.prefix_match(t2, **kw) == 11
    assert c.prefix_attach(1, t2, **kw) == 11
    for part in (c.base, c.swa):
        assert sorted(part.seq_cells(1)[1].tolist()) == sorted(pos)
    pin = c.prefix_pin(toks, **args(first)[1])
    c.prefix_unpin(pin)


# --- random prompts with images, placed in random ubatches and cells -------------------------------

@st.composite
def prompts(draw):
    segs = []
    for _ in range(draw(st.integers(1, 4))):
        if draw(st.booleans()):
            segs.append(("text", draw(st.lists(st.integers(1, 5), min_size=1, max_size=4))))
        else:
            segs.append(("image", draw(st.integers(0, 2)), draw(st.integers(1, 3)), draw(st.integers(1, 3))))
    return segs


@settings(max_examples=150, deadline=None)
@given(segs=prompts(), more=prompts(), chunks=st.lists(st.integers(1, 5), min_size=1, max_size=3),
       holes=st.integers(0, 20), cut=st.integers(0, 30))
def test_random_prompts_with_images_are_reused_exactly(segs, more, chunks, holes, cut):
    c = _cache()
    if holes:
        # another sequence's cells, freed after the first ubatch: the prompt's cells interleave
        assert c.find_slot(UBatch(list(range(holes)), [3] * holes))
    first, p = layout(segs)
    n = len(first[0])
    head = min(chunks[0], n)
    assert compute(c, 0, first, 0, stop=head)
    c.seq_rm(3, -1, -1)
    assert compute(c, 0, first, head, chunks=tuple(chunks))
    assert c.prefix_release(0, tokens=first[0]) == n
    second = extend(first, layout(more, start=p)[0])
    toks, kw = args(second)
    assert c.prefix_match(toks, **kw) == min(n, len(toks) - 1)
    # a request that agrees only up to `cut`: another token there
    j = min(cut, len(toks) - 1)
    toks2 = list(toks)
    toks2[j] = 99
    k = c.prefix_attach(1, toks2, **kw)
    assert k == min(j, n, len(toks) - 1)
    variant = (toks2, *second[1:])
    assert compute(c, 1, variant, k)
    check_rows(c, 1, variant)
    assert c.prefix_release(1, tokens=toks2) == len(toks2)
    c._prefix_check()


# --- a tiny transformers Qwen2-VL language model: real M-RoPE attention ---------------------------

def test_qwen2_vl_next_turn_past_an_image_gives_the_outputs_of_recomputation():
    """The previous turn (text, an image, text) computed by a tiny Qwen2-VL language model (random
    weights; the image's embeddings stand in for the vision encoder's), its K/V stored in a cache
    with the extension and released into the index; the next turn attaches all of it, computes
    only its new message, and its last hidden state is that of the whole turn computed from
    scratch."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.Qwen2VLTextConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                          "mrope_section": [2, 3, 3]})
    model = transformers.models.qwen2_vl.modeling_qwen2_vl.Qwen2VLTextModel(cfg).eval().to(torch.float32)
    h, d = cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    first, p = layout([("text", [1, 2, 3, 4, 5]), ("image", 0, 3, 2), ("text", [6, 7, 8])])
    second = extend(first, layout([("text", [9, 10, 11, 12])], start=p)[0])
    image = torch.randn(6, cfg.hidden_size, generator=torch.Generator().manual_seed(2))

    def embeds(prompt):
        rows, n_img = [], 0
        for t, is_img in zip(prompt[0], prompt[4]):
            rows.append(image[n_img] if is_img else model.embed_tokens(torch.tensor(t)))
            n_img += is_img
        return torch.stack(rows)[None]

    def positions(prompt, a=0):   # (temporal, height = y, width = x), as Qwen2-VL's get_rope_index
        return torch.tensor([prompt[1][a:], prompt[3][a:], prompt[2][a:]])[:, None, :]

    def layers_kv(cache):
        return [(ly.keys[0].transpose(0, 1).reshape(ly.keys.shape[2], -1).numpy(),
                 ly.values[0].transpose(0, 1).reshape(ly.values.shape[2], -1).numpy()) for ly in cache.layers]

    with torch.no_grad():
        c = UnifiedCache(128, cfg.num_hidden_layers, h * d, h * d, type_k="f32", type_v="f32", v_trans=False,
                         n_seq_max=2, semantics="2026", cell_ext=True)
        c.enable_prefix_reuse()
        out = model(inputs_embeds=embeds(first), position_ids=positions(first), use_cache=True)
        kv = layers_kv(out.past_key_values)
        toks, pos, xs, ys, img = first
        for a, b in ((0, 5), (5, 11), (11, 14)):        # text, the image (no token ids), text
            assert c.find_slot(UBatch(pos[a:b], [0] * (b - a), tokens=None if img[a] else toks[a:b],
                                      pos_x=xs[a:b], pos_y=ys[a:b]))
            for il, (k, v) in enumerate(kv):
                c.store(il, k[a:b], v[a:b])
        assert c.prefix_release(0, tokens=toks) == 14

        t2, kw = args(second)
        n = c.prefix_attach(1, t2, **kw)
        assert n == 14
        cells, cpos = c.seq_cells(1)
        ext = c.cells().ext[cells]
        order = sorted(range(n), key=lambda i: (cpos[i], ext[i][1], ext[i][0]))   # the order they see each other
        cells = cells[order]
        past = transformers.DynamicCache()
        for il in range(cfg.num_hidden_layers):
            k = torch.from_numpy(np.asarray(c.k(il))[cells]).reshape(n, h, d).transpose(0, 1)[None]
            v = torch.from_numpy(np.asarray(c.v(il))[cells]).reshape(n, h, d).transpose(0, 1)[None]
            past.update(k.contiguous(), v.contiguous(), il)
        reused = model(inputs_embeds=embeds(second)[:, n:], position_ids=positions(second, n), cache=past,
                       use_cache=True)
        scratch = model(inputs_embeds=embeds(second), position_ids=positions(second))
        torch.testing.assert_close(reused.last_hidden_state[0, -1], scratch.last_hidden_state[0, -1], rtol=1e-6,
                                   atol=1e-6)
        # without the positions past the image the request reuses only the text before it
        assert c.prefix_match(t2, pos_x=kw["pos_x"], pos_y=kw["pos_y"]) == 6
