"""State interop with llama.cpp.

1. Every blob llama.cpp wrote into tests/data/interop (through llama-cpp-python 0.3.10) restores
   into a kvcache cache of its manifest's geometry, holds the cells the manifest expects, and is
   written back byte for byte (bare blobs, whole-context states, session and sequence files).
2. Live, against llama.cpp itself (skipped when llama_cpp is not importable): states kvcache
   writes load into llama.cpp and decoding continues with the logits of the uninterrupted run,
   and states llama.cpp writes in the test read into kvcache.
"""
import ctypes
import hashlib
import io

import numpy as np
import pytest

import kvcache
from kvcache import statefile

from conftest import need
from live_llama import LlamaCalls
from interop_data import interop_dir, make_cache, manifest, model_path

FOLDERS = ["llama_fa0", "llama_fa1", "llama_q8_fa1", "llama_bf16_fa1", "mamba", "gemma2_fa0"]
FILES = ["seq0.bin", "seq1.bin", "seq2.bin", "seq3.bin", "state.bin", "seq0.ggsq", "session.ggsn"]


def _cells_unified(cache):
    """(cell index, pos, seq ids) of every non-empty cell."""
    return [(i, p, ids) for i, p, ids, _ in cache.cells().nonempty()]


def _cells_recurrent(cache):
    c = cache.cells()
    return [(i, int(c["pos"][i]), list(c["seq_id"][i])) for i in range(len(c["pos"])) if c["seq_id"][i]]


def _check_cells(cache, m, seq_id):
    """The restored cells are the manifest's: same positions and ids in the same order (a whole
    state puts cell k of the blob into cell k; a sequence goes where the slot search puts it)."""
    sections = m["expected"]["sections"]
    if isinstance(cache, kvcache.RecurrentCache):
        (section,) = sections
        got = _cells_recurrent(cache)
        want = [(c["pos"], c["seq_ids"] or [seq_id]) for c in section["cells"]]
        key = (lambda x: x) if section.get("cell_order", "exact") == "exact" else sorted
        assert key([(p, ids) for _, p, ids in got]) == key(want)
        return
    parts = [cache] if isinstance(cache, kvcache.UnifiedCache) else [cache.base, cache.swa]
    assert len(parts) == len(sections)
    for part, section in zip(parts, sections):
        got = _cells_unified(part)
        exp = section["cells"]
        if seq_id >= 0:
            assert [(p, ids) for _, p, ids in got] == [(c["pos"], [seq_id]) for c in exp]
        else:
            assert got == [(k, c["pos"], c["seq_ids"]) for k, c in enumerate(exp)]


@pytest.mark.parametrize("folder", FOLDERS)
@pytest.mark.parametrize("name", FILES)
def test_blob_restores_and_writes_back(folder, name):
    path = interop_dir() / folder / name
    m = manifest(path)
    data = path.read_bytes()
    assert hashlib.sha256(data).hexdigest() == m["sha256"]
    cache = make_cache(m)
    if cache is None:
        pytest.skip("kvcache has no ISWACache in this build")
    seq_id = m["seq_id"] if "seq_id" in m else -1
    wrapper = m["wrapper"]
    if wrapper == "seq_file":
        f = statefile.load(path)
        assert isinstance(f, statefile.SequenceFile)
        assert f.tokens.tolist() == m["expected"]["tokens"]
        assert f.restore(cache, seq_id) == len(f.cache)
        out = io.BytesIO()
        n = statefile.write_sequence_file(out, cache, seq_id, f.tokens, layout="2025")
        assert n == len(data) and out.getvalue() == data
    elif wrapper == "session_file":
        f = statefile.load(path)
        assert isinstance(f, statefile.SessionFile)
        assert f.tokens.tolist() == m["expected"]["tokens"]
        _check_context(f.context, m)
        f.restore(cache)
        ctx = f.context
        out = io.BytesIO()
        n = statefile.write_session_file(out, cache, ctx.arch, f.tokens, output_pos=ctx.output_pos,
                                         logits=ctx.logits, embeddings=ctx.embeddings, layout="2025")
        assert n == len(data) and out.getvalue() == data
    elif wrapper == "context":
        ctx = statefile.parse_context_state(data)
        _check_context(ctx, m)
        ctx.restore(cache)
        out = io.BytesIO()
        statefile.write_context_state(out, cache, ctx.arch, output_pos=ctx.output_pos, logits=ctx.logits,
                                      embeddings=ctx.embeddings, layout="2025")
        assert out.getvalue() == data
    else:
        assert cache.state_read(data, seq_id, exact=True) == len(data)
        assert cache.state_write(seq_id, layout="2025") == data
        buf = bytearray(cache.state_size(seq_id, layout="2025"))
        assert cache.state_write_into(buf, seq_id, layout="2025") == len(data) and buf == data
    _check_cells(cache, m, seq_id)


