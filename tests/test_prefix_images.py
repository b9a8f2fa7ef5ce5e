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
    y = p0 + row, row by row, the next position p0 + max(nx, ny); ("gap", n) skips n positions.
    Returns (tokens, pos, xs, ys, is_image), lists, and the next position."""
    toks, pos, xs, ys, img = [], [], [], [], []
    p = start
    for seg in segments:
        if seg[0] == "gap":
            p += seg[1]
        elif seg[0] == "text":
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


def ubatches(prompt, s, start, chunks=(1 << 30,), stop=None, whole_images=False):
    """The ubatches placing prompt[start:stop] for sequence s, in the sizes of chunks (cycled; an
    image's tokens never share a ubatch with text, as mtmd decodes them; whole_images: what is
    left of an image in one ubatch), image tokens without token ids: (a, b, UBatch) for tokens
    a .. b - 1."""
    toks, pos, xs, ys, img = prompt[:5]
    stop = len(toks) if stop is None else stop
    j, k = start, 0
    while j < stop:
        n = min(stop - j if whole_images and img[j] else chunks[k % len(chunks)], stop - j)
        k += 1
        end = j
        while end < j + n and img[end] == img[j]:
            end += 1
        yield j, end, UBatch(pos[j:end], [s] * (end - j), tokens=None if img[j] else toks[j:end], pos_x=xs[j:end],
                             pos_y=ys[j:end])
        j = end


def store_rows(c, prompt, a, b, layers=1):
    """The rows of tokens a .. b - 1 just placed: layer il's are the fingerprints of the prompt up
    to each token, + il."""
    rows = np.stack([fingerprint(quads(prompt, q + 1)) for q in range(a, b)])
    for il in range(layers):
        c.store(il, rows + il, rows + il)


def compute(c, s, prompt, start, chunks=(1 << 30,), stop=None, layers=1):
    """Place prompt[start:stop] for sequence s (ubatches()) and store each row as the fingerprint
    of the prompt up to it (store_rows). Returns whether it all fitted."""
    for a, b, ub in ubatches(prompt, s, start, chunks, stop):
        if not c.find_slot(ub):
            return False
        store_rows(c, prompt, a, b, layers)
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


# --- an iSWA pair whose SWA cache is small (window mode: llama.cpp's default swa_full=false) --------
# The SWA cache (256 cells here) overwrites the cells that slid out of their sequence's window;
# its index remembers those tokens without cells (ghosts), with the position and extension each
# had. A hit needs the base cache's cells of the whole prefix and the SWA cache's cells of the
# window of the next query.

N_SWA = 4


def _small(**kw):
    c = kvcache.ISWACache(1024, 2, E, E, swa_layers=[1], n_swa=N_SWA, type_k="f32", type_v="f32", v_trans=False,
                          n_seq_max=3, n_batch=8, swa_full=False, semantics="2026", cell_ext=True, **kw)
    c.enable_prefix_reuse()
    return c


def _keys(part, s):
    """Sequence s's cells in part: {(pos, x, y): (cell, ext triple)}."""
    cells, pos = part.seq_cells(s)
    ext = part.cells().ext[cells]
    return {(int(p), int(e[0]), int(e[1])): (int(i), tuple(int(v) for v in e)) for i, p, e in zip(cells, pos, ext)}


def _depths(prompt):
    return {(p, x, y): j for j, (p, x, y) in enumerate(zip(prompt[1], prompt[2], prompt[3]))}


def check_pair_rows(c, s, prompt, upto=None):
    """Every row s holds in either cache is the fingerprint of the prompt up to its token (+ the
    layer); the base holds the first `upto` tokens, the SWA cache at least the window of the
    query after them."""
    upto = len(prompt[0]) if upto is None else upto
    at = _depths(prompt)
    for part, il in ((c.base, 0), (c.swa, 1)):
        k = np.asarray(part.k(il))
        for key, (cell, _) in _keys(part, s).items():
            np.testing.assert_array_equal(k[cell], fingerprint(quads(prompt, at[key] + 1)) + il, err_msg=str(key))
    assert sorted(at[key] for key in _keys(c.base, s)) == list(range(upto))
    ws = (prompt[1][upto] if upto < len(prompt[0]) else prompt[1][-1] + 1) - N_SWA + 1
    window = {j for j in range(upto) if prompt[1][j] >= ws}
    assert window <= {at[key] for key in _keys(c.swa, s)}


