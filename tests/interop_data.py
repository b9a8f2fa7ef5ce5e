"""Where the llama.cpp state blobs and models are, and how to build the cache a manifest describes.

The blobs ship with the repository: ``tests/data/interop`` (written by llama-cpp-python 0.3.10),
``tests/data/interop-v10`` (0.3.36) and ``tests/data/interop-hybrid`` (0.3.36, a hybrid model),
each with its README and a JSON manifest per blob; the model the live tests load is in
``tests/data/models``."""
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DATA = REPO / "tests" / "data"
MODELS = DATA / "models"
INTEROP = DATA / "interop"
INTEROP_V10 = DATA / "interop-v10"
INTEROP_HYBRID = DATA / "interop-hybrid"


def _present(d: Path) -> Path:
    # shipped with the tests: a missing folder is a broken checkout or sdist, never a reason to skip
    if not d.is_dir():
        pytest.fail(f"the llama.cpp state blobs are missing: {d} (they ship in tests/data)")
    return d


def interop_dir() -> Path:
    """tests/data/interop: the blobs of llama-cpp-python 0.3.10."""
    return _present(INTEROP)


def interop_v10_dir() -> Path:
    """tests/data/interop-v10: the blobs of llama-cpp-python 0.3.36."""
    return _present(INTEROP_V10)


def interop_hybrid_dir() -> Path:
    """tests/data/interop-hybrid: the states of a hybrid model (tiny LFM2) written by 0.3.36."""
    return _present(INTEROP_HYBRID)


def make_hybrid(m: dict):
    """An empty HybridCache of the geometry an interop-hybrid manifest describes."""
    import kvcache

    ctx, model = m["context"], m["model"]
    attn, recr = m["geometry"]["attn"], m["geometry"]["recr"]
    (ka,) = {(x["n_embd_k_gqa"], x["n_embd_v_gqa"], x["type_k"], x["type_v"]) for x in attn["layers"]}
    (rs,) = {(x["n_embd_r"], x["n_embd_s"]) for x in recr["layers"]}
    h = kvcache.HybridCache(
        attn["kv_size_per_stream"], model["n_layer"], model["recurrent_layers"], ka[0], ka[1], rs[0], rs[1],
        n_seq_max=ctx["n_seq_max"], type_k=ka[2], type_v=ka[3], v_trans=attn["v_trans"],
        n_rs_seq=recr["n_rs_seq"], attn_layers=model["attn_layers"], kv_unified=ctx["kv_unified"])
    assert h.recr.size == recr["mem_size"] and h.attn.n_stream == attn["n_stream"]
    return h


def model_path(name: str) -> Path:
    """A tiny GGUF model: tests/data/models, else the models of tests/data/interop."""
    p = MODELS / name
    if p.is_file():
        return p
    return interop_dir() / "models" / name


def manifest(path: Path) -> dict:
    with open(str(path) + ".json") as f:
        return json.load(f)


def make_cache(m: dict):
    """An empty kvcache cache of the geometry a manifest describes (unified or recurrent; None for
    a variant this build lacks)."""
    import kvcache

    kind = m["memory_kind"]
    ctx = m["context"]
    if kind == "unified":
        (g,) = m["geometry"]
        ls = g["layers"]
        return kvcache.UnifiedCache(
            g["kv_size"], len(ls), [x["n_embd_k_gqa"] for x in ls], [x["n_embd_v_gqa"] for x in ls],
            type_k=ls[0]["type_k"], type_v=ls[0]["type_v"], v_trans=g["v_trans"], n_seq_max=ctx["n_seq_max"],
            n_pad=ctx["n_pad"])
    if kind == "recurrent":
        (g,) = m["geometry"]
        ls = g["layers"]
        return kvcache.RecurrentCache(
            ctx["n_seq_max"], len(ls), [x["n_embd_r"] for x in ls], [x["n_embd_s"] for x in ls],
            type_k=ls[0]["r_type"], type_v=ls[0]["s_type"], kv_size=g["mem_size"])
    if kind == "iswa":
        return make_iswa(m)
    raise AssertionError(f"unknown memory kind {kind}")


def make_iswa(m: dict):
    """The ISWACache of a manifest, or None while kvcache has none."""
    import kvcache

    if not hasattr(kvcache, "ISWACache"):
        return None
    ctx = m["context"]
    base, swa = m["geometry"]
    layers = sorted(base["layers"] + swa["layers"], key=lambda x: x["il"])
    cache = kvcache.ISWACache(
        base["kv_size"], len(layers), [x["n_embd_k_gqa"] for x in layers], [x["n_embd_v_gqa"] for x in layers],
        swa_layers=[x["il"] for x in swa["layers"]], n_swa=swa["n_swa"], swa_type=swa["swa_type"],
        n_batch=ctx["n_ubatch"], type_k=layers[0]["type_k"], type_v=layers[0]["type_v"], v_trans=base["v_trans"],
        n_seq_max=ctx["n_seq_max"], n_pad=ctx["n_pad"])
    assert cache.swa.size == swa["kv_size"], (cache.swa.size, swa["kv_size"])
    return cache