def _check_context(ctx, m):
    e = m["expected"]["context"]
    assert ctx.arch == e["arch"]
    assert ctx.n_outputs == e["n_outputs"] and ctx.output_pos.tolist() == e["output_pos"]
    assert len(ctx.logits) == e["logits_size"] and len(ctx.embeddings) == e["embd_size"]
    assert hashlib.sha256(ctx.logits.tobytes()).hexdigest() == e["logits_sha256"]
    np.testing.assert_array_equal(ctx.logits[:4], np.float32(e["logits_head"]))


@pytest.mark.parametrize("folder", FOLDERS)
def test_inspect_recognises_every_file(folder):
    from kvcache.inspect import report

    for name in FILES:
        path = interop_dir() / folder / name
        m = manifest(path)
        r = report(path)
        if r["cell_count"] == 0 and r["variant"] != m["memory_kind"]:
            # an empty bare blob holds nothing that tells the variants apart: say it
            assert r["variant_guessed"]
            r = report(path, m["memory_kind"])
            assert not r["variant_guessed"]
        kinds = {"none (raw memory state)": ("sequence blob", "whole-cache blob"), "context": ("whole-context state",),
                 "session_file": ("session file",), "seq_file": ("sequence file",)}[m["wrapper"]]
        assert r["kind"] in kinds, (name, r["kind"])
        if m["wrapper"] == "none (raw memory state)" and m["expected"]["sections"][0]["cell_count"]:
            assert r["kind"] == "sequence blob"
        assert r["variant"] == m["memory_kind"]
        assert [s["cell_count"] for s in r["sections"]] == [s["cell_count"] for s in m["expected"]["sections"]]
        for got, exp in zip(r["sections"], m["expected"]["sections"]):
            want = {}
            for c in exp["cells"]:
                for s in c["seq_ids"] or ["unnamed"]:
                    want.setdefault(str(s), set()).add(c["pos"])
            assert {k: {p for a, b in v for p in range(a, b + 1)} for k, v in got["sequences"].items()} == want
        if "tokens" in m["expected"]:
            assert r["tokens"]["values"] == m["expected"]["tokens"]


# --- live, against llama.cpp -------------------------------------------------------------------



def _llama():
    try:
        import llama_cpp as L
    except ImportError as e:
        need("llama", f"llama_cpp is not importable ({e}); .ci/run's llama stage installs llama-cpp-python==0.3.10")
    if getattr(L, "__version__", None) != "0.3.10":
        need("llama", f"llama-cpp-python {L.__version__} is installed; the blobs and their layout are 0.3.10's")
    return L


class Llama(LlamaCalls):
    """A llama.cpp model and contexts through llama_cpp's low-level API, quietly."""

    _models = {}
    _log_cb = None

    def __init__(self, model="tiny_llama.gguf"):
        self.L = L = _llama()
        if Llama._log_cb is None:
            Llama._log_cb = L.llama_log_callback(lambda level, text, user: None)
            L.llama_log_set(Llama._log_cb, ctypes.c_void_p())
            L.llama_backend_init()
        if model not in Llama._models:
            p = L.llama_model_default_params()
            Llama._models[model] = L.llama_model_load_from_file(str(model_path(model)).encode(), p)
            assert Llama._models[model], f"llama.cpp could not load {model}"
        self.model = Llama._models[model]
        self.n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model))

    def context(self, m):
        """A fresh context with the manifest's parameters (one thread: the same sums every run)."""
        L = self.L
        c = m["context"]
        p = L.llama_context_default_params()
        p.n_ctx, p.n_batch, p.n_ubatch, p.n_seq_max = c["n_ctx"], c["n_batch"], c["n_ubatch"], c["n_seq_max"]
        p.flash_attn = c["flash_attn"]
        p.type_k, p.type_v = c["type_k"], c["type_v"]
        p.swa_full = False
        p.n_threads = p.n_threads_batch = 1
        ctx = L.llama_init_from_model(self.model, p)
        assert ctx
        return ctx

    def free(self, ctx):
        self.L.llama_free(ctx)

    def replay(self, ctx, m):
        """Run the calls that produced the manifest's blobs."""
        L = self.L
        for op in m["script"]:
            if op["op"] == "decode":
                self.decode(ctx, op["tokens"])
            elif op["op"] == "seq_cp":
                L.llama_kv_self_seq_cp(ctx, *op["args"])
            elif op["op"] == "seq_rm":
                assert L.llama_kv_self_seq_rm(ctx, *op["args"]) == op.get("returned", True)
            else:
                raise AssertionError(f"unknown op {op}")