def _first_difference(a, b):
    n = min(len(a[0]), len(b[0]))
    return next((j for j in range(n) if tuple(v[j] for v in a[:4]) != tuple(v[j] for v in b[:4])), n)


def _expected_hit(held, present, request):
    """The hit a small SWA cache serves a request: the longest q, at most the tokens it agrees
    with the held prompt on (token, position, x, y) and len - 1, whose window (the held tokens at
    or past the window start of the request's query at q) the SWA cache still has cells of."""
    upto = min(_first_difference(held, request), len(request[0]) - 1)
    best = 0
    for q in range(1, upto + 1):
        ws = request[1][q] - N_SWA + 1
        if all(j in present for j in range(q) if held[1][j] >= ws):
            best = q
    return best


def test_small_swa_cache_keeps_each_ghost_s_position_and_extension():
    c = _small()
    # an image early in a long prompt: the SWA cache overwrites its cells, the index keeps its tokens
    first, p = layout([("text", [1, 2, 3]), ("image", 7, 3, 2), ("text", [1 + i % 5 for i in range(290)])])
    n = len(first[0])
    assert compute(c, 0, first, 0, chunks=(8,), layers=2)
    swa = _keys(c.swa, 0)
    assert min(k[0] for k in swa) > 3                            # the image's cells are gone from the SWA cache
    assert c.prefix_release(0, tokens=first[0]) == n
    assert c.prefix_stats["swa"]["cells"] == len(swa) and c.prefix_stats["swa"]["evictable"] == n
    second = extend(first, layout([("text", [40, 41])], start=p)[0])
    toks, kw = args(second)
    # the SWA cache's own index matches through its ghosts on (token, position, x, y) ..
    assert c.swa.prefix_match(toks, **kw) == n
    # .. and stops at a ghost whose 2-D position, position or token the request places otherwise
    for variant in ([("text", [1, 2, 3]), ("image", 7, 2, 3)], [("text", [1, 2, 3]), ("gap", 1), ("image", 7, 3, 2)],
                    [("text", [1, 2, 3]), ("image", 8, 3, 2)]):
        other, q = layout(variant)
        other = extend(other, layout([("text", [1 + i % 5 for i in range(290)] + [40, 41])], start=q)[0])
        t2, kw2 = args(other)
        d = _first_difference(first, other)
        assert 3 <= d < 9
        assert c.swa.prefix_match(t2, **kw2) == d
        assert c.base.prefix_match(t2, **kw2) == d
        assert c.prefix_match(t2, **kw2) == 0                     # the SWA cache holds no window there
    # the chat's next turn attaches all of it: the SWA cache the window's cells, their extension back
    assert c.prefix_match(toks, **kw) == n
    assert c.prefix_attach(1, toks, **kw) == n
    got = _keys(c.swa, 1)
    assert sorted(k[0] for k in got) == [p - 3, p - 2, p - 1]
    assert all(ext == swa[key][1] for key, (_, ext) in got.items())
    assert compute(c, 1, second, n, layers=2)
    check_pair_rows(c, 1, second)
    assert c.prefix_release(1, tokens=second[0]) == len(second[0])
    c.base._prefix_check()
    c.swa._prefix_check()


