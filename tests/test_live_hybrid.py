"""Live interop of hybrid models with today's llama.cpp (llama-cpp-python 0.3.36, layout "2026").

Skipped unless llama_cpp 0.3.36 is importable: .ci/run's llama36 stage runs this file with
tests/test_live_v10.py, in a process of their own. Two tiny random-weight hybrid models are
written with the gguf package at test time, whose recurrent layers differ:

- LFM2: layers 0 and 2 short convolutions (an R state of n_embd * (l_cache - 1) floats, no S),
  1 and 3 attention; llama.cpp allows it rollback snapshots (n_rs_seq);
- granitehybrid (Granite 4): layers 0, 2 and 3 Mamba-2 (R: the convolution's columns of x, B
  and C; S: d_state * d_inner), layer 1 attention; llama.cpp sets its n_rs_seq to 0 without a
  word (a debug line), which the tests check;
- LFM2 with lfm2.attention.sliding_window 4: llama.cpp's llama_memory_hybrid_iswa, its attention
  layers windowed in an iSWA pair (a base cache of the cells and no layer, a SWA cache of both
  attention layers), the sequence states leaving out the cells outside the window.

llama.cpp decodes a script of four sequences on each (a sequence copied, a batch of two
sequences); kvcache's HybridCache of the same geometry (``kvcache.from_gguf(...,
semantics="2026")``) follows the same script, and both must agree on every sequence's range and
on the sizes llama.cpp logs (``kvcache plan``'s lines). Then, as tests/test_live_v10.py does
for the other caches: every kind of file llama.cpp writes (sequence blobs, whole state, session
file, sequence file, and the recurrent part alone) restores into the HybridCache and is written
back byte for byte, and every kind kvcache writes loads into llama.cpp and decodes the next token
as llama.cpp's own file does. On LFM2, a speculative tail removed with seq_rm shows rule C9
(docs/semantics.md): a rollback within the last ubatch decodes on as a fresh decode of the kept
tokens, kvcache accepts it, and the state after it crosses both ways; a rollback past it is
accepted by llama.cpp, whose next logits then differ from a fresh decode, and kvcache refuses it.

Each context is checked against llama.cpp's own log lines first (test_live_v10.Live.context):
0.3.36's ctypes bindings take assignments to fields that no longer exist without a word."""
import ctypes
import re

import numpy as np
import pytest

import kvcache
from kvcache import cli

from conftest import need_module
from interop_data import model_path
from test_live_v10 import Live, _cross_both_ways, _llama, add_ffn, close_gguf, copy_tokenizer, random_weights

# The two models: 4 layers, n_embd 64, 4 query heads of 16, 2 KV heads on the attention layers
# (n_head_kv 0 marks a recurrent layer), n_ff 128, the vocabulary of tiny_llama.gguf.
MODELS = {
    "lfm2": {"arch": "lfm2", "n_head_kv": [0, 2, 0, 2], "l_cache": 3},
    "lfm2swa": {"arch": "lfm2", "n_head_kv": [0, 2, 0, 2], "l_cache": 3, "n_swa": 4},
    # Mamba-2: d_inner = 2 * n_embd (llama.cpp supports no other expansion), 8 heads of 16,
    # one group of B and C of d_state 16, a convolution of 4
    "granitehybrid": {"arch": "granitehybrid", "n_head_kv": [0, 2, 0, 0], "d_conv": 4, "d_inner": 128,
                      "d_state": 16, "n_group": 1, "n_ssm_head": 8},
}
N_EMBD, N_HEAD, HEAD, N_FF = 64, 4, 16, 128

# The context of every test (in the terms of test_live_v10's manifests): 256 cells, 4 sequences
# in one stream, f16 K/V with flash attention off (V transposed), ubatches of 64.
CTX = {"n_ctx": 256, "n_batch": 64, "n_ubatch": 64, "n_seq_max": 4, "type_k": 1, "type_v": 1, "flash_attn": False,
       "kv_unified": True}


def _ctx(n_rs_seq=0):
    return {"context": dict(CTX, n_rs_seq=n_rs_seq), "memory_kind": "hybrid"}