@pytest.fixture(scope="module")
def llama():
    return Llama()


def _llama_for(m):
    """The llama.cpp model of a manifest, and skip when kvcache lacks the manifest's cache."""
    if make_cache(m) is None:
        pytest.skip("kvcache has no ISWACache in this build")
    return Llama(m["model"]["file"])


LIVE = FOLDERS


def _ref(folder):
    import json

    d = interop_dir() / folder
    with open(d / "ref_next_logits_seq0.json") as f:
        r = json.load(f)
    return r, np.load(d / "ref_next_logits_seq0.npy")


@pytest.mark.parametrize("folder", FOLDERS)
def test_live_llama_writes_what_kvcache_reads(folder):
    """llama.cpp replays the manifest's calls in the test: its blobs are the stored ones, and kvcache
    restores each, holding the expected cells, and writes it back identically."""
    d = interop_dir() / folder
    m0 = manifest(d / "seq0.bin")
    llama = Llama(m0["model"]["file"])
    if make_cache(m0) is None:
        pytest.skip("kvcache has no ISWACache in this build")
    ctx = llama.context(m0)
    try:
        llama.replay(ctx, m0)
        for s in range(4):
            m = manifest(d / f"seq{s}.bin")
            live = llama.seq_get(ctx, s)
            assert hashlib.sha256(live).hexdigest() == m["sha256"], f"seq {s}: this llama.cpp writes other bytes"
            cache = make_cache(m)
            cache.state_read(live, s, exact=True)
            _check_cells(cache, m, s)
            assert cache.state_write(s, layout="2025") == live
        m = manifest(d / "state.bin")
        whole = llama.state_get(ctx)
        assert hashlib.sha256(whole).hexdigest() == m["sha256"]
        ctx_state = statefile.parse_context_state(whole)
        cache = make_cache(m)
        ctx_state.restore(cache)
        _check_cells(cache, m, -1)
        out = io.BytesIO()
        statefile.write_context_state(out, cache, ctx_state.arch, output_pos=ctx_state.output_pos,
                                      logits=ctx_state.logits, embeddings=ctx_state.embeddings, layout="2025")
        assert out.getvalue() == whole
    finally:
        llama.free(ctx)


@pytest.mark.parametrize("folder", LIVE)
def test_live_kvcache_sequence_continues_in_llama(folder):
    """kvcache restores llama.cpp's seq 0, writes it, llama.cpp loads it into a fresh context and the
    next-token logits are the uninterrupted run's (close: the cells moved to other indices, which
    changes the order of the sums) and exactly those of loading llama.cpp's own blob."""
    d = interop_dir() / folder
    m = manifest(d / "seq0.bin")
    llama = _llama_for(m)
    ref, ref_logits = _ref(folder)
    blob = (d / "seq0.bin").read_bytes()
    cache = make_cache(m)
    cache.state_read(blob, 0)
    ours = bytearray(cache.state_size(0, layout="2025"))
    cache.state_write_into(ours, 0, layout="2025")

    step = [(ref["token"], ref["pos"], [ref["seq_id"]])]
    results = []
    for data in (blob, bytes(ours)):
        ctx = llama.context(m)
        try:
            assert llama.seq_set(ctx, data, 0) == len(data)
            results.append(llama.decode(ctx, step))
        finally:
            llama.free(ctx)
    np.testing.assert_array_equal(results[1], results[0])
    # f16 V transposed across other cell indices: ~2e-5 observed; bitwise otherwise
    np.testing.assert_allclose(results[1], ref_logits, rtol=0, atol=1e-4)