def test_small_swa_cache_with_per_layer_embeddings_matches_their_inputs_through_ghosts():
    """Gemma 3n's setting: per-layer embeddings (each cell's input token in its extension) and a
    small SWA cache. An image's cells record the image token (ple_token) as their input, and a
    ghost keeps the input of the cell it stands for."""
    c = _small(ple_token=99)
    first, p = layout([("text", [1, 2]), ("image", 4, 2, 2), ("text", [1 + i % 5 for i in range(290)])])
    n = len(first[0])
    assert compute(c, 0, first, 0, chunks=(8,), layers=2)
    assert min(k[0] for k in _keys(c.swa, 0)) > 2                  # the image's cells are gone from the SWA cache
    as_input = [99 if i else t for t, i in zip(first[0], first[4])]   # the image's tokens by their input
    assert c.prefix_release(0, tokens=as_input, salt="image 4") == n
    second = extend(first, layout([("text", [7])], start=p)[0])
    toks, kw = args(second)
    toks = [99 if i else t for t, i in zip(toks, second[4])]
    assert c.swa.prefix_match(toks, salt="image 4", **kw) == n   # through the image's ghosts
    assert c.swa.prefix_match(args(second)[0], salt="image 4", **kw) == 2   # the image's ids were not its input
    assert c.prefix_attach(1, toks, salt="image 4", **kw) == n
    assert [ext[2] for _, ext in sorted(_keys(c.swa, 1).values())] == toks[n - 3:n]
    # a text token placed without its id: its cell's input was 99, and its ghost says so
    third, _ = layout([("text", [1, 2, 3] + [1 + i % 5 for i in range(290)])])
    assert compute(c, 2, third, 0, chunks=(8,), stop=2, layers=2)
    assert c.find_slot(UBatch([2], [2], pos_x=[2], pos_y=[2]))
    store_rows(c, third, 2, 3, layers=2)
    assert compute(c, 2, third, 3, chunks=(8,), layers=2)
    assert c.prefix_release(2, tokens=third[0]) == len(third[0])
    t3, kw3 = args(extend(third, layout([("text", [7])], start=len(third[0]))[0]))
    assert c.swa.prefix_match(t3, **kw3) == 2
    assert c.base.prefix_match(t3, **kw3) == 2
    c.base._prefix_check()
    c.swa._prefix_check()


def test_small_swa_cache_with_a_stream_per_sequence_brings_the_window_over():
    """kv_unified=False: a prefix held in another stream is a stream copy, the window's cells with
    their positions and extensions, the ghosts' records staying with the index."""
    c = kvcache.ISWACache(1024, 2, E, E, swa_layers=[1], n_swa=N_SWA, type_k="f32", type_v="f32", v_trans=False,
                          n_seq_max=2, n_batch=8, swa_full=False, semantics="2026", cell_ext=True, kv_unified=False)
    c.enable_prefix_reuse()
    first, p = layout([("text", [1, 2]), ("image", 4, 2, 2), ("text", [1 + i % 5 for i in range(290)])])
    n = len(first[0])
    assert compute(c, 0, first, 0, chunks=(8,), layers=2)
    assert c.prefix_release(0, tokens=first[0]) == n
    second = extend(first, layout([("text", [7, 8])], start=p)[0])
    toks, kw = args(second)
    assert c.prefix_attach(1, toks, **kw) == n
    c.update()                                                   # the stream copies
    assert sorted(c.swa.seq_cells(1)[1].tolist()) == [p - 3, p - 2, p - 1]
    assert compute(c, 1, second, n, layers=2)
    at = _depths(second)
    for part, il in ((c.base, 0), (c.swa, 1)):
        cells, pos = part.seq_cells(1)
        k = np.asarray(part.k(il)).reshape(2, -1, E)[1]
        for cell, q, e in zip(cells, pos, part.stream_cells()[1].ext[cells]):
            np.testing.assert_array_equal(k[cell], fingerprint(quads(second, at[(int(q), int(e[0]), int(e[1]))] + 1)) + il)
    assert c.prefix_release(1, tokens=toks) == len(toks)
    c.base._prefix_check()
    c.swa._prefix_check()


@st.composite
def long_prompts(draw):
    """prompts() with a long text somewhere in it, so that the SWA cache overwrites cells."""
    segs = draw(prompts())
    seed, length = draw(st.integers(0, 99)), draw(st.integers(240, 300))
    segs.insert(draw(st.integers(0, len(segs))), ("text", [1 + (seed + i * i) % 5 for i in range(length)]))
    return segs


