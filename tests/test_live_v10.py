"""Live state interop with today's llama.cpp (llama-cpp-python 0.3.36, layout "2026").

Skipped unless llama_cpp 0.3.36 is importable: .ci/run's llama36 stage builds it from source
into a directory of its own and runs this file in a process of its own (one process loads one
llama.cpp). For every scenario (f16 with flash attention off and on, q8_0, bf16, gemma2 iSWA,
mamba) llama.cpp decodes the manifest's script, then:

1. every kind of file it writes (sequence blobs, whole-context state, session file, sequence
   file) restores into kvcache and is written back byte for byte in layout "2026";
2. every kind kvcache writes in "2026" loads into a fresh llama.cpp context, and decoding the
   next token there gives the logits of the uninterrupted run (within 1e-4: a restore compacts
   the cells, which changes the order of llama.cpp's sums) and exactly those of llama.cpp's own
   state of the same kind loaded the same way. With several streams every sequence's blob loads
   into its own stream of a fresh context and decodes as llama.cpp's own blob of that sequence.

Each restored sequence is also handed to a fresh cache through seq_export / seq_import_begin,
which must then write llama.cpp's blob of that sequence.

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

from live_llama import LlamaCalls
from interop_data import interop_dir, interop_v10_dir, manifest, model_path

# scenario -> (where its manifest is, the reference logits' folder)
SCENARIOS = {
    "llama_fa0": "v10", "llama_fa1": "v10", "llama_q8_fa1": "v10", "mamba": "v10",
    "llama_bf16_fa1": "v9", "gemma2_fa0": "v9", "llama_fa0_streams": "v10",
}
TYPE_NAMES = {0: "f32", 1: "f16", 8: "q8_0", 30: "bf16"}


def _llama():
    # .ci/run's llama36 stage says it installed 0.3.36: then a skip would hide a broken install
    missing = pytest.fail if os.environ.get("KVCACHE_EXPECT_LLAMA036") else pytest.skip
    try:
        import llama_cpp as L
    except ImportError as e:
        missing(f"llama_cpp is not importable ({e}); .ci/run's llama36 stage installs 0.3.36")
    if getattr(L, "__version__", None) != "0.3.36":
        missing(f"llama-cpp-python {L.__version__} is importable; these tests are for 0.3.36")
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
        if model not in Live._models:
            p = L.llama_model_default_params()
            p.n_gpu_layers = 0
            Live._models[model] = L.llama_model_load_from_file(str(model_path(model)).encode(), p)
            assert Live._models[model], f"llama.cpp could not load {model}"
        self.model = Live._models[model]
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
                "kv_unified": _unified(c), "n_threads": 1, "n_threads_batch": 1}
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
            else:
                raise AssertionError(f"unknown op {op}")


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
    # several streams (a cell table of kv_size cells per sequence) exist in semantics "2026" only
    streams = {} if _unified(ctx) else {"semantics": "2026", "kv_unified": False}
    return kvcache.UnifiedCache(g["kv_size"], len(ls), [x["n_embd_k_gqa"] for x in ls],
                                [x["n_embd_v_gqa"] for x in ls], type_k=ls[0]["type_k"], type_v=ls[0]["type_v"],
                                v_trans=v_trans, n_seq_max=ctx["n_seq_max"], n_pad=1, **streams)


def _hands_off(cache) -> bool:
    """Whether the cache has seq_export / seq_import_begin: unified caches and iSWA pairs (a
    recurrent cache has none)."""
    return isinstance(cache, (kvcache.UnifiedCache, kvcache.ISWACache))


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
    L = live.L
    with open(folder / "ref_next_logits_seq0.json") as f:
        nxt = json.load(f)
    every, seq0 = _tokens(m["script"])
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
        ref = live.decode(ctx, [(nxt["token"], nxt["pos"], [0])])   # the uninterrupted run
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

    def load_and_decode(kind, src, seq=0, pos=nxt["pos"]):
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
            return live.decode(b, [(nxt["token"], pos, [seq])])
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
