"""kvcache plan: the numbers against the caches' own sizes and llama.cpp's log lines; every option
of the command; bad arguments as one-line errors."""
import glob
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import kvcache_env, need_module

import kvcache
from kvcache import RecurrentCache, UnifiedCache, cli
from kvcache.plan import plan_iswa, plan_recurrent, plan_unified, swa_pattern_layers

from interop_data import interop_dir

MIB = 1024 * 1024


def run_cli(capsys, *argv):
    rc = cli.main(["plan", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def plan_json(capsys, *argv):
    rc, out, err = run_cli(capsys, *argv, "--json")
    assert rc == 0, err
    return json.loads(out)


# --- the numbers ---------------------------------------------------------------------------------

def test_known_model_by_hand():
    # 32 layers of 8 KV heads x 128 (Llama-3-8B-like), 8192 cells: 32 * 1024 * 2 B * 8192 = 512 MiB each
    p = plan_unified(8192, 32, 1024, n_seq_max=1)
    assert p.kv_size == 8192
    assert p.caches[0].size_k_bytes == p.caches[0].size_v_bytes == 512 * MIB
    assert p.llama_log[-1] == ("llama_kv_cache_unified: size = 1024.00 MiB (  8192 cells,  32 layers,  1 seqs), "
                               "K (f16):  512.00 MiB, V (f16):  512.00 MiB")
    q = plan_unified(8192, 32, 1024, type_k="q8_0", type_v="q8_0", flash_attn=True)
    # q8_0: 34 bytes per 32 elements
    assert q.caches[0].size_k_bytes == 32 * (1024 // 32 * 34) * 8192


@pytest.mark.parametrize("n_ctx,fa,kv_size", [(1, False, 32), (32, False, 32), (33, False, 64), (1, True, 256),
                                              (256, True, 256), (257, True, 512), (5000, False, 5024)])
def test_padding(n_ctx, fa, kv_size):
    p = plan_unified(n_ctx, 1, 64, flash_attn=fa)
    assert p.kv_size == kv_size
    assert p.caches[0].n_pad == (256 if fa else 32)
    assert p.caches[0].v_trans is (not fa)


GEOMETRIES = [
    dict(n_ctx=100, n_layer=3, n_embd_k_gqa=64, n_embd_v_gqa=None, type_k="f16", type_v="f16", flash_attn=False),
    dict(n_ctx=300, n_layer=2, n_embd_k_gqa=[64, 128], n_embd_v_gqa=[32, 96], type_k="f32", type_v="bf16",
         flash_attn=False),
    dict(n_ctx=256, n_layer=2, n_embd_k_gqa=64, n_embd_v_gqa=64, type_k="q8_0", type_v="q4_0", flash_attn=True),
    dict(n_ctx=40, n_layer=4, n_embd_k_gqa=[32, 64, 96, 128], n_embd_v_gqa=32, type_k="q5_1", type_v="iq4_nl",
         flash_attn=True),
]


@pytest.mark.parametrize("g", GEOMETRIES)
def test_unified_matches_cache(g):
    p = plan_unified(**g, n_seq_max=3)
    c = p.caches[0]
    cache = UnifiedCache(kv_size=p.kv_size, n_layer=g["n_layer"], n_embd_k_gqa=g["n_embd_k_gqa"],
                         n_embd_v_gqa=g["n_embd_v_gqa"] if g["n_embd_v_gqa"] is not None else g["n_embd_k_gqa"],
                         type_k=g["type_k"], type_v=g["type_v"], v_trans=not g["flash_attn"], n_seq_max=3,
                         n_pad=c.n_pad)
    assert (c.size_k_bytes, c.size_v_bytes, c.total_bytes) == (cache.size_k_bytes, cache.size_v_bytes,
                                                               cache.total_size)
    assert cache.size == c.kv_size and cache.v_trans == c.v_trans
    # per layer: the K view's bytes are the planned tensor bytes
    for lp in c.layers:
        assert cache.k(lp.il).nbytes == lp.k_bytes
        assert cache.v(lp.il).nbytes == lp.v_bytes


@pytest.mark.parametrize("swa_full", [False, True])
@pytest.mark.parametrize("n_batch,n_seq_max", [(64, 4), (512, 1), (8, 2)])
def test_iswa_matches_caches(n_batch, n_seq_max, swa_full):
    swa = [0, 2, 3]
    p = plan_iswa(1000, 5, [32, 64, 32, 64, 32], swa_layers=swa, n_swa=40, n_batch=n_batch, n_seq_max=n_seq_max,
                  swa_full=swa_full)
    base, s = p.cache("base"), p.cache("swa")
    assert base.kv_size == 1024
    expect = 1024 if swa_full else min(1024, -(-(40 * n_seq_max + n_batch) // 32) * 32)
    assert s.kv_size == expect
    assert [lp.il for lp in base.layers] == [1, 4] and [lp.il for lp in s.layers] == swa
    ISWA = getattr(kvcache, "ISWACache", None)
    if ISWA is not None:
        cache = ISWA(kv_size=1024, n_layer=5, n_embd_k_gqa=[32, 64, 32, 64, 32], n_embd_v_gqa=[32, 64, 32, 64, 32],
                     swa_layers=swa, n_swa=40, n_batch=n_batch, swa_full=swa_full, n_seq_max=n_seq_max)
        parts = {"base": cache.base, "swa": cache.swa}
    else:   # the two halves as the iSWA cache builds them
        common = dict(n_layer=5, n_embd_k_gqa=[32, 64, 32, 64, 32], n_embd_v_gqa=[32, 64, 32, 64, 32],
                      n_seq_max=n_seq_max)
        parts = {"base": UnifiedCache(kv_size=1024, layers=[1, 4], **common),
                 "swa": UnifiedCache(kv_size=s.kv_size, layers=swa, n_swa=40, swa_type="standard", **common)}
    for name, cache in parts.items():
        c = p.cache(name)
        assert cache.size == c.kv_size
        assert (c.size_k_bytes, c.size_v_bytes, c.total_bytes) == (cache.size_k_bytes, cache.size_v_bytes,
                                                                   cache.total_size)


def test_recurrent_matches_cache():
    p = plan_recurrent(3, n_embd_k_s=[384, 384, 96], n_embd_v_s=2048, n_seq_max=5, n_embd_k_gqa=0, n_embd_v_gqa=16)
    cache = RecurrentCache(n_seq_max=5, n_layer=3, n_embd_k_gqa=0, n_embd_v_gqa=16, n_embd_k_s=[384, 384, 96],
                           n_embd_v_s=2048)
    c = p.caches[0]
    assert c.kv_size == cache.size == 5
    assert (c.size_k_bytes, c.size_v_bytes, c.total_bytes) == (cache.size_k_bytes, cache.size_v_bytes,
                                                               cache.total_size)
    assert [lp.n_embd_v for lp in c.layers] == [2064] * 3


def test_swa_pattern():
    # every 4th layer full attention (Gemma-3-like 5:1 would be pattern 6)
    assert swa_pattern_layers(8, 4) == [0, 1, 2, 4, 5, 6]
    assert swa_pattern_layers(4, 1) == []
    assert swa_pattern_layers(6, 6) == [0, 1, 2, 3, 4]


def test_buffer_pads_each_tensor_to_32_bytes():
    # q4_0 rows of 32 elements are 18 bytes; 32 cells -> 576 bytes per tensor, already aligned;
    # 1 layer of f32 width 1 over 32 cells: 128 bytes. A recurrent cache of 1 cell, width 3 f32: 12 -> 32.
    r = plan_recurrent(2, n_embd_k_s=3, n_embd_v_s=5, n_seq_max=1)
    c = r.caches[0]
    assert c.total_bytes == 2 * (12 + 20)
    assert c.buffer_bytes == 2 * (32 + 32)


def _manifests():
    return sorted(glob.glob(str(interop_dir() / "*" / "state.bin.json")))


def _plan_of_manifest(d):
    ctx, geo, model = d["context"], d["geometry"], d["model"]
    if d["memory_kind"] == "recurrent":
        lay = geo[0]["layers"]
        return plan_recurrent(model["n_layer"], [x["n_embd_r"] for x in lay], [x["n_embd_s"] for x in lay],
                              ctx["n_seq_max"], type_k=ctx["type_k"], type_v=ctx["type_v"])
    lay = sorted((x for c in geo for x in c["layers"]), key=lambda x: x["il"])
    kw = dict(n_seq_max=ctx["n_seq_max"], type_k=ctx["type_k"], type_v=ctx["type_v"], flash_attn=ctx["flash_attn"])
    wk, wv = [x["n_embd_k_gqa"] for x in lay], [x["n_embd_v_gqa"] for x in lay]
    if d["memory_kind"] == "iswa":
        return plan_iswa(ctx["n_ctx_requested"], model["n_layer"], wk, wv, swa_layers=model["swa_layers"],
                         n_swa=model["n_swa"], swa_type=model["swa_type"], n_batch=ctx["n_batch"], **kw)
    return plan_unified(ctx["n_ctx_requested"], model["n_layer"], wk, wv, **kw)


@pytest.mark.parametrize("path", _manifests(), ids=lambda p: Path(p).parent.name)
def test_llama_cpp_log_lines(path):
    d = json.load(open(path))
    p = _plan_of_manifest(d)
    logged = d["llama_log_cache_lines"]
    if d["memory_kind"] != "recurrent":
        assert list(p.llama_log) == logged
        # and the geometry the manifest records
        for g in d["geometry"]:
            c = p.cache(g["name"])
            assert c.kv_size == g["kv_size"] and c.v_trans == g["v_trans"]
            for x, lp in zip(g["layers"], c.layers):
                assert lp.il == x["il"] and lp.k_row_bytes == x["k_size_row"]
                assert lp.v_row_bytes == x.get("v_size_row", x.get("v_size_el", 0) * x["n_embd_v_gqa"])
        return
    # this llama.cpp logs the recurrent cache under newer names (mem_size, R, S): compare the numbers
    c = p.caches[0]
    assert c.kv_size == d["geometry"][0]["mem_size"]
    num = re.compile(r"[-+]?\d+\.\d+")
    buf = [s for s in logged if "KV buffer size" in s][0]
    assert num.findall(buf) == num.findall(p.llama_log[1])
    size = [s for s in logged if "self size" in s][0]
    assert num.findall(size) == num.findall(p.llama_log[2])


# --- the command ---------------------------------------------------------------------------------

def test_text_output(capsys):
    rc, out, err = run_cli(capsys, "--n-layer", "3", "--n-embd-k-gqa", "32", "--n-ctx", "256", "--n-seq-max", "4")
    assert rc == 0 and err == ""
    assert "unified cache: n_ctx 256 -> kv_size 256 cells (n_pad 32), 4 sequences, V transposed" in out
    assert "llama_kv_cache_unified:        CPU KV buffer size =     0.09 MiB" in out
    assert ("llama_kv_cache_unified: size =    0.09 MiB (   256 cells,   3 layers,  4 seqs), "
            "K (f16):    0.05 MiB, V (f16):    0.05 MiB") in out
    assert "total: 0.09 MiB (98,304 bytes)" in out
    assert len(re.findall(r"^\s+\d+\s+kv\s+f16", out, re.M)) == 3


def test_json_unified_options(capsys):
    d = plan_json(capsys, "--n-layer", "2", "--n-embd-k-gqa", "64,128", "--n-embd-v-gqa", "32,96",
                  "--ctx", "300", "--parallel", "3", "--type-k", "f32", "--type-v", "BF16")
    assert d["variant"] == "unified" and d["kv_size"] == 320 and d["n_seq_max"] == 3
    c = d["caches"][0]
    assert c["n_pad"] == 32 and c["v_trans"] is True
    assert [(x["type_k"], x["type_v"], x["k_row_bytes"], x["v_row_bytes"]) for x in c["layers"]] == \
        [("f32", "bf16", 256, 64), ("f32", "bf16", 512, 192)]
    assert d["total_bytes"] == 320 * (256 + 64 + 512 + 192) == c["total_bytes"]
    assert d["llama_log"][-1].startswith("llama_kv_cache_unified: size =")


def test_json_flash_attn_quantized(capsys):
    d = plan_json(capsys, "--n-layer", "3", "--n-embd-k-gqa", "32", "--n-ctx", "256", "--n-seq-max", "4",
                  "--type-k", "q8_0", "--type-v", "q8_0", "--flash-attn")
    c = d["caches"][0]
    assert c["n_pad"] == 256 and c["v_trans"] is False and c["kv_size"] == 256
    assert {x["k_row_bytes"] for x in c["layers"]} == {34}
    assert d["llama_log"] == ["llama_kv_cache_unified:        CPU KV buffer size =     0.05 MiB",
                              "llama_kv_cache_unified: size =    0.05 MiB (   256 cells,   3 layers,  4 seqs), "
                              "K (q8_0):    0.02 MiB, V (q8_0):    0.02 MiB"]


def test_json_iswa_layers(capsys):
    d = plan_json(capsys, "--n-layer", "4", "--n-embd-k-gqa", "32", "--n-ctx", "256", "--n-seq-max", "4",
                  "--swa-layers", "0,2", "--n-swa", "8", "--n-batch", "64")
    assert d["variant"] == "iswa"
    base, swa = d["caches"]
    assert (base["name"], base["kv_size"], [x["il"] for x in base["layers"]]) == ("base", 256, [1, 3])
    assert (swa["name"], swa["kv_size"], [x["il"] for x in swa["layers"]]) == ("swa", 96, [0, 2])
    assert swa["n_swa"] == 8 and swa["swa_type"] == "standard"
    assert "= 96" in d["sizing"]["swa_size"]
    assert d["llama_log"][3] == "llama_kv_cache_unified_iswa: creating     SWA KV cache, size = 96 cells"


def test_json_iswa_pattern_chunked_full(capsys):
    d = plan_json(capsys, "--n-layer", "6", "--n-embd-k-gqa", "64", "--n-ctx", "1000", "--swa-pattern", "3",
                  "--n-swa", "16", "--swa-type", "chunked", "--swa-full", "-fa")
    base, swa = d["caches"]
    assert [x["il"] for x in swa["layers"]] == [0, 1, 3, 4] and [x["il"] for x in base["layers"]] == [2, 5]
    assert base["kv_size"] == swa["kv_size"] == 1024 and swa["swa_type"] == "chunked"
    assert d["sizing"]["swa_full"] is True
    # a range in --swa-layers and the default n_batch (2048): min(kv_size, ...) is kv_size
    d = plan_json(capsys, "--n-layer", "6", "--n-embd-k-gqa", "64", "--n-ctx", "4096", "--swa-layers", "1-3",
                  "--n-swa", "8")
    assert [x["il"] for x in d["caches"][1]["layers"]] == [1, 2, 3]
    assert d["caches"][1]["kv_size"] == 8 + 2048 - (8 + 2048) % 32 + 32 == 2080


def test_json_recurrent(capsys):
    d = plan_json(capsys, "--recurrent", "--n-layer", "3", "--n-embd-k-s", "384", "--n-embd-v-s", "2048",
                  "--n-seq-max", "4")
    c = d["caches"][0]
    assert d["variant"] == "recurrent" and c["kv_size"] == 4 and c["type_k"] == "f32"
    assert d["total_bytes"] == 3 * 4 * (384 + 2048) * 4
    assert d["llama_log"][0] == ("llama_kv_cache_recurrent: kv_size = 4, n_seq_max = 4, type_k = 'f32', "
                                 "type_v = 'f32', n_layer = 3")
    d = plan_json(capsys, "--recurrent", "--n-layer", "2", "--n-embd-k-s", "8,16", "--n-embd-v-s", "32",
                  "--n-embd-k-gqa", "4", "--type-k", "f16", "--n-ctx", "999")
    c = d["caches"][0]
    assert [x["n_embd_k"] for x in c["layers"]] == [12, 20] and [x["n_embd_v"] for x in c["layers"]] == [36, 36]
    assert c["type_k"] == "f16" and c["type_v"] == "f16" and c["kv_size"] == 1 and d["n_ctx"] == 999


def test_help(capsys):
    assert cli.main(["plan", "--help"]) == 0
    out = capsys.readouterr().out
    for opt in ("--n-layer", "--n-embd-k-gqa", "--flash-attn", "--swa-layers", "--recurrent", "--gguf", "--json"):
        assert opt in out
    assert cli.main(["--help"]) == 0
    assert "plan" in capsys.readouterr().out


TYPE_NAMES = {0: "f32", 1: "f16", 8: "q8_0", 30: "bf16"}


@pytest.mark.parametrize("folder", ["llama_fa0", "llama_fa1", "llama_q8_fa1", "llama_bf16_fa1", "gemma2_fa0"])
def test_gguf_model(capsys, folder):
    """The plan of an interop model logs the cache sizes llama.cpp logged for it."""
    need_module("test", "gguf")
    man = json.loads((interop_dir() / folder / "state.bin.json").read_text())
    ctx = man["context"]
    model = interop_dir() / "models" / man["model"]["file"]
    argv = [str(model), "--ctx", str(ctx["n_ctx"]), "--parallel", str(ctx["n_seq_max"]),
            "--type-k", TYPE_NAMES[ctx["type_k"]], "--type-v", TYPE_NAMES[ctx["type_v"]]]
    if ctx["flash_attn"]:
        argv.append("--flash-attn")
    if man["memory_kind"] == "iswa":
        argv += ["--n-batch", str(ctx["n_batch"])]
    out = plan_json(capsys, *argv)
    want = [line for line in man["llama_log_cache_lines"] if ": size = " in line or "creating" in line]
    assert [line for line in out["llama_log"] if ": size = " in line or "creating" in line] == want
    c = kvcache.from_gguf(model, ctx["n_ctx"], n_seq_max=ctx["n_seq_max"], type_k=TYPE_NAMES[ctx["type_k"]],
                          type_v=TYPE_NAMES[ctx["type_v"]], flash_attn=ctx["flash_attn"], n_batch=ctx["n_batch"])
    assert out["total_bytes"] == c.total_size


def test_gguf_model_errors(capsys, tmp_path):
    junk = tmp_path / "m.gguf"
    junk.write_bytes(b"GGUF")
    rc, out, err = run_cli(capsys, str(junk))
    assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1 and "GGUF" in err
    rc, out, err = run_cli(capsys, str(tmp_path / "absent.gguf"))
    assert rc == 2 and err.strip() == f"kvcache plan: error: no such model file: {tmp_path / 'absent.gguf'}"
    rc, out, err = run_cli(capsys, str(junk), "--n-layer", "3")
    assert rc == 2 and "--n-layer comes from the model" in err


BAD = [
    (["--n-embd-k-gqa", "32"], "--n-layer is required"),
    (["--n-layer", "2"], "--n-embd-k-gqa is required"),
    (["--n-layer", "0", "--n-embd-k-gqa", "32"], "at least 1"),
    (["--n-layer", "2", "--n-embd-k-gqa", "3x"], "comma list"),
    (["--n-layer", "2", "--n-embd-k-gqa", "-4"], ">= 0"),
    (["--n-layer", "3", "--n-embd-k-gqa", "32,32"], "2 entries"),
    (["--n-layer", "2", "--n-embd-k-gqa", "32", "--type-k", "q2_k"], "unknown type"),
    (["--n-layer", "2", "--n-embd-k-gqa", "32", "--type-v", "q8_0"],
     "--type-v q8_0: expected a type of one element per block without --flash-attn"),
    (["--n-layer", "2", "--n-embd-k-gqa", "16", "--type-k", "q8_0", "-fa"],
     "--n-embd-k-gqa 16 (layer 0): expected a multiple of 32, the block size of --type-k q8_0"),
    (["--n-layer", "2", "--n-embd-k-gqa", "32", "--n-seq-max", "257"],
     "argument --n-seq-max/--parallel: must be at most 256, got 257"),
    (["--n-layer", "2", "--n-embd-k-gqa", "32", "--swa-layers", "0,2", "--n-swa", "4"], "outside [0, 2)"),
    (["--n-layer", "2", "--n-embd-k-gqa", "32", "--swa-layers", "0,a"], "layer indices"),
    (["--n-layer", "2", "--n-embd-k-gqa", "32", "--swa-layers", "3-1"], "layer indices"),
    (["--n-layer", "2", "--n-embd-k-gqa", "32", "--swa-layers", "0"], "needs --n-swa"),
    (["--n-layer", "2", "--n-embd-k-gqa", "32", "--n-swa", "4"], "--n-swa needs --swa-layers"),
    (["--n-layer", "2", "--n-embd-k-gqa", "32", "--swa-full"], "--swa-full needs"),
    (["--n-layer", "2", "--n-embd-k-gqa", "32", "--swa-layers", "0", "--swa-pattern", "2", "--n-swa", "4"],
     "once"),
    (["--n-layer", "2", "--n-embd-k-gqa", "32", "--swa-type", "sliding"], "invalid choice"),
    (["--n-layer", "2", "--n-embd-k-gqa", "32", "--n-embd-k-s", "8"], "needs --recurrent"),
    (["--recurrent", "--n-layer", "2", "--n-embd-k-s", "8"], "needs --n-embd-k-s and --n-embd-v-s"),
    (["--recurrent", "--n-layer", "2", "--n-embd-k-s", "8", "--n-embd-v-s", "8", "--swa-layers", "0"],
     "does not apply"),
    (["--recurrent", "--n-layer", "2", "--n-embd-k-s", "8", "--n-embd-v-s", "8", "-fa"], "does not apply"),
    (["a.gguf", "--gguf", "b.gguf"], "once"),
    (["--n-layer", "2", "--n-embd-k-gqa", "32", "--bogus"], "unrecognized arguments"),
]


@pytest.mark.parametrize("argv,msg", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_arguments(capsys, argv, msg):
    rc, out, err = run_cli(capsys, *argv)
    assert rc == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvcache plan: error: "), err
    assert msg in lines[0]
    assert "Traceback" not in err


def test_subprocess():
    env = kvcache_env()
    r = subprocess.run([sys.executable, "-m", "kvcache", "plan", "--n-layer", "4", "--n-embd-k-gqa", "32",
                        "--n-ctx", "256", "--n-seq-max", "4", "--swa-layers", "0,2", "--n-swa", "8",
                        "--n-batch", "64", "--json"], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert [c["kv_size"] for c in d["caches"]] == [256, 96]
    r = subprocess.run([sys.executable, "-m", "kvcache", "plan", "--n-layer", "2"], capture_output=True, text=True,
                       env=env, timeout=120)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip().splitlines() == ["kvcache plan: error: --n-embd-k-gqa is required "
                                             "(K row width: n_head_kv * head_dim)"]


def test_todays_plan_streams_and_paddings(capsys):
    """--semantics 2026: n_pad 1, a stream of PAD_256(n_ctx / n_seq_max) cells per sequence (or one
    of PAD_256(n_ctx) with --kv-unified), V in rows; the bytes are those of the 2026 cache."""
    from kvcache import UnifiedCache
    from kvcache.plan import plan_unified
    p = plan_unified(1000, 2, 64, n_seq_max=3, semantics="2026", kv_unified=False, flash_attn=True)
    c = p.caches[0]
    assert (c.kv_size, c.n_stream, c.n_pad, c.v_trans) == (512, 3, 1, False)
    cache = UnifiedCache(512, 2, 64, 64, v_trans=False, n_seq_max=3, n_pad=1, semantics="2026", kv_unified=False)
    assert c.total_bytes == cache.total_size
    assert "(   512 cells,   2 layers,  3/3 seqs)" in p.llama_log[-1]
    u = plan_unified(300, 2, 64, n_seq_max=256, semantics="2026", flash_attn=True)
    assert (u.kv_size, u.caches[0].n_stream) == (512, 1)
    rc, out, _ = run_cli(capsys, "--n-layer", "2", "--n-embd-k-gqa", "64", "--n-ctx", "256", "--n-seq-max", "4",
                         "--semantics", "2026")
    assert rc == 0 and "kv_size 256 cells in each of 4 streams (n_pad 1)" in out
    for bad in (["--kv-unified"], ["--semantics", "2026", "--recurrent", "--n-embd-k-s", "4", "--n-embd-v-s", "4"],
                ["--swa-layers", "0", "--n-swa", "8", "--n-ubatch", "64"]):
        rc, out, err = run_cli(capsys, "--n-layer", "2", "--n-embd-k-gqa", "64", *bad)
        assert rc == 2 and "kvcache plan: error: " in err and ("2026" in err or "kv-unified" in err)


@pytest.mark.parametrize("kv_unified", [True, False])
@pytest.mark.parametrize("swa_full", [None, False, True])
def test_todays_iswa_plan_is_the_cache_it_builds(kv_unified, swa_full):
    """--semantics 2026 with a window: the SWA cache of PAD_256(min(kv_size, n_swa * (n_seq_max or
    1) + n_ubatch)) cells per stream (kv_size with swa_full, today's default); the plan's sizes
    and bytes are those of ISWACache(semantics="2026")."""
    from kvcache import ISWACache
    from kvcache.plan import plan_iswa
    p = plan_iswa(4096, 4, 64, swa_layers=[0, 2], n_swa=200, n_batch=64, swa_full=swa_full, n_seq_max=3,
                  flash_attn=True, semantics="2026", kv_unified=kv_unified)
    base, swa = p.caches
    per_stream = 4096 if kv_unified else 1536         # pad(4096 // 3, 256)
    n_stream = 1 if kv_unified else 3
    want = per_stream if swa_full is not False else -(-min(per_stream, 200 * (3 if kv_unified else 1) + 64)
                                                     // 256) * 256
    assert (base.kv_size, base.n_stream, base.n_pad, swa.kv_size, swa.n_stream) == (per_stream, n_stream, 1, want,
                                                                                      n_stream)
    cache = ISWACache(per_stream, 4, 64, 64, swa_layers=[0, 2], n_swa=200, n_batch=64, swa_full=swa_full,
                      v_trans=False, n_seq_max=3, n_pad=1, semantics="2026", kv_unified=kv_unified)
    assert (cache.size_base, cache.size_swa, cache.n_stream) == (per_stream, want, n_stream)
    assert (base.total_bytes, swa.total_bytes) == (cache.base.total_size, cache.swa.total_size)
    assert p.llama_log[-3] == f"llama_kv_cache_iswa: creating     SWA KV cache, size = {want} cells"
    assert f"({want:6d} cells,   2 layers,  3/{n_stream} seqs)" in p.llama_log[-1]
    assert (p.llama_log[0].startswith("llama_kv_cache_iswa: using full-size SWA cache")) == (swa_full is not False)


def test_todays_iswa_plan_from_the_command_line(capsys):
    rc, out, _ = run_cli(capsys, "--n-layer", "4", "--n-embd-k-gqa", "64", "--swa-layers", "0,2", "--n-swa", "8",
                         "--n-ctx", "256", "--n-seq-max", "4", "--semantics", "2026", "--kv-unified", "--no-swa-full",
                         "--n-ubatch", "64")
    assert rc == 0
    assert "pad(min(kv_size, n_swa*n_seq_max + n_ubatch), 256) = pad(min(256, 8*4 + 64), 256) = 256 cells" in out
    assert "llama_kv_cache_iswa: creating     SWA KV cache, size = 256 cells" in out
    rc, out, _ = run_cli(capsys, "--n-layer", "4", "--n-embd-k-gqa", "64", "--swa-layers", "0,2", "--n-swa", "8",
                         "--n-ctx", "1024", "--n-seq-max", "4", "--semantics", "2026")
    assert rc == 0 and "swa_full: kv_size = 256 cells" in out and "using full-size SWA cache" in out