def _variant(segs, where, how):
    """segs changed at segment `where`: a token or image id, an image transposed, or the positions
    from there on one later."""
    segs = list(segs)
    seg = segs[where % len(segs)]
    if how == "gap":
        segs.insert(where % len(segs), ("gap", 1))
    elif seg[0] == "text":
        segs[where % len(segs)] = ("text", seg[1][:-1] + [6])
    elif how == "token":
        segs[where % len(segs)] = ("image", 3, seg[2], seg[3])
    else:
        segs[where % len(segs)] = ("image", seg[1], seg[3], seg[2])
    return segs


@settings(max_examples=60, deadline=None)
@given(segs=long_prompts(), more=prompts(), chunks=st.lists(st.integers(1, 8), min_size=1, max_size=3),
       chunks2=st.lists(st.integers(1, 8), min_size=1, max_size=3), where=st.integers(0, 400),
       how=st.sampled_from(["none", "token", "xy", "gap", "cut"]))
def test_small_swa_cache_random_prompts_with_images_are_reused_exactly(segs, more, chunks, chunks2, where, how):
    """Random prompts with images in random ubatches; a request that continues one, or differs from
    it in a token (anywhere, an image's too), an image's 2-D layout or its positions: the hit is exactly the longest prefix
    it agrees on whose window the SWA cache still holds, the SWA cells attached carry their
    extension, every row is its prefix's fingerprint, and each ubatch computed after the attach
    sees (KQ masks of both caches) exactly the keys recomputation from scratch shows it."""
    c = _small()
    first, p = layout(segs)
    n = len(first[0])
    assert compute(c, 0, first, 0, chunks=tuple(chunks), layers=2)
    swa = _keys(c.swa, 0)
    at = _depths(first)
    present = {at[key] for key in swa}
    assert c.prefix_release(0, tokens=first[0]) == n
    request, _ = layout((segs if how in ("none", "cut") else _variant(segs, where, how)) + more)
    if how == "cut":
        request[0][where % n] = 99
    toks, kw = args(request)
    expected = _expected_hit(first, present, request)
    assert c.prefix_match(toks, **kw) == expected
    k = c.prefix_attach(1, toks, **kw)
    assert k == expected
    if k:
        check_pair_rows(c, 1, request, k)
        # the SWA cache got exactly the window's cells, each with the extension it was computed with
        ws = request[1][k] - N_SWA + 1
        got = _keys(c.swa, 1)
        assert sorted(at[key] for key in got) == [j for j in range(k) if first[1][j] >= ws]
        assert all(ext == swa[key][1] for key, (_, ext) in got.items())
    # the same request computed from scratch in another cache, the rest in the same ubatches; an
    # image's tokens in one ubatch, since placement, as llama.cpp's, takes the next query to be
    # one past the sequence's last position: the rest of an image at that same position may
    # lose a cell of its window to it (reused or not, whenever the SWA cache is full), and so
    # may the rest of an image the attach ended inside of
    fresh = _small()
    assert compute(fresh, 0, request, 0, chunks=tuple(chunks), stop=k, layers=2)
    inside = 0 < k < len(toks) and request[1][k] == request[1][k - 1]
    for a, b, ub in ubatches(request, 1, k, tuple(chunks2), whole_images=True):
        ub0 = UBatch(list(ub.pos), [0] * (b - a), tokens=ub.tokens, pos_x=ub.pos_x, pos_y=ub.pos_y)
        assert c.find_slot(ub) and fresh.find_slot(ub0)
        store_rows(c, request, a, b, layers=2)
        store_rows(fresh, request, a, b, layers=2)
        if inside and request[1][a] == request[1][k - 1]:
            continue
        for cache, u, seen in ((c, ub, []), (fresh, ub0, [])):
            for part, il, mask in zip((cache.base, cache.swa), (0, 1), cache.kq_mask(u)):
                kk, cells = np.asarray(part.k(il)), part.cells()
                seen.append([sorted((int(cells.pos[i]), int(cells.ext[i][0]), int(cells.ext[i][1]),
                                     kk[i].tobytes()) for i in np.flatnonzero(row == 0)) for row in mask[0]])
            if cache is c:
                reused = seen
        assert reused == seen, (a, b)
    check_pair_rows(c, 1, request)
    assert c.prefix_release(1, tokens=toks) <= len(toks)
    c.base._prefix_check()
    c.swa._prefix_check()


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