def _run(seq, p0, n, salt=0):
    """n tokens of seq from position p0: [(token, pos, [seq])]."""
    return [((7 + 13 * (p + salt) + 31 * seq) % 290 + 3, p, [seq]) for p in range(p0, p0 + n)]


# seq 0 decodes 23 tokens, seq 1 9; seq 2 takes a copy of seq 0 and decodes 3 more; then one
# batch of seq 1's next 2 tokens and seq 3's first 5 (ubatches of equal sequence runs)
SCRIPT = [
    {"op": "decode", "tokens": _run(0, 0, 23)},
    {"op": "decode", "tokens": _run(1, 0, 9)},
    {"op": "seq_cp", "args": [0, 2, -1, -1]},
    {"op": "decode", "tokens": _run(2, 23, 3)},
    {"op": "decode", "tokens": _run(1, 9, 2) + _run(3, 0, 5)},
]
NEXT = {"token": 77, "pos": 23}     # seq 0's next step


def write_hybrid_model(path, name, vocab_from, seed=0):
    """Write the tiny model MODELS[name] describes to path (random f32 weights), with the
    tokenizer keys of the GGUF file vocab_from. The keys and tensors are those llama.cpp's
    loaders for the architecture read (llama-model.cpp, models/lfm2.cpp, granite-hybrid.cpp)."""
    gguf = need_module("test", "gguf")
    spec = MODELS[name]
    arch, n_head_kv = spec["arch"], spec["n_head_kv"]
    n_layer, n_kv = len(n_head_kv), HEAD * max(n_head_kv)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_uint32(f"{arch}.context_length", 512)
    w.add_uint32(f"{arch}.embedding_length", N_EMBD)
    w.add_uint32(f"{arch}.block_count", n_layer)
    w.add_uint32(f"{arch}.feed_forward_length", N_FF)
    w.add_uint32(f"{arch}.attention.head_count", N_HEAD)
    w.add_array(f"{arch}.attention.head_count_kv", n_head_kv)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_uint32(f"{arch}.rope.dimension_count", HEAD)
    w.add_float32(f"{arch}.rope.freq_base", 10000.0)
    if arch == "lfm2":
        w.add_uint32(f"{arch}.shortconv.l_cache", spec["l_cache"])
        if spec.get("n_swa"):
            w.add_uint32(f"{arch}.attention.sliding_window", spec["n_swa"])
    else:
        w.add_uint32(f"{arch}.ssm.conv_kernel", spec["d_conv"])
        w.add_uint32(f"{arch}.ssm.inner_size", spec["d_inner"])
        w.add_uint32(f"{arch}.ssm.state_size", spec["d_state"])
        w.add_uint32(f"{arch}.ssm.time_step_rank", spec["n_ssm_head"])
        w.add_uint32(f"{arch}.ssm.group_count", spec["n_group"])
    n_vocab = copy_tokenizer(w, vocab_from)
    rand = random_weights(seed)
    ones = np.ones(N_EMBD, np.float32)
    w.add_tensor("token_embd.weight", rand(n_vocab, N_EMBD))
    # LFM2's final norm has the name of an embedding norm
    w.add_tensor("token_embd_norm.weight" if arch == "lfm2" else "output_norm.weight", ones)
    w.add_tensor("output.weight", rand(n_vocab, N_EMBD))
    for il in range(n_layer):
        b = f"blk.{il}."
        w.add_tensor(b + "attn_norm.weight", ones)
        if n_head_kv[il]:
            if arch == "lfm2":
                w.add_tensor(b + "attn_q_norm.weight", np.ones(HEAD, np.float32))
                w.add_tensor(b + "attn_k_norm.weight", np.ones(HEAD, np.float32))
            w.add_tensor(b + "attn_q.weight", rand(N_EMBD, N_EMBD))
            w.add_tensor(b + "attn_k.weight", rand(n_kv, N_EMBD))
            w.add_tensor(b + "attn_v.weight", rand(n_kv, N_EMBD))
            w.add_tensor(b + "attn_output.weight", rand(N_EMBD, N_EMBD))
        elif arch == "lfm2":
            w.add_tensor(b + "shortconv.conv.weight", rand(N_EMBD, spec["l_cache"]))
            w.add_tensor(b + "shortconv.in_proj.weight", rand(3 * N_EMBD, N_EMBD))
            w.add_tensor(b + "shortconv.out_proj.weight", rand(N_EMBD, N_EMBD))
        else:
            d_inner, n_bc, heads = spec["d_inner"], 2 * spec["n_group"] * spec["d_state"], spec["n_ssm_head"]
            w.add_tensor(b + "ssm_in.weight", rand(2 * d_inner + n_bc + heads, N_EMBD))   # z, x, B, C, dt
            w.add_tensor(b + "ssm_conv1d.weight", rand(d_inner + n_bc, spec["d_conv"]))
            w.add_tensor(b + "ssm_conv1d.bias", rand(d_inner + n_bc))
            w.add_tensor(b + "ssm_dt.bias", rand(heads))
            # A < 0: a decaying state (the converter stores -exp(A_log))
            w.add_tensor(b + "ssm_a", -np.exp(rand(heads, 1)))
            w.add_tensor(b + "ssm_d", rand(heads, 1))
            w.add_tensor(b + "ssm_norm.weight", np.ones((spec["n_group"], d_inner // spec["n_group"]), np.float32))
            w.add_tensor(b + "ssm_out.weight", rand(N_EMBD, d_inner))
        add_ffn(w, b, rand, N_EMBD, N_FF)
    close_gguf(w)
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    _llama()     # skips (or fails) first when llama.cpp 0.3.36 is not here
    d = tmp_path_factory.mktemp("hybrid")
    return {name: write_hybrid_model(d / f"tiny_{name}.gguf", name, model_path("tiny_llama.gguf"))
            for name in MODELS}


def _cache(path, n_rs_seq=0):
    """kvcache's hybrid memory of the test context, from the model file (the SWA cache of a
    window sized by it, as Live.context asks llama.cpp: swa_full off)."""
    return kvcache.from_gguf(path, CTX["n_ctx"], n_seq_max=CTX["n_seq_max"], flash_attn=CTX["flash_attn"],
                             n_batch=CTX["n_ubatch"], semantics="2026", kv_unified=CTX["kv_unified"],
                             n_rs_seq=n_rs_seq, swa_full=False)


def _hybrid_context(live, path, n_rs_seq, capsys):
    """A context of the test's parameters, checked against llama.cpp's log: the lines `kvcache
    plan` gives for the model (the attention cache's and the recurrent memory's sizes, the
    snapshots kept), and the n_rs_seq llama.cpp keeps."""
    ctx = live.context(_ctx(n_rs_seq))
    logged = [line.rstrip("\n") for line in Live.lines]
    log = "\n".join(logged)
    capsys.readouterr()
    window = ["--no-swa-full", "--n-ubatch", str(CTX["n_ubatch"])] if kvcache.read_gguf(path).n_swa else []
    assert cli.main(["plan", str(path), "--n-ctx", str(CTX["n_ctx"]), "--n-seq-max", str(CTX["n_seq_max"]),
                     "--semantics", "2026", "--kv-unified", "--n-rs-seq", str(n_rs_seq), *window]) == 0
    out = capsys.readouterr().out
    plan = [line.strip() for line in out.splitlines()
            if re.match(r"\s*(llama_kv_cache|llama_kv_cache_iswa|llama_memory_recurrent):", line)]
    assert any("llama_memory_recurrent: size" in line for line in plan), out
    assert all(line in logged for line in plan), (plan, log)
    kept = live.L.llama_n_rs_seq(ctx)
    assert re.search(rf"llama_context: n_rs_seq\s+= {kept}$", log, re.M), log
    return ctx, kept


def _drive(h, script, n_ubatch=CTX["n_ubatch"]):
    """Replay a script on kvcache's hybrid memory as llama.cpp's decode cuts and places it; the
    results of its seq_rm ops."""
    rm = []
    for op in script:
        if op["op"] == "decode":
            pos = [p for _, p, _ in op["tokens"]]
            seqs = [s[0] for _, _, s in op["tokens"]]
            for ub in h.ubatches(pos, seqs, n_ubatch):
                assert h.find_slot(ub), op
        elif op["op"] == "seq_cp":
            h.seq_cp(*op["args"])
        elif op["op"] == "seq_rm":
            rm.append(h.seq_rm(*op["args"]))
        else:
            raise AssertionError(f"unknown op {op}")
    return rm


def _ranges_of(live, ctx):
    L = live.L
    mem = L.llama_get_memory(ctx)
    return [(L.llama_memory_seq_pos_min(mem, s), L.llama_memory_seq_pos_max(mem, s)) for s in range(CTX["n_seq_max"])]


@pytest.mark.parametrize("name", list(MODELS))
def test_live_hybrid_geometry(models, name, capsys):
    """llama.cpp loads each model as a hybrid memory of the layers, sizes and snapshots kvcache
    gives it; after the script both hold the same range for every sequence; and the attention
    part of each sequence blob is an ordinary KV state: kvcache's attention part reads it and
    writes the same bytes."""
    path = models[name]
    live = Live(path)
    L = live.L
    assert L.llama_model_is_hybrid(live.model) and not L.llama_model_is_recurrent(live.model)
    geo = kvcache.read_gguf(path)
    spec = MODELS[name]
    assert list(geo.attn_layers) == [il for il, h in enumerate(spec["n_head_kv"]) if h]
    assert list(geo.recurrent_layers) == [il for il, h in enumerate(spec["n_head_kv"]) if not h]
    # asked for 4 snapshots: LFM2 keeps them, granitehybrid none (a debug line says so)
    ctx, kept = _hybrid_context(live, path, 4, capsys)
    log = "\n".join(Live.lines)
    h = _cache(path, n_rs_seq=4)
    assert kept == h.n_rs_seq == (4 if spec["arch"] == "lfm2" else 0)
    if name == "granitehybrid":
        assert "n_rs_seq=4 requested but model does not support recurrent partial rollback; clamping to 0" in log
    cells = h.attn.base if h.n_swa else h.attn
    assert (cells.size, h.recr.size, h.attn_layers, h.recurrent_layers) == (
        CTX["n_ctx"], CTX["n_seq_max"], geo.attn_layers, geo.recurrent_layers)
    # LFM2 with a window: llama_memory_hybrid_iswa, its attention layers in the SWA cache
    assert h.swa_layers == (geo.attn_layers if spec.get("n_swa") else ())
    if spec.get("n_swa"):
        assert "llama_kv_cache_iswa: creating     SWA KV cache, size = 256 cells" in log
    try:
        live.replay(ctx, SCRIPT)
        ranges = _ranges_of(live, ctx)
        blobs = {s: live.seq_get(ctx, s) for s in range(CTX["n_seq_max"])}
        for s, blob in blobs.items():
            assert L.llama_state_seq_get_size(ctx, s) == len(blob)
    finally:
        L.llama_free(ctx)
    assert _drive(h, SCRIPT) == []
    assert [(h.seq_pos_min(s), h.seq_pos_max(s)) for s in range(CTX["n_seq_max"])] == ranges
    assert ranges == [(22, 22), (10, 10), (25, 25), (4, 4)], "the recurrent part holds the last position"
    for s, blob in blobs.items():
        attn = _cache(path).attn
        n = attn.state_read(blob, s, exact=False)
        assert 8 < n < len(blob)
        assert attn.state_write(s) == blob[:n], (name, s)


def _decode_script(live, ctx, script):
    """Replay a script of decodes and seq_rm on a context; the seq_rm results."""
    L = live.L
    mem = L.llama_get_memory(ctx)
    rm = []
    for op in script:
        if op["op"] == "decode":
            live.decode(ctx, op["tokens"])
        else:
            rm.append(L.llama_memory_seq_rm(mem, *op["args"]))
    return rm


@pytest.mark.parametrize("first, spec, exact", [(11, 5, True), (12, 4, False)])
def test_live_lfm2_rollback(models, first, spec, exact, capsys):
    """LFM2 with 4 snapshots: seq 0 decodes 16 tokens as first + spec in two decodes, then
    seq_rm(0, 12, -1) removes the last 4. After 11 + 5 the state 4 tokens back is a plane of the
    last ubatch: llama.cpp decodes on exactly as a fresh context that decoded the 12 kept tokens,
    and kvcache accepts the rollback. After 12 + 4 it is not (rule C9): llama.cpp accepts it all
    the same and decodes from an older state, away from the fresh decode, while kvcache's seq_rm
    returns False and leaves both parts as they were."""
    path = models["lfm2"]
    live = Live(path)
    L = live.L
    tokens = _run(0, 0, 16)
    script = [{"op": "decode", "tokens": tokens[:first]}, {"op": "decode", "tokens": tokens[first:]},
              {"op": "seq_rm", "args": [0, 12, -1]}]
    nxt = [(NEXT["token"], 12, [0])]
    ctx, kept = _hybrid_context(live, path, 4, capsys)
    try:
        assert kept == 4
        assert _decode_script(live, ctx, script) == [True], "llama.cpp accepts both rollbacks"
        after = _ranges_of(live, ctx)
        logits = live.decode(ctx, nxt)
    finally:
        L.llama_free(ctx)
    fresh_ctx, _ = _hybrid_context(live, path, 4, capsys)
    try:
        live.decode(fresh_ctx, tokens[:12])
        fresh = live.decode(fresh_ctx, nxt)
    finally:
        L.llama_free(fresh_ctx)
    h = _cache(path, n_rs_seq=4)
    assert _drive(h, script[:2]) == []
    before = [(h.seq_pos_min(s), h.seq_pos_max(s)) for s in range(CTX["n_seq_max"])]
    assert h.rollback_ok(0, 4) is exact
    assert h.seq_rm(0, 12, -1) is exact
    if exact:
        np.testing.assert_allclose(logits, fresh, rtol=0, atol=1e-4)
        assert [(h.seq_pos_min(s), h.seq_pos_max(s)) for s in range(CTX["n_seq_max"])] == after
        assert after[0] == (11, 11)
    else:
        assert np.abs(logits - fresh).max() > 1e-2, "llama.cpp decoded from the state of position 7"
        assert [(h.seq_pos_min(s), h.seq_pos_max(s)) for s in range(CTX["n_seq_max"])] == before
        assert before[0] == (15, 15) and after[0] == (11, 11)


# seq 0 decodes 16 tokens as 11 + 5 and a rollback removes the last 4 (within the last ubatch:
# exact); the next step is seq 0's token at position 12
ROLLBACK_SCRIPT = [{"op": "decode", "tokens": _run(0, 0, 11)}, {"op": "decode", "tokens": _run(0, 11, 5)},
                   {"op": "seq_rm", "args": [0, 12, -1]}]


@pytest.mark.parametrize("name, n_rs_seq, script, nxt", [
    ("lfm2", 0, SCRIPT, NEXT),
    ("granitehybrid", 4, SCRIPT, NEXT),
    ("lfm2", 4, ROLLBACK_SCRIPT, {"token": NEXT["token"], "pos": 12}),
    ("lfm2swa", 0, SCRIPT, NEXT),
], ids=["lfm2", "granitehybrid", "lfm2-rollback", "lfm2swa"])
def test_live_hybrid_files_cross_both_ways(models, name, n_rs_seq, script, nxt, tmp_path, capsys):
    """test_live_v10's round trip for the hybrid models: llama.cpp replays the script, then every
    kind of file it writes (sequence blobs of the 4 sequences, whole state, session file,
    sequence file) restores into kvcache's HybridCache (kvcache.from_gguf of the model file) and
    is written back byte for byte; every kind kvcache writes loads into a fresh llama.cpp
    context and decodes seq 0's next token as llama.cpp's own file of that kind does (and as the
    uninterrupted run, within 1e-4). After LFM2's rollback the files hold the state the rollback
    points at (snapshots are not written), and decoding on from kvcache's is llama.cpp's. The
    sizes kvcache gives (state_size) are the bytes it writes."""
    path = models[name]
    live = Live(path)
    ctx, _ = _hybrid_context(live, path, n_rs_seq, capsys)
    m = {"context": dict(CTX, n_rs_seq=n_rs_seq), "memory_kind": "hybrid", "script": script,
         "model": {"path": str(path)}}
    cache = _cross_both_ways(live, ctx, m, nxt, tmp_path, name)
    assert isinstance(cache, kvcache.HybridCache)
    for s in range(CTX["n_seq_max"]):
        assert cache.state_size(s) == len(cache.state_write(s)), s
    assert cache.state_size() == len(cache.state_write())


def _seq_get_partial(live, ctx, s) -> bytes:
    """llama.cpp's state of sequence s with LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY: the recurrent part."""
    L = live.L
    flag = L.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY
    n = L.llama_state_seq_get_size_ext(ctx, s, flag)
    buf = (ctypes.c_uint8 * n)()
    assert L.llama_state_seq_get_data_ext(ctx, buf, n, s, flag) == n
    return bytes(buf)


@pytest.mark.parametrize("name", list(MODELS))
def test_live_hybrid_partial_state(models, name, capsys):
    """The recurrent part alone (LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY), which llama.cpp writes for
    speculative decoding: kvcache's partial_only state of each sequence restored from llama.cpp's
    full blob is llama.cpp's partial blob byte for byte; llama.cpp's partial blob read over that
    sequence's state gives back the full blob; and kvcache's partial blob loads into llama.cpp."""
    path = models[name]
    live = Live(path)
    L = live.L
    ctx, _ = _hybrid_context(live, path, 0, capsys)
    try:
        live.replay(ctx, SCRIPT)
        full = {s: live.seq_get(ctx, s) for s in range(CTX["n_seq_max"])}
        part = {s: _seq_get_partial(live, ctx, s) for s in range(CTX["n_seq_max"])}
    finally:
        L.llama_free(ctx)
    for s in full:
        c = _cache(path)
        assert c.state_read(full[s], s, exact=True) == len(full[s])
        ours = c.state_write(s, partial_only=True)
        assert c.state_size(s, partial_only=True) == len(ours)
        assert ours == part[s], (name, s)
        assert c.state_read(part[s], s, exact=True, partial_only=True) == len(part[s])
        assert c.state_write(s) == full[s], (name, s)
        b, _ = _hybrid_context(live, path, 0, capsys)
        try:
            buf = (ctypes.c_uint8 * len(ours)).from_buffer_copy(ours)
            assert L.llama_state_seq_set_data_ext(b, buf, len(ours), s, L.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY) == len(ours)
        finally:
            L.llama_free(b)



_SHIFT_IN_LLAMA = """
import sys
from test_live_hybrid import CTX, NEXT, Live, _ctx, _run
live = Live(sys.argv[1])
ctx = live.context(_ctx(0))
mem = live.L.llama_get_memory(ctx)
live.replay(ctx, [{"op": "decode", "tokens": _run(0, 0, 23)}])
print("can_shift", live.L.llama_memory_can_shift(mem), flush=True)
live.L.llama_memory_seq_add(mem, 0, 0, -1, 5)
live.decode(ctx, [(NEXT["token"], 28, [0])])
print("decoded", flush=True)
"""


def test_live_lfm2swa_k_shift(models, capsys, tmp_path):
    """The K-shift of llama_memory_hybrid_iswa on LFM2 with a window of 4 (every attention layer
    windowed, as LFM2's loader marks them: the iSWA pair's base cache holds the cells and no
    layer). llama.cpp 0.3.36 reports can_shift true but aborts the decode that applies a
    llama_memory_seq_add (GGML_ASSERT(buffer) in set_input_k_shift: the base cache's shift
    graph has no layer, so its shift input gets no buffer), in a process of its own here. So
    kvcache's shift is compared with what it stands for: seq 0's 23 tokens decoded by llama.cpp
    at positions 0 .. 22, read into kvcache, moved 5 on (seq_add; both parts) and rotated by
    update(), against the same tokens decoded by llama.cpp at positions 5 .. 27 from the start:
    the same positions in both parts, the window's V rows and K rows within f16 rounding (the
    rotation by 5 of a row rounded to f16 at its first position, against a row rotated once).
    can_shift is llama_memory_can_shift's answer, here and for a context whose SWA cache is
    smaller than its base cache."""
    import os
    import subprocess
    import sys

    from kvcache._store_parts import rows_of

    path = models["lfm2swa"]
    here = os.path.dirname(__file__)
    paths = [here] + [os.path.abspath(x) for x in os.environ.get("PYTHONPATH", "").split(os.pathsep) if x]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths))
    run = subprocess.run([sys.executable, "-c", _SHIFT_IN_LLAMA, str(path)], capture_output=True, text=True,
                         env=env, cwd=str(tmp_path), timeout=300)
    assert "can_shift True" in run.stdout and "decoded" not in run.stdout and run.returncode != 0, run
    assert "GGML_ASSERT(buffer) failed" in run.stderr, run.stderr[-2000:]

    live = Live(path)
    L = live.L
    shift = 5
    blobs = {}
    for at in (0, shift):
        ctx, _ = _hybrid_context(live, path, 0, capsys)
        try:
            live.decode(ctx, [(t, p + at, s) for t, p, s in _run(0, 0, 23)])
            blobs[at] = live.seq_get(ctx, 0)
            can = L.llama_memory_can_shift(L.llama_get_memory(ctx))
        finally:
            L.llama_free(ctx)
    h = _cache(path)
    assert h.can_shift is bool(can) is True
    assert h.state_read(blobs[0], 0) == len(blobs[0])
    h.seq_add(0, 0, -1, shift)
    assert h.update()
    fresh = _cache(path)
    fresh.state_read(blobs[shift], 0)
    for part in ("base", "swa"):
        a, b = getattr(h.attn, part), getattr(fresh.attn, part)
        assert sorted(a.seq_cells(0)[1]) == sorted(b.seq_cells(0)[1]), part
    assert (h.seq_pos_min(0), h.seq_pos_max(0)) == (fresh.seq_pos_min(0), fresh.seq_pos_max(0)) == (27, 27)
    ours, theirs = h.attn.swa, fresh.attn.swa
    mine = dict(zip(ours.seq_cells(0)[1], ours.seq_cells(0)[0]))
    want = dict(zip(theirs.seq_cells(0)[1], theirs.seq_cells(0)[0]))
    assert sorted(mine) == list(range(23 + shift - h.n_swa, 23 + shift))
    for il in h.swa_layers:
        k1, v1 = rows_of(ours, il, np.array([mine[p] for p in sorted(mine)]))
        k2, v2 = rows_of(theirs, il, np.array([want[p] for p in sorted(mine)]))
        for x, y in ((k1, k2), (v1, v2)):
            x, y = x.view(np.float16).astype(np.float32), y.view(np.float16).astype(np.float32)
            np.testing.assert_allclose(x, y, rtol=0, atol=4 * 2.0 ** -10 * max(1.0, float(np.abs(y).max())))
    # a context of 512 cells: a SWA cache of 256, and no shift in llama.cpp's eyes
    big = live.context({"context": dict(CTX, n_ctx=512), "memory_kind": "hybrid"})
    try:
        can_big = L.llama_memory_can_shift(L.llama_get_memory(big))
    finally:
        L.llama_free(big)
    h = kvcache.from_gguf(path, 512, n_seq_max=CTX["n_seq_max"], flash_attn=False, n_batch=CTX["n_ubatch"],
                          semantics="2026", kv_unified=True, swa_full=False)
    assert (h.attn.size_base, h.attn.size_swa) == (512, 256)
    assert h.can_shift is bool(can_big) is False
