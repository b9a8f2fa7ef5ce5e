"""Live state interop with today's llama.cpp (llama-cpp-python 0.3.36, layout "2026").

Skipped unless llama_cpp 0.3.36 is importable: .ci/run's llama36 stage builds it from source
into a directory of its own and runs this file in a process of its own (one process loads one
llama.cpp). For every scenario (f16 with flash attention off and on, q8_0, bf16, gemma2 iSWA,
mamba, and the M-RoPE model below) llama.cpp decodes the manifest's script, then:

1. every kind of file it writes (sequence blobs, whole-context state, session file, sequence
   file) restores into kvcache and is written back byte for byte in layout "2026";
2. every kind kvcache writes in "2026" loads into a fresh llama.cpp context, and decoding the
   next token there gives the logits of the uninterrupted run (within 1e-4: a restore compacts
   the cells, which changes the order of llama.cpp's sums) and exactly those of llama.cpp's own
   state of the same kind loaded the same way. With several streams every sequence's blob loads
   into its own stream of a fresh context and decodes as llama.cpp's own blob of that sequence.

Each restored sequence is also handed to a fresh cache through seq_export / seq_import_begin,
which must then write llama.cpp's blob of that sequence (for the M-RoPE model too: the hand-off
carries the per-cell extension).

A tiny M-RoPE model (qwen2vl, random weights) is written with the gguf package at test time: its
cell records carry llama.cpp's 12-byte per-cell extension (x, y, token), checked byte by byte
for text tokens and for an image's embeddings; its files restore into
UnifiedCache(semantics="2026", cell_ext=True), and its next step is one more embedding of the
image, which llama.cpp's M-RoPE mask decodes by the cells' x and y.

0.3.36's ctypes bindings take assignments to fields that no longer exist without a word, so
each context is checked against llama.cpp's own log lines (flash attention, kv_unified and the
stream count, the K/V types) before anything else."""
import ctypes
import io
import json
import os
import re

import numpy as np
import pytest

import kvcache
import kvcache.plan
from kvcache import statefile
from kvcache.handoff import copy_regions

from conftest import need, need_module
from live_llama import LlamaCalls
from interop_data import interop_dir, interop_v10_dir, manifest, model_path

# scenario -> (where its manifest is, the reference logits' folder)
SCENARIOS = {
    "llama_fa0": "v10", "llama_fa1": "v10", "llama_q8_fa1": "v10", "mamba": "v10",
    "llama_bf16_fa1": "v9", "gemma2_fa0": "v9", "llama_fa0_streams": "v10",
}
TYPE_NAMES = {0: "f32", 1: "f16", 8: "q8_0", 30: "bf16"}


def _llama():
    try:
        import llama_cpp as L
    except ImportError as e:
        need("llama36", f"llama_cpp is not importable ({e}); .ci/run's llama36 stage installs 0.3.36")
    if getattr(L, "__version__", None) != "0.3.36":
        need("llama36", f"llama-cpp-python {L.__version__} is importable; these tests are for 0.3.36")
    return L


class Live(LlamaCalls):
    """One model through 0.3.36's low-level API, with llama.cpp's log lines kept."""

    _models: dict = {}
    _cb = None
    lines: list = []

    def __init__(self, model: str):
        self.L = L = _llama()
        if Live._cb is None:
            def log(level, text, user):
                s = text.decode("utf-8", "replace") if text else ""
                if level == 5 and Live.lines:      # a continuation of the previous line
                    Live.lines[-1] += s
                else:
                    Live.lines.append(s)
            Live._cb = L.llama_log_callback(log)
            L.llama_log_set(Live._cb, ctypes.c_void_p(0))
            L.llama_backend_init()
        # a name of the shared models, or the path of a model file written here
        path = str(model) if isinstance(model, os.PathLike) else str(model_path(model))
        if path not in Live._models:
            p = L.llama_model_default_params()
            p.n_gpu_layers = 0
            Live._models[path] = L.llama_model_load_from_file(path.encode(), p)
            assert Live._models[path], f"llama.cpp could not load {model}"
        self.model = Live._models[path]
        self.n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model))

    def context(self, m: dict, swa_full: bool = False):
        """A context of the manifest's parameters, checked against what llama.cpp logs."""
        L = self.L
        c = m["context"]
        p = L.llama_context_default_params()
        fields = dict(p._fields_)
        want = {"n_ctx": c["n_ctx_requested"] if "n_ctx_requested" in c else c["n_ctx"], "n_batch": c["n_batch"],
                "n_ubatch": c["n_ubatch"], "n_seq_max": c["n_seq_max"], "type_k": c["type_k"],
                "type_v": c["type_v"], "flash_attn_type": 1 if c["flash_attn"] else 0, "swa_full": swa_full,
                "kv_unified": _unified(c), "n_threads": 1, "n_threads_batch": 1,
                "n_rs_seq": c.get("n_rs_seq", 0)}
        for name, value in want.items():
            assert name in fields, f"llama_context_params has no field {name} (the bindings changed)"
            setattr(p, name, value)
        del Live.lines[:]
        ctx = L.llama_init_from_model(self.model, p)
        assert ctx
        log = "\n".join(Live.lines)
        fa = "enabled" if c["flash_attn"] else "disabled"
        assert re.search(rf"llama_context: flash_attn\s+= {fa}", log), log
        assert re.search(rf"llama_context: kv_unified\s+= {'true' if _unified(c) else 'false'}", log), log
        if m["memory_kind"] != "recurrent":
            # each K/V cache logs "n_seq_max/n_stream seqs": one stream per sequence unless unified
            seqs = re.findall(r"llama_kv_cache: size = .*layers,\s+(\d+)/(\d+) seqs\)", log)
            n_stream = 1 if _unified(c) else c["n_seq_max"]
            assert seqs and all(x == (str(c["n_seq_max"]), str(n_stream)) for x in seqs), log
        t = TYPE_NAMES[c["type_k"]]
        assert re.search(rf"(llama_kv_cache: size = .*K \({t}\)|llama_memory_recurrent: size = .*R \({t}\))", log), log
        return ctx

    def replay(self, ctx, script):
        L = self.L
        mem = L.llama_get_memory(ctx)
        for op in script:
            if op["op"] == "decode":
                self.decode(ctx, op["tokens"])
            elif op["op"] == "seq_cp":
                L.llama_memory_seq_cp(mem, *op["args"])
            elif op["op"] == "seq_rm":
                L.llama_memory_seq_rm(mem, *op["args"])
            elif op["op"] == "decode_embd":
                self.decode_embd(ctx, _embd_items(op, L.llama_model_n_embd(self.model)))
            else:
                raise AssertionError(f"unknown op {op}")