@pytest.mark.parametrize("folder", [f for f in LIVE if f != "mamba"])  # a recurrent state cannot be cut
def test_live_suffix_removed_in_kvcache_matches_llama(folder):
    """kvcache removes a suffix of the sequence and writes it; llama.cpp does the same on its own
    copy: the blobs are identical, and decoding on after loading kvcache's gives bitwise the
    logits of llama.cpp's own continuation."""
    d = interop_dir() / folder
    m = manifest(d / "seq0.bin")
    llama = _llama_for(m)
    blob = (d / "seq0.bin").read_bytes()
    cache = make_cache(m)
    cache.state_read(blob, 0)
    assert cache.seq_rm(0, 30, -1)
    ours = cache.state_write(0, layout="2025")

    ctx = llama.context(m)
    try:
        assert llama.seq_set(ctx, blob, 0) == len(blob)
        assert llama.L.llama_kv_self_seq_rm(ctx, 0, 30, -1)
        theirs = llama.seq_get(ctx, 0)
        assert ours == theirs
        want = llama.decode(ctx, [(77, 30, [0]), (12, 31, [0])])
    finally:
        llama.free(ctx)
    ctx = llama.context(m)
    try:
        assert llama.seq_set(ctx, ours, 0) == len(ours)
        got = llama.decode(ctx, [(77, 30, [0]), (12, 31, [0])])
    finally:
        llama.free(ctx)
    np.testing.assert_array_equal(got, want)


def test_live_sequence_and_session_files_load_in_llama(llama, tmp_path):
    """Sequence and session files written by kvcache load with llama.cpp's own file loaders, with
    the tokens, and decoding on gives the logits of loading llama.cpp's files."""
    L = llama.L
    d = interop_dir() / "llama_fa0"
    m = manifest(d / "seq0.ggsq")
    ref, _ = _ref("llama_fa0")
    step = [(ref["token"], ref["pos"], [ref["seq_id"]])]

    seq = statefile.load(d / "seq0.ggsq")
    cache = make_cache(m)
    seq.restore(cache, 0)
    ours = tmp_path / "ours.ggsq"
    statefile.write_sequence_file(ours, cache, 0, seq.tokens, layout="2025")
    results = []
    for path in (d / "seq0.ggsq", ours):
        ctx = llama.context(m)
        try:
            toks = (ctypes.c_int32 * 256)()
            n = ctypes.c_size_t(0)
            assert L.llama_state_seq_load_file(ctx, str(path).encode(), 0, toks, 256, ctypes.byref(n)) > 0
            assert list(toks[:n.value]) == seq.tokens.tolist()
            results.append(llama.decode(ctx, step))
        finally:
            llama.free(ctx)
    np.testing.assert_array_equal(results[1], results[0])

    ms = manifest(d / "session.ggsn")
    sess = statefile.load(d / "session.ggsn")
    cache = make_cache(ms)
    sess.restore(cache)
    ours = tmp_path / "ours.ggsn"
    c = sess.context
    statefile.write_session_file(ours, cache, c.arch, sess.tokens, output_pos=c.output_pos, logits=c.logits,
                                 layout="2025")
    results = []
    for path in (d / "session.ggsn", ours):
        ctx = llama.context(ms)
        try:
            toks = (ctypes.c_int32 * 256)()
            n = ctypes.c_size_t(0)
            assert L.llama_state_load_file(ctx, str(path).encode(), toks, 256, ctypes.byref(n))
            assert list(toks[:n.value]) == sess.tokens.tolist()
            # the restored outputs: the logits of the last decoded token
            np.testing.assert_array_equal(
                np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, 0), shape=(llama.n_vocab,)), c.logits)
            results.append(llama.decode(ctx, step))
        finally:
            llama.free(ctx)
    np.testing.assert_array_equal(results[1], results[0])


def test_live_converted_layout_loads_in_llama(llama):
    """A blob written with V transposed (flash attention off) is converted by kvcache into a
    cache without (flash attention on); llama.cpp refuses the original in that context but loads
    kvcache's, and decodes on close to the flash-attention run's reference."""
    src = interop_dir() / "llama_fa0"
    dst = interop_dir() / "llama_fa1"
    m1 = manifest(dst / "seq0.bin")
    blob = (src / "seq0.bin").read_bytes()
    cache = make_cache(m1)
    with pytest.raises(kvcache.StateError, match="V layout"):
        cache.state_read(blob, 0)
    cache.state_read(blob, 0, convert=True)
    ours = cache.state_write(0, layout="2025")
    ref, ref_logits = _ref("llama_fa1")
    ctx = llama.context(m1)
    try:
        assert llama.seq_set(ctx, blob, 0) == 0
        assert llama.seq_set(ctx, ours, 0) == len(ours)
        got = llama.decode(ctx, [(ref["token"], ref["pos"], [ref["seq_id"]])])
    finally:
        llama.free(ctx)
    # the K/V were computed without flash attention, the reference with it: ~1e-3 observed
    np.testing.assert_allclose(got, ref_logits, rtol=0, atol=3e-3)