def _embd_items(op: dict, n_embd: int) -> list:
    """The items of a decode_embd op, {"seed", "items": [(positions per plane, [seq ids])]}:
    each with a vector of n_embd random floats drawn from the seed."""
    rng = np.random.default_rng(op["seed"])
    return [((rng.standard_normal(n_embd) * 0.1).astype(np.float32), pos, seqs) for pos, seqs in op["items"]]


def _unified(c: dict) -> bool:
    """Whether the manifest's context has one stream for all sequences (manifests of contexts
    from before kv_unified existed do not name it)."""
    return c.get("kv_unified", True)


def _manifest(name):
    root = interop_v10_dir() if SCENARIOS[name] == "v10" else interop_dir()
    return manifest(root / name / "seq0.bin"), root / name


def _cache(m, swa_full=False):
    """kvcache's cache of the scenario's context as 0.3.36 builds it (cell padding 1; an iSWA
    pair of semantics "2026", its SWA cache sized by today's rule; the test checks both sizes
    against the ones llama.cpp logs)."""
    if m["memory_kind"] == "hybrid":
        # a hybrid model's memory as kvcache.from_gguf builds it from the model file
        c = m["context"]
        return kvcache.from_gguf(m["model"]["path"], c["n_ctx"], n_seq_max=c["n_seq_max"], type_k=c["type_k"],
                                 type_v=c["type_v"], flash_attn=c["flash_attn"], n_batch=c["n_ubatch"],
                                 semantics="2026", kv_unified=_unified(c), n_rs_seq=c.get("n_rs_seq", 0),
                                 swa_full=swa_full)
    ctx, geo = m["context"], m["geometry"]
    if m["memory_kind"] == "recurrent":
        (g,) = geo
        ls = g["layers"]
        return kvcache.RecurrentCache(ctx["n_seq_max"], len(ls), [x["n_embd_r"] for x in ls],
                                      [x["n_embd_s"] for x in ls], type_k=ls[0]["r_type"], type_v=ls[0]["s_type"],
                                      kv_size=g["mem_size"])
    v_trans = not ctx["flash_attn"]
    if m["memory_kind"] == "iswa":
        base, swa = geo
        layers = sorted(base["layers"] + swa["layers"], key=lambda x: x["il"])
        c = kvcache.ISWACache(base["kv_size"], len(layers), [x["n_embd_k_gqa"] for x in layers],
                              [x["n_embd_v_gqa"] for x in layers], swa_layers=[x["il"] for x in swa["layers"]],
                              n_swa=swa["n_swa"], swa_type=swa["swa_type"], n_batch=ctx["n_ubatch"],
                              swa_full=swa_full, type_k=layers[0]["type_k"], type_v=layers[0]["type_v"],
                              v_trans=v_trans, n_seq_max=ctx["n_seq_max"], n_pad=1, semantics="2026",
                              kv_unified=_unified(ctx))
        # today's rule, written out: PAD_256(min(kv_size, n_swa * n_seq_max + n_ubatch)), or kv_size
        assert c.swa.size == (base["kv_size"] if swa_full is not False else
                              -(-min(base["kv_size"], swa["n_swa"] * ctx["n_seq_max"] + ctx["n_ubatch"]) // 256) * 256)
        return c
    (g,) = geo
    ls = g["layers"]
    # several streams (a cell table of kv_size cells per sequence) and the per-cell extension
    # exist in semantics "2026" only
    today: dict = {}
    if not _unified(ctx):
        today.update(semantics="2026", kv_unified=False)
    if g.get("cell_ext"):
        today.update(semantics="2026", cell_ext=True)
    return kvcache.UnifiedCache(g["kv_size"], len(ls), [x["n_embd_k_gqa"] for x in ls],
                                [x["n_embd_v_gqa"] for x in ls], type_k=ls[0]["type_k"], type_v=ls[0]["type_v"],
                                v_trans=v_trans, n_seq_max=ctx["n_seq_max"], n_pad=1, **today)


def _hands_off(cache) -> bool:
    """Whether the cache has seq_export / seq_import_begin: unified caches, iSWA pairs and hybrid
    memories (a recurrent cache has none)."""
    return isinstance(cache, (kvcache.UnifiedCache, kvcache.ISWACache, kvcache.HybridCache))


def _assert_hand_off_keeps(c, moved, s, blob, what):
    """Sequence s of c handed to the empty cache moved through the regions: moved writes
    llama.cpp's bytes of it (blob)."""
    exp = c.seq_export(s)
    with moved.seq_import_begin(exp.header) as imp:
        assert copy_regions(exp.regions, imp.regions) == exp.n_bytes
        imp.commit()
    assert moved.state_write(s) == blob, (what, s, "hand-off")


def _tokens(script):
    """All tokens in decode order (a session file's list) and seq 0's (a sequence file's)."""
    every = [t for op in script if op["op"] == "decode" for t, _, _ in op["tokens"]]
    seq0 = [t for op in script if op["op"] == "decode" for t, _, seqs in op["tokens"] if 0 in seqs]
    return every, seq0


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_live_files_cross_both_ways(name, tmp_path):
    m, folder = _manifest(name)
    live = Live(m["model"]["file"])
    with open(folder / "ref_next_logits_seq0.json") as f:
        nxt = json.load(f)
    ctx = live.context(m)
    if m["memory_kind"] == "iswa":
        log = "\n".join(Live.lines)
        sizes = [int(x) for x in re.findall(r"llama_kv_cache_iswa: creating +(?:non-)?SWA KV cache, size = (\d+) cells",
                                             log)]
        c = _cache(m)
        assert sizes == [c.size_base, c.size_swa], log
        # and kvcache plan's account of the pair is what llama.cpp logs, line for line
        base, swa = m["geometry"]
        layers = sorted(base["layers"] + swa["layers"], key=lambda x: x["il"])
        cx = m["context"]
        plan = kvcache.plan.plan_iswa(cx["n_ctx"], len(layers), [x["n_embd_k_gqa"] for x in layers],
                                      [x["n_embd_v_gqa"] for x in layers], swa_layers=c.swa_layers, n_swa=c.n_swa,
                                      swa_type=c.swa_type, n_batch=cx["n_ubatch"], swa_full=False,
                                      n_seq_max=cx["n_seq_max"], type_k=TYPE_NAMES[cx["type_k"]],
                                      type_v=TYPE_NAMES[cx["type_v"]], flash_attn=cx["flash_attn"],
                                      semantics="2026", kv_unified=_unified(cx))
        logged = [line.rstrip("\n") for line in Live.lines]
        assert [line for line in plan.llama_log if line in logged] == list(plan.llama_log), (plan.llama_log, log)
    _cross_both_ways(live, ctx, m, nxt, tmp_path, name)


def _cross_both_ways(live, ctx, m, nxt, tmp_path, name):
    """The two directions of test_live_files_cross_both_ways on a fresh context ctx of the
    manifest m (which this frees): llama.cpp replays m's script, then writes every kind of file,
    and decodes the next step of seq 0: the token nxt names ({"token", "pos"}), or nxt's
    embeddings (a decode_embd op of seq 0)."""
    L = live.L
    every, seq0 = _tokens(m["script"])

    def step(b, seq=0, pos=None):
        if nxt.get("op") == "decode_embd":
            return live.decode_embd(b, _embd_items(nxt, L.llama_model_n_embd(live.model)))
        return live.decode(b, [(nxt["token"], nxt["pos"] if pos is None else pos, [seq])])

    try:
        live.replay(ctx, m["script"])
        # 1. what llama.cpp writes, kvcache reads and writes back byte for byte
        blobs = {s: live.seq_get(ctx, s) for s in range(4)}
        whole = live.state_get(ctx)
        sess_path, seq_path = tmp_path / "live.ggsn", tmp_path / "live.ggsq"
        toks = (ctypes.c_int32 * len(every))(*every)
        assert L.llama_state_save_file(ctx, str(sess_path).encode(), toks, len(every))
        toks0 = (ctypes.c_int32 * len(seq0))(*seq0)
        assert L.llama_state_seq_save_file(ctx, str(seq_path).encode(), 0, toks0, len(seq0)) > 0
        ref = step(ctx)   # the uninterrupted run
    finally:
        L.llama_free(ctx)
    for s, blob in blobs.items():
        c = _cache(m)
        assert c.state_read(blob, s, exact=True) == len(blob)
        assert c.state_write(s) == blob, (name, s)
        if _hands_off(c):
            _assert_hand_off_keeps(c, _cache(m), s, blob, name)
    cache = _cache(m)
    cs = statefile.parse_context_state(whole)
    assert cs.layout in kvcache.LAYOUTS and not cs.has_outputs
    cs.restore(cache)
    out = io.BytesIO()
    statefile.write_context_state(out, cache, cs.arch)
    assert out.getvalue() == whole
    sess = statefile.load(sess_path)
    assert (sess.version, sess.tokens.tolist()) == (10, every)
    c2 = _cache(m)
    sess.restore(c2)
    statefile.write_session_file(tmp_path / "back.ggsn", c2, sess.context.arch, sess.tokens)
    assert (tmp_path / "back.ggsn").read_bytes() == sess_path.read_bytes()
    sq = statefile.load(seq_path)
    assert (sq.version, sq.tokens.tolist()) == (3, seq0)
    c3 = _cache(m)
    sq.restore(c3, 0)
    statefile.write_sequence_file(tmp_path / "back.ggsq", c3, 0, sq.tokens)
    assert (tmp_path / "back.ggsq").read_bytes() == seq_path.read_bytes()

    # 2. what kvcache writes in "2026", llama.cpp loads, and decoding goes on as if uninterrupted
    statefile.write_session_file(tmp_path / "ours.ggsn", cache, cs.arch, every)
    statefile.write_sequence_file(tmp_path / "ours.ggsq", cache, 0, seq0)
    ours = {"sequence blob": cache.state_write(0), "whole context": out.getvalue(),
            "session file": tmp_path / "ours.ggsn", "sequence file": tmp_path / "ours.ggsq"}
    theirs = {"sequence blob": blobs[0], "whole context": whole, "session file": sess_path,
              "sequence file": seq_path}

    def load_and_decode(kind, src, seq=0, pos=None):
        b = live.context(m)
        try:
            got = (ctypes.c_int32 * 512)()
            n = ctypes.c_size_t()
            if kind == "sequence blob":
                assert live.seq_set(b, src, seq) == len(src)
            elif kind == "whole context":
                assert live.state_set(b, src) == len(src)
            elif kind == "session file":
                assert L.llama_state_load_file(b, str(src).encode(), got, 512, ctypes.byref(n))
                assert list(got[:n.value]) == every
            else:
                assert L.llama_state_seq_load_file(b, str(src).encode(), 0, got, 512, ctypes.byref(n)) > 0
                assert list(got[:n.value]) == seq0
            return step(b, seq, pos)
        finally:
            L.llama_free(b)

    for kind in ours:
        logits = load_and_decode(kind, ours[kind])
        # a restore compacts the cells (a sequence's lie alone), which changes the order of
        # llama.cpp's sums: exactly llama.cpp's own state restored the same way, and close to
        # the uninterrupted run
        np.testing.assert_array_equal(logits, load_and_decode(kind, theirs[kind]), err_msg=f"{name}: {kind}")
        np.testing.assert_allclose(logits, ref, rtol=0, atol=1e-4, err_msg=f"{name}: {kind}")
    if not _unified(m["context"]):
        # each sequence's blob into its own stream: the next token after its last position
        held = [seq for seq in range(1, m["context"]["n_seq_max"]) if cache.seq_pos_max(seq) >= 0]
        assert held, "the script leaves sequences besides 0 in the cache"
        for seq in held:
            hi = cache.seq_pos_max(seq)
            logits = load_and_decode("sequence blob", cache.state_write(seq), seq, hi + 1)
            np.testing.assert_array_equal(logits, load_and_decode("sequence blob", blobs[seq], seq, hi + 1),
                                          err_msg=f"{name}: sequence blob of seq {seq}")
    return cache


def test_live_iswa_with_todays_full_size_swa_cache(tmp_path):
    """swa_full (today's default, and ISWACache's for semantics "2026"): a SWA cache of kv_size
    cells; llama.cpp's states of the gemma2 context restore into the default 2026 pair and are
    written back byte for byte."""
    m, folder = _manifest("gemma2_fa0")
    live = Live(m["model"]["file"])
    L = live.L
    ctx = live.context(m, swa_full=True)
    try:
        log = "\n".join(Live.lines)
        assert "llama_kv_cache_iswa: using full-size SWA cache" in log
        sizes = [int(x) for x in re.findall(r"llama_kv_cache_iswa: creating +(?:non-)?SWA KV cache, size = (\d+) cells",
                                             log)]
        c = _cache(m, swa_full=True)
        default = _cache(m, swa_full=None)
        assert sizes == [c.size_base, c.size_swa] == [default.size_base, default.size_swa], log
        live.replay(ctx, m["script"])
        blobs = {s: live.seq_get(ctx, s) for s in range(4)}
        whole = live.state_get(ctx)
    finally:
        L.llama_free(ctx)
    for s, blob in blobs.items():
        c = _cache(m, swa_full=True)
        assert c.state_read(blob, s, exact=True) == len(blob)
        assert c.state_write(s) == blob, s
        _assert_hand_off_keeps(c, _cache(m, swa_full=True), s, blob, "swa_full")
    cache = _cache(m, swa_full=True)
    cs = statefile.parse_context_state(whole)
    cs.restore(cache)
    out = io.BytesIO()
    statefile.write_context_state(out, cache, cs.arch)
    assert out.getvalue() == whole


# --- an M-RoPE model: cells with the per-cell extension ----------------------------------------

# The tiny qwen2vl text model the tests below write with the gguf package: 2 layers, n_embd 64,
# 4 query heads and 2 KV heads of 16 dimensions (all rotated), M-RoPE sections 2, 3, 3, 0 (pairs of
# dimensions per position plane; 8 = n_rot / 2), random weights, the vocabulary of tiny_llama.gguf.
MROPE = {"n_layer": 2, "n_embd": 64, "n_head": 4, "n_head_kv": 2, "n_ff": 128, "sections": [2, 3, 3, 0]}
LLAMA_ROPE_TYPE_MROPE = 8
# the context the tests make for it, in the manifests' terms (Live.context checks it in the log):
# 256 cells of f16 K and V (flash attention off: V transposed), cells with the extension
_N_KV = MROPE["n_embd"] // MROPE["n_head"] * MROPE["n_head_kv"]
MROPE_CTX = {"context": {"n_ctx": 256, "n_batch": 64, "n_ubatch": 64, "n_seq_max": 4, "type_k": 1, "type_v": 1,
                         "flash_attn": False, "kv_unified": True},
             "memory_kind": "unified",
             "geometry": [{"kv_size": 256, "cell_ext": True,
                           "layers": [{"il": il, "n_embd_k_gqa": _N_KV, "n_embd_v_gqa": _N_KV, "type_k": 1, "type_v": 1}
                                      for il in range(MROPE["n_layer"])]}]}
# seq 0: text, then an "image" of 2 x 3 embeddings as a multimodal chunk of a qwen2vl model has
# it (planes: the image's position t for all, y = t + row, x = t + column); seq 1 shares seq 0's
# first 6 cells, seq 2 is cut short, and seq 3's text positions jump forward (3..6 never decoded;
# M-RoPE allows it)
MROPE_IMAGE = [([8, 8 + row, 8 + col, 0], [0]) for row in range(2) for col in range(3)]
MROPE_SCRIPT = [
    {"op": "decode", "tokens": [(10 + 23 * i, i, [0]) for i in range(8)]},
    {"op": "decode_embd", "seed": 1, "items": MROPE_IMAGE},
    {"op": "seq_cp", "args": [0, 1, 0, 6]},
    {"op": "decode", "tokens": [(201, 6, [1]), (202, 7, [1]), (203, 8, [1])]},
    {"op": "decode", "tokens": [(31, 0, [2]), (32, 1, [2]), (33, 2, [2]), (34, 3, [2]),
                                (41, 0, [3]), (42, 1, [3]), (43, 2, [3])]},
    {"op": "seq_rm", "args": [2, 2, -1]},
    {"op": "decode", "tokens": [(47, 7, [3]), (48, 8, [3])]},
]
# the next step of seq 0: one more embedding of the image (row 0, column 1), which attends to the
# cells of the image's position whose (y, x) is not past its own (llama.cpp's M-RoPE causal mask,
# which reads y and x from the cells' extension)
MROPE_NEXT = {"op": "decode_embd", "seed": 2, "items": [([8, 8, 9, 0], [0])]}
LLAMA_TOKEN_NULL = -1
SEQ_STATE_MAGIC = 0xAF143CD8


def copy_tokenizer(w, vocab_from) -> int:
    """Give the GGUF writer w the tokenizer keys of the GGUF file vocab_from; the vocabulary's
    size."""
    gguf = need_module("test", "gguf")
    src = gguf.GGUFReader(str(vocab_from))
    n_vocab = 0
    V = gguf.GGUFValueType
    for key, f in src.fields.items():
        if not key.startswith("tokenizer."):
            continue
        kind = f.types[0]
        if kind == V.ARRAY:
            sub = f.types[1]
            if sub == V.STRING:
                vals = [bytes(f.parts[i]).decode("utf-8") for i in f.data]
            else:
                vals = [f.parts[i][0].item() for i in f.data]
            if key == "tokenizer.ggml.tokens":
                n_vocab = len(vals)
            w.add_key_value(key, vals, kind, sub_type=sub)
        elif kind == V.STRING:
            w.add_key_value(key, bytes(f.parts[f.data[0]]).decode("utf-8"), kind)
        else:
            w.add_key_value(key, f.parts[f.data[0]][0].item(), kind)
    assert n_vocab, f"{vocab_from} has no tokenizer.ggml.tokens"
    return n_vocab


def write_mrope_model(path, vocab_from, seed=0):
    """Write the tiny qwen2vl model MROPE describes to path, with the tokenizer keys of the GGUF
    file vocab_from. The keys are the ones llama.cpp's qwen2vl loader reads (the hyperparameters
    every model has, plus rope.dimension_sections, which it requires); qwen2vl's rope type is
    M-RoPE whatever the file says."""
    gguf = need_module("test", "gguf")
    g = MROPE
    arch, n_embd, head = "qwen2vl", g["n_embd"], g["n_embd"] // g["n_head"]
    n_kv = head * g["n_head_kv"]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_uint32(f"{arch}.context_length", 512)
    w.add_uint32(f"{arch}.embedding_length", n_embd)
    w.add_uint32(f"{arch}.block_count", g["n_layer"])
    w.add_uint32(f"{arch}.feed_forward_length", g["n_ff"])
    w.add_uint32(f"{arch}.attention.head_count", g["n_head"])
    w.add_uint32(f"{arch}.attention.head_count_kv", g["n_head_kv"])
    w.add_uint32(f"{arch}.rope.dimension_count", head)
    w.add_float32(f"{arch}.rope.freq_base", 10000.0)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)
    w.add_array(f"{arch}.rope.dimension_sections", list(g["sections"]))
    n_vocab = copy_tokenizer(w, vocab_from)
    rand = random_weights(seed)
    ones = np.ones(n_embd, np.float32)
    w.add_tensor("token_embd.weight", rand(n_vocab, n_embd))
    w.add_tensor("output_norm.weight", ones)
    w.add_tensor("output.weight", rand(n_vocab, n_embd))
    for il in range(g["n_layer"]):
        b = f"blk.{il}."
        w.add_tensor(b + "attn_norm.weight", ones)
        w.add_tensor(b + "attn_q.weight", rand(n_embd, n_embd))
        w.add_tensor(b + "attn_k.weight", rand(n_kv, n_embd))
        w.add_tensor(b + "attn_v.weight", rand(n_kv, n_embd))
        w.add_tensor(b + "attn_q.bias", rand(n_embd))
        w.add_tensor(b + "attn_k.bias", rand(n_kv))
        w.add_tensor(b + "attn_v.bias", rand(n_kv))
        w.add_tensor(b + "attn_output.weight", rand(n_embd, n_embd))
        add_ffn(w, b, rand, n_embd, g["n_ff"])
    close_gguf(w)
    return path


def add_ffn(w, prefix: str, rand, n_embd: int, n_ff: int) -> None:
    """A layer's SwiGLU feed-forward tensors (llama.cpp's ffn_norm, ffn_gate, ffn_up, ffn_down),
    the weights drawn by rand(rows, row length) in that order."""
    w.add_tensor(prefix + "ffn_norm.weight", np.ones(n_embd, np.float32))
    w.add_tensor(prefix + "ffn_gate.weight", rand(n_ff, n_embd))
    w.add_tensor(prefix + "ffn_up.weight", rand(n_ff, n_embd))
    w.add_tensor(prefix + "ffn_down.weight", rand(n_embd, n_ff))


def random_weights(seed):
    """rand(*shape): f32 weights of N(0, 0.01) drawn in turn from a generator of seed (numpy's
    shape is GGUF's reversed: (rows, row length))."""
    rng = np.random.default_rng(seed)
    return lambda *shape: (rng.standard_normal(shape) * 0.1).astype(np.float32)


def close_gguf(w) -> None:
    """Write the GGUF writer's header, metadata and tensors, and close the file."""
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def mrope_model(tmp_path_factory):
    _llama()     # skips (or fails) first when llama.cpp 0.3.36 is not here
    return write_mrope_model(tmp_path_factory.mktemp("mrope") / "tiny_qwen2vl.gguf", model_path("tiny_llama.gguf"))


def _mrope_live(path):
    """Live of the M-RoPE model, checked to be one: llama.cpp gives it rope type M-RoPE."""
    live = Live(path)
    assert live.L.llama_model_rope_type(live.model) == LLAMA_ROPE_TYPE_MROPE
    return live


def _held(script):
    """The cells each sequence holds after the script, as llama.cpp fills their extension:
    {seq: sorted [(pos, x, y, tok)]}. A text token has one position, which llama_batch_allocr
    gives every M-RoPE plane, and apply_ubatch takes y from plane 1, x from plane 2 and tok from
    the token: (pos, pos, pos, token). An embedding (no token ids, not a per-layer-embedding
    model) keeps tok = LLAMA_TOKEN_NULL. A copied cell is the same cell."""
    held: dict = {s: [] for s in range(4)}
    for op in script:
        if op["op"] == "decode":
            for t, p, seqs in op["tokens"]:
                for s in seqs:
                    held[s].append((p, p, p, t))
        elif op["op"] == "decode_embd":
            for (p, y, x, _), seqs in op["items"]:
                for s in seqs:
                    held[s].append((p, x, y, LLAMA_TOKEN_NULL))
        elif op["op"] == "seq_cp":
            src, dst, p0, p1 = op["args"]
            held[dst] += [c for c in held[src] if p0 <= c[0] and (p1 < 0 or c[0] < p1)]
        elif op["op"] == "seq_rm":
            s, p0, p1 = op["args"]
            held[s] = [c for c in held[s] if not (p0 <= c[0] and (p1 < 0 or c[0] < p1))]
    return {s: sorted(cells) for s, cells in held.items()}


def _ext_section(data, off, n_layer, n_embd_kv):
    """Parse one stream's section of a memory state whose cell records carry the 12-byte extension
    (llama_kv_cache::state_write_meta / state_write_data): u32 cell count; per cell i32 pos, u32
    n_seq_id, i32 x, i32 y, i32 tok, n_seq_id x i32 seq id; then u32 v_trans, u32 n_layer and per
    layer the K rows (i32 type, u64 row size, the rows), then V (transposed: i32 type, u32 element
    size, u32 n_embd_v_gqa, the elements). Returns the cells [(pos, [seq ids], x, y, tok, offset of
    the record)] and the offset after the section; checks the K/V sizes (f16) against the cell
    count."""
    (n,) = np.frombuffer(data, "<u4", 1, off)
    off += 4
    cells = []
    for _ in range(int(n)):
        pos, n_seq, x, y, tok = (int(v) for v in np.frombuffer(data, "<i4", 5, off))
        cells.append((pos, [int(v) for v in np.frombuffer(data, "<i4", n_seq, off + 20)], x, y, tok, off))
        off += 20 + 4 * n_seq
    if n == 0:
        return cells, off
    v_trans, layers = (int(v) for v in np.frombuffer(data, "<u4", 2, off))
    off += 8
    assert layers == n_layer
    for _ in range(n_layer):        # K
        k_type, row = int(np.frombuffer(data, "<i4", 1, off)[0]), int(np.frombuffer(data, "<u8", 1, off + 4)[0])
        assert (k_type, row) == (1, 2 * n_embd_kv)
        off += 12 + row * len(cells)
    for _ in range(n_layer):        # V
        if v_trans:
            v_type, el, dim = (int(v) for v in np.frombuffer(data, "<u4", 3, off))
            assert (v_type, el, dim) == (1, 2, n_embd_kv)
            off += 12 + el * dim * len(cells)
        else:
            v_type, row = int(np.frombuffer(data, "<i4", 1, off)[0]), int(np.frombuffer(data, "<u8", 1, off + 4)[0])
            assert (v_type, row) == (1, 2 * n_embd_kv)
            off += 12 + row * len(cells)
    return cells, off


def test_live_mrope_cells_carry_position_and_token(mrope_model, tmp_path):
    """llama.cpp 0.3.36 loads the M-RoPE model written here, decodes text and an image's
    embeddings, and writes each cell record with 12 more bytes after n_seq_id: x, y, tok
    (llama_kv_cell_ext, three i32). For a text token x = y = its position and tok = its token id;
    for an embedding x and y are its planes 2 and 1 and tok is LLAMA_TOKEN_NULL (_held). The
    files wrap the same bytes; llama.cpp reads its own sequence state back into a fresh context
    and writes the same bytes; and the extension matters to the next step: the same state with
    the image's x and y zeroed decodes the next embedding of the image differently."""
    live = _mrope_live(mrope_model)
    L = live.L
    held = _held(MROPE_SCRIPT)
    n_layer, n_embd_kv = MROPE["n_layer"], MROPE["n_embd"] // MROPE["n_head"] * MROPE["n_head_kv"]
    nxt = _embd_items(MROPE_NEXT, L.llama_model_n_embd(live.model))
    every, seq0 = _tokens(MROPE_SCRIPT)
    ctx = live.context(MROPE_CTX)
    try:
        live.replay(ctx, MROPE_SCRIPT)
        blobs = {s: live.seq_get(ctx, s) for s in range(4)}
        whole = live.state_get(ctx)
        sess_path, seq_path = tmp_path / "m.ggsn", tmp_path / "m.ggsq"
        assert L.llama_state_save_file(ctx, str(sess_path).encode(), (ctypes.c_int32 * len(every))(*every), len(every))
        assert L.llama_state_seq_save_file(ctx, str(seq_path).encode(), 0, (ctypes.c_int32 * len(seq0))(*seq0),
                                           len(seq0)) > 0
    finally:
        L.llama_free(ctx)

    # sequence blobs: u32 magic, i32 seq id, u32 n_stream (1), the section of the sequence's cells
    offsets = {}         # blob offset of each cell record of seq 0
    for s, blob in blobs.items():
        magic, sid, n_stream = np.frombuffer(blob, "<u4", 3, 0)
        assert (int(magic), int(sid), int(n_stream)) == (SEQ_STATE_MAGIC, s, 1)
        cells, end = _ext_section(blob, 12, n_layer, n_embd_kv)
        assert end == len(blob), s
        assert all(seqs == [s] for _, seqs, _, _, _, _ in cells)
        # cell order is not position order (seq 3's 7 and 8 took the cells seq 2 freed)
        assert sorted((pos, x, y, tok) for pos, _, x, y, tok, _ in cells) == held[s], s
        if s == 0:
            offsets = {(pos, x, y): at for pos, _, x, y, _, at in cells}

    # the whole context: u32 length + architecture name, u32 n_stream, every cell with all its ids
    (n_arch,) = np.frombuffer(whole, "<u4", 1, 0)
    assert whole[4:4 + n_arch] == b"qwen2vl"
    off = 4 + int(n_arch)
    assert int(np.frombuffer(whole, "<u4", 1, off)[0]) == 1
    cells, end = _ext_section(whole, off + 4, n_layer, n_embd_kv)
    assert end == len(whole)
    assert {s: sorted((pos, x, y, tok) for pos, seqs, x, y, tok, _ in cells if s in seqs) for s in range(4)} == held
    assert any(len(c[1]) == 2 for c in cells)      # seq 0 and 1 share cells

    # the files wrap the same memory state: a session file (magic, version 10, token count,
    # tokens) around the whole context, a sequence file (magic, version 3, token count, tokens)
    # around seq 0's state without the sequence-blob prefix
    assert sess_path.read_bytes()[12 + 4 * len(every):] == whole
    assert seq_path.read_bytes()[12 + 4 * len(seq0):] == blobs[0][8:]

    # llama.cpp's own restore keeps the extension (a sequence's cells land in a fresh context in
    # the same order)
    def restore(blob, s):
        b = live.context(MROPE_CTX)
        assert live.seq_set(b, blob, s) == len(blob)
        return b

    for s, blob in blobs.items():
        b = restore(blob, s)
        try:
            assert live.seq_get(b, s) == blob, s
        finally:
            L.llama_free(b)

    # seq 0's blob with the image's x, y zeroed: the next embedding sees all of the image
    flat = bytearray(blobs[0])
    for (pos, x, y), at in offsets.items():
        if (x, y) != (pos, pos):
            flat[at + 8:at + 16] = bytes(8)
    steps = []
    for blob in (blobs[0], bytes(flat)):
        b = restore(blob, 0)
        try:
            steps.append(live.decode_embd(b, nxt))
        finally:
            L.llama_free(b)
    assert np.abs(steps[0] - steps[1]).max() > 1e-3


@pytest.mark.parametrize("flash_attn", [False, True])
def test_live_mrope_files_cross_both_ways(mrope_model, flash_attn, tmp_path):
    """test_live_files_cross_both_ways for the M-RoPE model: every kind of file llama.cpp writes
    restores into a UnifiedCache(semantics="2026", cell_ext=True) (kvcache.from_gguf does not
    know qwen2vl: the cache of the context llama.cpp logs, made here) and is written back byte
    for byte; every kind kvcache writes loads into llama.cpp and the image's next embedding
    decodes as after llama.cpp's own state (its M-RoPE mask reads the restored x, y). The cache
    restored from the whole context holds llama.cpp's extensions (Cells.ext). With flash
    attention off (V transposed) and on."""
    live = _mrope_live(mrope_model)
    m = dict(MROPE_CTX, context=dict(MROPE_CTX["context"], flash_attn=flash_attn), script=MROPE_SCRIPT)
    ctx = live.context(m)
    assert re.search(r"llama_kv_cache: size = .*\(\s*256 cells,\s+2 layers", "\n".join(Live.lines)), Live.lines
    cache = _cross_both_ways(live, ctx, m, MROPE_NEXT, tmp_path, "mrope")
    assert cache.cell_ext and cache.v_trans == (not flash_attn)
    cells = cache.cells()
    got = {s: sorted((int(cells.pos[i]), *(int(v) for v in cells.ext[i])) for i in range(len(cells))
                     if s in cells.seq_ids(i)) for s in range(4)}
    assert got == _held(MROPE_SCRIPT)


@pytest.mark.parametrize("name", ["llama_fa0", "llama_fa1", "llama_q8_fa1", "mamba"])
def test_live_convert_of_an_old_sequence_state_loads_and_decodes(name, tmp_path):
    """0.3.10's sequence blob and sequence file of seq 0 (../interop), rewritten by `kvcache
    convert --to 2026` without --seq-id (the prefix names seq 0, the default), load into a fresh
    0.3.36 context (llama_state_seq_set_data, llama_state_seq_load_file), into seq 0 and into
    seq 2 (llama.cpp does not use the prefix's id), and decoding the next token gives the logits
    of llama.cpp's own 0.3.36 state loaded the same way (mamba's: within 1e-5, its state values
    changed between the versions) and of the uninterrupted run within 1e-4."""
    from kvcache import cli

    m, folder = _manifest(name)
    live = Live(m["model"]["file"])
    L = live.L
    with open(folder / "ref_next_logits_seq0.json") as f:
        nxt = json.load(f)
    ref = np.load(folder / "ref_next_logits_seq0.npy")
    converted = {}
    for kind, file in (("sequence blob", "seq0.bin"), ("sequence file", "seq0.ggsq")):
        out = tmp_path / file
        assert cli.main(["convert", str(interop_dir() / name / file), str(out), "--to", "2026"]) == 0
        converted[kind] = out
    assert converted["sequence blob"].read_bytes()[4:8] == bytes(4)   # seq 0 in the prefix
    seq0 = statefile.load(folder / "seq0.ggsq").tokens.tolist()

    def load_and_decode(kind, path, seq):
        b = live.context(m)
        try:
            if kind == "sequence blob":
                data = path.read_bytes()
                assert live.seq_set(b, data, seq) == len(data)
            else:
                got, n = (ctypes.c_int32 * 512)(), ctypes.c_size_t()
                assert L.llama_state_seq_load_file(b, str(path).encode(), seq, got, 512, ctypes.byref(n)) > 0
                assert list(got[:n.value]) == seq0
            return live.decode(b, [(nxt["token"], nxt["pos"], [seq])])
        finally:
            L.llama_free(b)

    theirs = {"sequence blob": folder / "seq0.bin", "sequence file": folder / "seq0.ggsq"}
    for kind, path in converted.items():
        for seq in (0, 2):
            logits = load_and_decode(kind, path, seq)
            own = load_and_decode(kind, theirs[kind], seq)
            if name == "mamba":
                np.testing.assert_allclose(logits, own, rtol=0, atol=1e-5, err_msg=f"{name}: {kind}, seq {seq}")
            else:
                np.testing.assert_array_equal(logits, own, err_msg=f"{name}: {kind}, seq {seq}")
            np.testing.assert_allclose(logits, ref, rtol=0, atol=1e-4, err_msg=f"{name}: {kind}, seq {seq}")
