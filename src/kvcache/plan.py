"""The memory a KV cache will take, worked out before creating it, as llama.cpp sizes and logs it.

:func:`plan_unified`, :func:`plan_iswa` and :func:`plan_recurrent` take a model's cache geometry
and a context's settings and return a :class:`Plan`: the cache variant, the padded cell count of
each (sub-)cache, every layer's K/V type, row and tensor bytes, the totals, and the lines llama.cpp
logs when it creates the same cache. Row sizes come from kvcache's ggml type table
(:func:`kvcache._core.ggml_row_size`), the same one the caches use."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import numpy as np

from kvcache._core import MAX_SEQ, bool_arg, ggml_row_size, ggml_type, int_arg, layers_arg, swa_cells, \
    swa_full_arg, type_arg, widths_arg, SWA_PAD_2026
from kvcache._text import plural

__all__ = ["LayerPlan", "CachePlan", "Plan", "plan_unified", "plan_iswa", "plan_recurrent",
           "n_pad_for", "ctx_pad_for", "context_cells", "SEMANTICS", "v_trans_for", "swa_size", "swa_size_formula",
           "SWA_PAD_2026", "swa_pattern_layers", "format_plan", "MAX_SEQ"]

MIB = 1024 * 1024
MAX_LAYERS = 65536           # the most layers a planned model may have
CPU_TENSOR_ALIGNMENT = 32    # ggml's CPU buffer gives every tensor a 32-byte aligned slot
_SWA_TYPES = ("standard", "chunked")


# --- the sizing rules of llama.cpp's caches (plan_*, ISWACache and ModelGeometry use these) -----

#: the cache semantics: llama.cpp as of mid-2025 and today's (kvcache.UnifiedCache(semantics=))
SEMANTICS = ("2025", "2026")


def n_pad_for(flash_attn: bool, semantics: str = "2025") -> int:
    """Cell padding of a unified cache: in the 2025 semantics 256 with flash attention (its kernels
    need it), else 32; today's llama.cpp (semantics "2026") pads no cache (1)."""
    if semantics == "2026":
        return 1
    return 256 if flash_attn else 32


def ctx_pad_for(flash_attn: bool, semantics: str = "2025") -> int:
    """What a context's n_ctx is rounded up to: the 2025 semantics' n_pad, today's 256."""
    return 256 if semantics == "2026" else n_pad_for(flash_attn)


def context_cells(n_ctx: int, n_seq_max: int, flash_attn: bool, semantics: str = "2025",
                  kv_unified: bool = True) -> tuple[int, int, int]:
    """``(n_pad, kv_size, n_stream)`` of the unified cache of a context: in the 2025
    semantics ``pad(n_ctx, n_pad)`` cells in one stream; today's llama.cpp ``pad(n_ctx, 256)`` cells in
    one stream, or, not unified, ``n_seq_max`` streams of ``pad(n_ctx // n_seq_max, 256)``
    cells each (``n_ctx_seq``)."""
    if semantics not in SEMANTICS:
        raise ValueError(f"semantics = {semantics!r}: expected one of {', '.join(SEMANTICS)}")
    if semantics == "2025" and not kv_unified:
        raise ValueError("kv_unified=False (a stream per sequence) needs semantics '2026'")
    n_pad, pad = n_pad_for(flash_attn, semantics), ctx_pad_for(flash_attn, semantics)
    if kv_unified:
        return n_pad, _pad(n_ctx, pad), 1
    return n_pad, _pad(n_ctx // n_seq_max, pad), n_seq_max


def v_trans_for(flash_attn: bool) -> bool:
    """Whether V is stored transposed: without flash attention (its mat-mul reads V by columns)."""
    return not flash_attn


def swa_size(kv_size: int, n_swa: int, n_seq_max: int, n_batch: int, n_pad: int, swa_full: bool,
             semantics: str = "2025", kv_unified: bool = True) -> int:
    """Cells of an iSWA cache's sliding-window cache (per stream), or ``kv_size`` with swa_full.

    Every sequence's window plus one ubatch of ``n_batch`` tokens: in the 2025
    semantics ``min(kv_size, pad(n_swa * n_seq_max + n_batch, n_pad))``; today's llama.cpp (semantics
    "2026") ``pad(min(kv_size, n_swa * n + n_batch), 256)``, n the sequences sharing a stream
    (``n_seq_max`` unified, else 1), padded to 256 whatever ``n_pad``."""
    return swa_cells(kv_size, n_swa, n_seq_max, n_batch, n_pad, swa_full, semantics, kv_unified)


def swa_size_formula(kv_size: int, n_swa: int, n_seq_max: int, n_batch: int, n_pad: int, swa_full: bool,
                     semantics: str = "2025", kv_unified: bool = True) -> str:
    """How :func:`swa_size` got its answer, with the numbers (for ``kvcache plan``)."""
    size = swa_size(kv_size, n_swa, n_seq_max, n_batch, n_pad, swa_full, semantics, kv_unified)
    if swa_full:
        return f"swa_full: kv_size = {kv_size}"
    if semantics == "2026":
        n = n_seq_max if kv_unified else 1
        who = "n_seq_max" if kv_unified else "1"
        return (f"pad(min(kv_size, n_swa*{who} + n_ubatch), {SWA_PAD_2026}) = "
                f"pad(min({kv_size}, {n_swa}*{n} + {n_batch}), {SWA_PAD_2026}) = {size}")
    return (f"min(kv_size, pad(n_swa*n_seq_max + n_batch, n_pad)) = "
            f"min({kv_size}, pad({n_swa}*{n_seq_max} + {n_batch}, {n_pad})) = {size}")


def _pad(x: int, n: int) -> int:
    return (x + n - 1) // n * n


def swa_pattern_layers(n_layer: int, pattern: int) -> list:
    """The sliding-window layers of a repeating pattern, as llama.cpp's ``set_swa_pattern``:
    in every run of ``pattern`` layers the last one attends to the full context."""
    if pattern < 1:
        raise ValueError(f"swa pattern = {pattern} must be >= 1")
    return [il for il in range(n_layer) if il % pattern < pattern - 1]


@dataclass(frozen=True)
class LayerPlan:
    """One model layer in one cache: its K/V types, row bytes (per cell) and tensor bytes."""
    il: int
    cache: str
    type_k: str
    type_v: str
    n_embd_k: int
    n_embd_v: int
    k_row_bytes: int
    v_row_bytes: int
    k_bytes: int
    v_bytes: int

    def to_dict(self) -> dict:
        """The layer as plain data."""
        return dict(self.__dict__)


@dataclass(frozen=True)
class CachePlan:
    """One cache (the unified cache, an iSWA half, or the recurrent cache)."""
    name: str
    kv_size: int
    n_seq_max: int
    n_pad: int | None
    v_trans: bool
    n_swa: int
    swa_type: str
    type_k: str
    type_v: str
    layers: tuple
    n_stream: int = 1       # streams of kv_size cells each (semantics "2026", not unified)

    @property
    def size_k_bytes(self) -> int:
        """Bytes of K over the cache's layers (the cache's ``size_k_bytes``)."""
        return sum(lp.k_bytes for lp in self.layers)

    @property
    def size_v_bytes(self) -> int:
        """Bytes of V over the cache's layers (the cache's ``size_v_bytes``)."""
        return sum(lp.v_bytes for lp in self.layers)

    @property
    def total_bytes(self) -> int:
        """Bytes of K and V (the cache's ``total_size``)."""
        return self.size_k_bytes + self.size_v_bytes

    @property
    def buffer_bytes(self) -> int:
        """Size of the ggml CPU buffer holding the cache's tensors (each padded to 32 bytes)."""
        return sum(_pad(lp.k_bytes, CPU_TENSOR_ALIGNMENT) + _pad(lp.v_bytes, CPU_TENSOR_ALIGNMENT)
                   for lp in self.layers)

    def to_dict(self) -> dict:
        """The cache as plain data, totals included."""
        return {
            "name": self.name, "kv_size": self.kv_size, "n_stream": self.n_stream, "n_seq_max": self.n_seq_max,
            "n_pad": self.n_pad,
            "v_trans": self.v_trans, "n_swa": self.n_swa, "swa_type": self.swa_type,
            "type_k": self.type_k, "type_v": self.type_v, "n_layers": len(self.layers),
            "size_k_bytes": self.size_k_bytes, "size_v_bytes": self.size_v_bytes,
            "total_bytes": self.total_bytes, "buffer_bytes": self.buffer_bytes,
            "total_mib": self.total_bytes / MIB,
            "layers": [lp.to_dict() for lp in self.layers],
        }


@dataclass(frozen=True)
class Plan:
    """A cache's geometry and memory: ``variant`` ("unified", "iswa" or "recurrent"), the
    requested ``n_ctx``, its ``caches`` (one, or base and SWA) and llama.cpp's log lines."""
    variant: str
    n_ctx: int | None
    n_seq_max: int
    flash_attn: bool
    caches: tuple
    sizing: dict
    llama_log: tuple

    @property
    def kv_size(self) -> int:
        """Cells of the main cache (the base cache of an iSWA pair)."""
        return self.caches[0].kv_size

    @property
    def total_bytes(self) -> int:
        """Bytes of K and V over every cache."""
        return sum(c.total_bytes for c in self.caches)

    @property
    def buffer_bytes(self) -> int:
        """Bytes of the ggml CPU buffers over every cache."""
        return sum(c.buffer_bytes for c in self.caches)

    def cache(self, name: str) -> CachePlan:
        """The cache called ``name`` ("kv", "base", "swa" or "recurrent")."""
        for c in self.caches:
            if c.name == name:
                return c
        raise KeyError(f"no cache {name!r} in this plan ({', '.join(c.name for c in self.caches)})")

    def to_dict(self) -> dict:
        """The plan as plain data (what ``kvcache plan --json`` prints)."""
        return {
            "variant": self.variant, "n_ctx": self.n_ctx, "kv_size": self.kv_size,
            "n_seq_max": self.n_seq_max, "flash_attn": self.flash_attn, "sizing": dict(self.sizing),
            "caches": [c.to_dict() for c in self.caches],
            "size_k_bytes": sum(c.size_k_bytes for c in self.caches),
            "size_v_bytes": sum(c.size_v_bytes for c in self.caches),
            "total_bytes": self.total_bytes, "total_mib": self.total_bytes / MIB,
            "buffer_bytes": self.buffer_bytes,
            "llama_log": list(self.llama_log),
        }


# --- arguments ---------------------------------------------------------------------------------

def _int(v: Any, name: str, lo: int, hi: int) -> int:
    return int(int_arg(v, name, lo, hi))


def _widths(v: Any, n_layer: int, name: str) -> list:
    """One width per model layer, from an int or a sequence of n_layer ints."""
    return list(widths_arg(v, n_layer, name))


def _row(t: str, n: int, il: int | None, width: str, type_name: str) -> int:
    """Bytes of a row of n elements of type t (of layer il; None: of every layer); width and
    type_name: the keywords that gave them."""
    info = ggml_type(t)
    if n % info.blck_size:
        where = "" if il is None else f" (layer {il})"
        raise ValueError(f"{width} = {n}{where}: expected a multiple of {info.blck_size}, the block size of "
                         f"{type_name} = {info.name}")
    return ggml_row_size(info.name, n)


def _layers(cache: str, ils: Iterable[int], wk: Sequence[int], wv: Sequence[int], tk: str, tv: str,
            cells: int) -> tuple:
    out = []
    # a recurrent cache's rows also hold the states
    k, v = ("n_embd_k_gqa + n_embd_k_s", "n_embd_v_gqa + n_embd_v_s") if cache == "recurrent" else \
        ("n_embd_k_gqa", "n_embd_v_gqa")
    for il in ils:
        rk = _row(tk, wk[il], il, k, "type_k")
        rv = _row(tv, wv[il], il, v, "type_v")
        out.append(LayerPlan(il, cache, tk, tv, wk[il], wv[il], rk, rv, rk * cells, rv * cells))
    return tuple(out)


def _kv_types(type_k: Any, type_v: Any, flash_attn: bool) -> tuple:
    tk = type_arg(type_k, "type_k").name
    info_v = type_arg(type_v, "type_v")
    if not flash_attn and info_v.blck_size != 1:
        raise ValueError(f"type_v = {info_v.name}: expected a type of one element per block without flash_attn "
                         "(V is stored transposed), found a block type")
    return tk, info_v.name


def _common(n_ctx: Any, n_layer: Any, n_seq_max: Any, flash_attn: Any, semantics: str = "2025",
            kv_unified: bool = True) -> tuple:
    n_ctx = _int(n_ctx, "n_ctx", 1, 2**31 - 1)
    n_layer = _int(n_layer, "n_layer", 1, MAX_LAYERS)
    n_seq_max = _int(n_seq_max, "n_seq_max", 1, MAX_SEQ)
    flash_attn = bool_arg(flash_attn, "flash_attn")
    n_pad, kv_size, n_stream = context_cells(n_ctx, n_seq_max, flash_attn, semantics, bool_arg(kv_unified, "kv_unified"))
    if kv_size * n_stream > 2**31 - 1:
        raise ValueError(f"n_ctx = {n_ctx} padded to {n_pad} exceeds 2**31 - 1 cells")
    return n_ctx, n_layer, n_seq_max, bool(flash_attn), n_pad, kv_size, n_stream


# --- the three variants ------------------------------------------------------------------------

def plan_unified(n_ctx: int, n_layer: int, n_embd_k_gqa: Any, n_embd_v_gqa: Any = None, n_seq_max: int = 1,
                 type_k: Any = "f16", type_v: Any = "f16", flash_attn: bool = False, semantics: str = "2025",
                 kv_unified: bool = True) -> Plan:
    """The plan of a unified cache: ``kv_size = pad(n_ctx, n_pad)`` cells, every layer in it.

    ``n_embd_k_gqa`` / ``n_embd_v_gqa``: K / V row width in elements (one int, or one per layer;
    V defaults to K's). Without flash attention V is stored transposed (so ``type_v`` must have
    one element per block) and ``n_pad`` is 32; with it, 256. ``semantics="2026"`` (today's
    llama.cpp): ``n_pad`` 1 and n_ctx padded to 256, and with ``kv_unified=False``
    ``n_seq_max`` streams of ``pad(n_ctx // n_seq_max, 256)`` cells (:func:`context_cells`)."""
    n_ctx, n_layer, n_seq_max, fa, n_pad, kv_size, n_stream = _common(n_ctx, n_layer, n_seq_max, flash_attn,
                                                                      semantics, kv_unified)
    wk = _widths(n_embd_k_gqa, n_layer, "n_embd_k_gqa")
    wv = wk if n_embd_v_gqa is None else _widths(n_embd_v_gqa, n_layer, "n_embd_v_gqa")
    tk, tv = _kv_types(type_k, type_v, fa)
    c = CachePlan("kv", kv_size, n_seq_max, n_pad, v_trans_for(fa), 0, "none", tk, tv,
                  _layers("kv", range(n_layer), wk, wv, tk, tv, kv_size * n_stream), n_stream)
    if semantics == "2026":
        per = (f"pad(n_ctx, 256) = pad({n_ctx}, 256) = {kv_size}" if n_stream == 1 else
               f"pad(n_ctx // n_seq_max, 256) = pad({n_ctx // n_seq_max}, 256) = {kv_size} cells in each of "
               f"{n_stream} streams")
        sizing = {"n_pad": n_pad, "kv_size": per, "n_stream": n_stream}
        return Plan("unified", n_ctx, n_seq_max, fa, (c,), sizing, tuple(_unified_log(c, today=True)))
    sizing = {"n_pad": n_pad, "kv_size": f"pad(n_ctx, n_pad) = pad({n_ctx}, {n_pad}) = {kv_size}"}
    return Plan("unified", n_ctx, n_seq_max, fa, (c,), sizing, tuple(_unified_log(c)))


def plan_iswa(n_ctx: int, n_layer: int, n_embd_k_gqa: Any, n_embd_v_gqa: Any = None, *,
              swa_layers: Iterable[int], n_swa: int, swa_type: str = "standard", n_batch: int = 2048,
              swa_full: bool | None = None, n_seq_max: int = 1, type_k: Any = "f16", type_v: Any = "f16",
              flash_attn: bool = False, semantics: str = "2025", kv_unified: bool = True,
              layers: Iterable[int] | None = None) -> Plan:
    """The plan of an iSWA pair: a base cache of ``kv_size`` cells for the full-attention layers
    and a SWA cache of :func:`swa_size` cells for the ``swa_layers`` (``layers``: the model
    layers with K/V, default all; the others in neither cache).

    ``n_batch``: the ubatch the SWA cache is sized for. ``swa_full`` None: the semantics'
    default (:func:`kvcache._core.swa_full_arg`: False for "2025", True for "2026"). ``semantics="2026"``: today's llama.cpp, the
    base cache as :func:`plan_unified` sizes it (``n_pad`` 1, ``kv_unified``, streams) and the
    SWA cache ``pad(min(kv_size, n_swa * (n_seq_max if kv_unified else 1) + n_batch), 256)``."""
    n_ctx, n_layer, n_seq_max, fa, n_pad, kv_size, n_stream = _common(n_ctx, n_layer, n_seq_max, flash_attn,
                                                                      semantics, kv_unified)
    today = semantics == "2026"
    wk = _widths(n_embd_k_gqa, n_layer, "n_embd_k_gqa")
    wv = wk if n_embd_v_gqa is None else _widths(n_embd_v_gqa, n_layer, "n_embd_v_gqa")
    tk, tv = _kv_types(type_k, type_v, fa)
    swa = list(layers_arg(swa_layers, n_layer, "swa_layers", any_order=True))
    held = set(layers_arg(layers, n_layer, "layers", any_order=True))
    if not held.issuperset(swa):
        raise ValueError(f"swa_layers: layers {sorted(set(swa) - held)} are not among layers")
    n_swa = _int(n_swa, "n_swa", 1, 2**31 - 1)
    if swa_type not in _SWA_TYPES:
        raise ValueError(f"swa_type = {swa_type!r}: expected one of {', '.join(_SWA_TYPES)}")
    n_batch = _int(n_batch, "n_batch", 1, 2**31 - 1)
    swa_full = swa_full_arg(swa_full, semantics)
    unified = n_stream == 1
    size_swa = swa_size(kv_size, n_swa, n_seq_max, n_batch, n_pad, swa_full, semantics, unified)
    base_ils = [il for il in range(n_layer) if il not in set(swa) and il in held]
    base = CachePlan("base", kv_size, n_seq_max, n_pad, v_trans_for(fa), 0, "none", tk, tv,
                     _layers("base", base_ils, wk, wv, tk, tv, kv_size * n_stream), n_stream)
    swac = CachePlan("swa", size_swa, n_seq_max, n_pad, v_trans_for(fa), n_swa, swa_type, tk, tv,
                     _layers("swa", swa, wk, wv, tk, tv, size_swa * n_stream), n_stream)
    if today:
        kv = (f"pad(n_ctx, 256) = pad({n_ctx}, 256) = {kv_size}" if unified else
              f"pad(n_ctx // n_seq_max, 256) = pad({n_ctx // n_seq_max}, 256) = {kv_size} cells in each of "
              f"{n_stream} streams")
    else:
        kv = f"pad(n_ctx, n_pad) = pad({n_ctx}, {n_pad}) = {kv_size}"
    sizing = {
        "n_pad": n_pad,
        "kv_size": kv,
        "swa_size": swa_size_formula(kv_size, n_swa, n_seq_max, n_batch, n_pad, swa_full, semantics, unified),
        ("n_ubatch" if today else "n_batch"): n_batch, "swa_full": bool(swa_full),
    }
    if today:
        sizing["n_stream"] = n_stream
        func = "llama_kv_cache_iswa"
        log = [f"{func}: using full-size SWA cache (ref: "
               f"https://github.com/ggml-org/llama.cpp/pull/13194#issuecomment-2868343055)"] if swa_full else []
    else:
        func = "llama_kv_cache_unified_iswa"
        log = []
    log += [f"{func}: creating non-SWA KV cache, size = {kv_size} cells",
            *_unified_log(base, today),
            f"{func}: creating     SWA KV cache, size = {size_swa} cells",
            *_unified_log(swac, today)]
    return Plan("iswa", n_ctx, n_seq_max, fa, (base, swac), sizing, tuple(log))


def plan_recurrent(n_layer: int, n_embd_k_s: Any, n_embd_v_s: Any, n_seq_max: int = 1,
                   n_embd_k_gqa: Any = 0, n_embd_v_gqa: Any = 0, type_k: Any = "f32", type_v: Any = "f32",
                   n_ctx: int | None = None) -> Plan:
    """The plan of a recurrent cache: ``max(1, n_seq_max)`` cells (one state per sequence, whatever
    ``n_ctx``); a layer's K row holds ``n_embd_k_gqa + n_embd_k_s`` elements (the rolling state,
    e.g. Mamba's ``(d_conv - 1) * d_inner``), its V row ``n_embd_v_gqa + n_embd_v_s`` (the
    recurrent state, e.g. ``d_state * d_inner``)."""
    n_layer = _int(n_layer, "n_layer", 1, MAX_LAYERS)
    n_seq_max = _int(n_seq_max, "n_seq_max", 1, MAX_SEQ)
    if n_ctx is not None:
        n_ctx = _int(n_ctx, "n_ctx", 1, 2**31 - 1)
    wk = [a + b for a, b in zip(_widths(n_embd_k_gqa, n_layer, "n_embd_k_gqa"),
                                _widths(n_embd_k_s, n_layer, "n_embd_k_s"))]
    wv = [a + b for a, b in zip(_widths(n_embd_v_gqa, n_layer, "n_embd_v_gqa"),
                                _widths(n_embd_v_s, n_layer, "n_embd_v_s"))]
    tk, tv = type_arg(type_k, "type_k").name, type_arg(type_v, "type_v").name
    cells = max(1, n_seq_max)
    c = CachePlan("recurrent", cells, n_seq_max, None, False, 0, "none", tk, tv,
                  _layers("recurrent", range(n_layer), wk, wv, tk, tv, cells))
    sizing = {"kv_size": f"max(1, n_seq_max) = {cells}"}
    log = [f"llama_kv_cache_recurrent: kv_size = {cells}, n_seq_max = {n_seq_max}, type_k = '{tk}', "
           f"type_v = '{tv}', n_layer = {n_layer}",
           _buffer_line("llama_kv_cache_recurrent", c),
           f"llama_kv_cache_recurrent: KV self size  = {_mib_f32(c.total_bytes):7.2f} MiB, "
           f"K ({tk}): {_mib_f32(c.size_k_bytes):7.2f} MiB, V ({tv}): {_mib_f32(c.size_v_bytes):7.2f} MiB"]
    return Plan("recurrent", n_ctx, n_seq_max, False, (c,), sizing, tuple(log))


def plan_hybrid(n_ctx: int, n_layer: int, recurrent_layers: Iterable[int], n_embd_k_gqa: Any, n_embd_v_gqa: Any,
                n_embd_r: Any, n_embd_s: Any = 0, n_seq_max: int = 1, type_k: Any = "f16", type_v: Any = "f16",
                flash_attn: bool = False, kv_unified: bool = True, attn_layers: Iterable[int] | None = None,
                n_rs_seq: int = 0, semantics: str = "2026", n_swa: int = 0, swa_type: str = "standard",
                swa_layers: Iterable[int] | None = None, n_batch: int = 512, swa_full: bool | None = None) -> Plan:
    """The plan of today's hybrid memory (semantics "2026", :class:`kvcache.HybridCache`): an
    attention cache of the context's cells (``kv_size`` as :func:`plan_unified` with
    semantics "2026", no padding) over ``attn_layers`` (default: the layers not in
    ``recurrent_layers``), and a recurrent memory of ``max(1, n_seq_max)`` cells of f32 rows,
    ``1 + n_rs_seq`` of them per cell, over ``recurrent_layers``: R ``n_embd_r`` elements (the
    rolling convolution), S ``n_embd_s`` (the state). With ``n_swa`` > 0 (today's
    llama_memory_hybrid_iswa) the attention part is the iSWA pair :func:`plan_iswa` plans over
    the attention layers (``swa_layers``: default all of them; ``n_batch``, ``swa_full``)."""
    if semantics != "2026":
        raise ValueError(f"semantics = {semantics!r}: a hybrid memory is today's llama.cpp's ('2026')")
    n_ctx, n_layer, n_seq_max, fa, _, kv_size, n_stream = _common(n_ctx, n_layer, n_seq_max, flash_attn, "2026",
                                                                  kv_unified)
    recr = sorted(set(_int(il, "recurrent_layers", 0, n_layer - 1) for il in recurrent_layers))
    attn = ([il for il in range(n_layer) if il not in recr] if attn_layers is None else
            sorted(set(_int(il, "attn_layers", 0, n_layer - 1) for il in attn_layers)))
    n_rs_seq = _int(n_rs_seq, "n_rs_seq", 0, 64)
    wk = _widths(n_embd_k_gqa, n_layer, "n_embd_k_gqa")
    wv = _widths(n_embd_v_gqa, n_layer, "n_embd_v_gqa")
    tk, tv = _kv_types(type_k, type_v, fa)
    n_swa = _int(n_swa, "n_swa", 0, 2**31 - 1)
    if n_swa:
        pair = plan_iswa(n_ctx, n_layer, n_embd_k_gqa, n_embd_v_gqa, swa_layers=attn if swa_layers is None else
                         swa_layers, n_swa=n_swa, swa_type=swa_type, n_batch=n_batch, swa_full=swa_full,
                         n_seq_max=n_seq_max, type_k=type_k, type_v=type_v, flash_attn=flash_attn,
                         semantics="2026", kv_unified=kv_unified, layers=attn)
        attn_caches, attn_log = pair.caches, list(pair.llama_log)
    else:
        kv = CachePlan("kv", kv_size, n_seq_max, 1, v_trans_for(fa), 0, "none", tk, tv,
                       _layers("kv", attn, wk, wv, tk, tv, kv_size * n_stream), n_stream)
        attn_caches, attn_log = (kv,), _unified_log(kv, today=True)
    cells = max(1, n_seq_max)
    rs = CachePlan("recurrent", cells, n_seq_max, None, False, 0, "none", "f32", "f32",
                   _layers("recurrent", recr, _widths(n_embd_r, n_layer, "n_embd_r"),
                           _widths(n_embd_s, n_layer, "n_embd_s"), "f32", "f32", cells * (1 + n_rs_seq)))
    sizing: dict[str, Any] = {"kv_size": kv_size, "rs_size": f"max(1, n_seq_max) = {cells}", "n_rs_seq": n_rs_seq}
    if n_swa:
        sizing.update({k: v for k, v in pair.sizing.items() if k in ("swa_size", "n_ubatch", "swa_full")})
    mib = _mib_f32
    log = attn_log + [
        f"llama_memory_recurrent: {'CPU':>10s} RS buffer size = {rs.buffer_bytes / 1024.0 / 1024.0:8.2f} MiB",
        f"llama_memory_recurrent: size = {mib(rs.total_bytes):7.2f} MiB ({cells:6d} cells, {n_layer:3d} layers, "
        f"{n_seq_max:2d} seqs {n_rs_seq:2d} rs_seq), R (f32): {mib(rs.size_k_bytes):7.2f} MiB, "
        f"S (f32): {mib(rs.size_v_bytes):7.2f} MiB, P (f32): {mib(0):7.2f} MiB"]
    return Plan("hybrid", n_ctx, n_seq_max, fa, (*attn_caches, rs), sizing, tuple(log))


# --- llama.cpp's log lines ---------------------------------------------------------------------

def _mib_f32(nbytes: int) -> float:
    # llama.cpp divides in single precision: (float) bytes / (1024.0f * 1024.0f)
    return float(np.float32(nbytes) / np.float32(MIB))


def _buffer_line(func: str, c: CachePlan) -> str:
    return f"{func}: {'CPU':>10s} KV buffer size = {c.buffer_bytes / 1024.0 / 1024.0:8.2f} MiB"


def _unified_log(c: CachePlan, today: bool = False) -> list:
    """The constructor's log lines: mid-2025 llama.cpp's llama_kv_cache_unified, or today's llama_kv_cache
    (cells per stream, n_seq_max / n_stream sequences)."""
    func = "llama_kv_cache" if today else "llama_kv_cache_unified"
    seqs = f"{c.n_seq_max:2d}/{c.n_stream}" if today else f"{c.n_seq_max:2d}"
    lines = []
    if c.layers:    # a cache without layers allocates no buffer and logs none
        lines.append(_buffer_line(func, c))
    lines.append(
        f"{func}: size = {_mib_f32(c.total_bytes):7.2f} MiB ({c.kv_size:6d} cells, "
        f"{len(c.layers):3d} layers, {seqs} seqs), K ({c.type_k}): {_mib_f32(c.size_k_bytes):7.2f} MiB, "
        f"V ({c.type_v}): {_mib_f32(c.size_v_bytes):7.2f} MiB")
    return lines


# --- text --------------------------------------------------------------------------------------

def _bytes(n: int) -> str:
    if n >= MIB:
        return f"{n / MIB:.2f} MiB"
    if n >= 1024:
        return f"{n / 1024:.2f} KiB"
    return f"{n} B"


def _table(rows: list, right: set) -> list:
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    out = []
    for r in rows:
        cells = [str(v).rjust(w) if i in right else str(v).ljust(w) for i, (v, w) in enumerate(zip(r, widths))]
        out.append("  " + "  ".join(cells).rstrip())
    return out


def format_plan(p: Plan) -> str:
    """The plan as the readable text ``kvcache plan`` prints."""
    lines = []
    if p.variant == "recurrent":
        c = p.caches[0]
        lines.append(f"recurrent cache: {plural(c.kv_size, 'cell')} (one per sequence, n_seq_max = {p.n_seq_max}), "
                     f"{plural(len(c.layers), 'layer')}, K {c.type_k} / V {c.type_v}")
    else:
        c = p.caches[0]
        vt = "V transposed (no flash attention)" if c.v_trans else "V in rows (flash attention)"
        kind = {"unified": "unified cache", "iswa": "iSWA cache (base + sliding window)",
                "hybrid": "hybrid memory (attention + recurrent)"}[p.variant]
        streams = f" in each of {c.n_stream} streams" if c.n_stream > 1 else ""
        lines.append(f"{kind}: n_ctx {p.n_ctx} -> kv_size {p.kv_size} cells{streams} (n_pad {c.n_pad}), "
                     f"{plural(p.n_seq_max, 'sequence')}, {vt}")
        if p.variant == "iswa":
            s = p.cache("swa")
            lines.append(f"  base: {p.kv_size} cells, layers {_ranges([lp.il for lp in p.caches[0].layers])}")
            lines.append(f"  swa:  {p.sizing['swa_size']} cells, layers {_ranges([lp.il for lp in s.layers])}, "
                         f"window {s.n_swa} ({s.swa_type})")
        if p.variant == "hybrid":
            r = p.cache("recurrent")
            if "swa_size" in p.sizing:
                s = p.cache("swa")
                lines.append(f"  attention: an iSWA pair: base {p.kv_size} cells, layers "
                             f"{_ranges([lp.il for lp in c.layers])}; swa {p.sizing['swa_size']} cells, layers "
                             f"{_ranges([lp.il for lp in s.layers])}, window {s.n_swa} ({s.swa_type})")
            else:
                lines.append(f"  attention: {p.kv_size} cells, layers {_ranges([lp.il for lp in c.layers])}")
            lines.append(f"  recurrent: {plural(r.kv_size, 'cell')} (one per sequence) x {1 + p.sizing['n_rs_seq']} "
                         f"(n_rs_seq {p.sizing['n_rs_seq']}), layers {_ranges([lp.il for lp in r.layers])}, f32")
    lines.append("")
    rows: list[tuple[Any, ...]] = [("layer", "cache", "K type", "K width", "K row", "K bytes", "V type",
                                    "V width", "V row", "V bytes")]
    for c in p.caches:
        for lp in c.layers:
            rows.append((lp.il, lp.cache, lp.type_k, lp.n_embd_k, lp.k_row_bytes, f"{lp.k_bytes:,}",
                         lp.type_v, lp.n_embd_v, lp.v_row_bytes, f"{lp.v_bytes:,}"))
    rows[1:] = sorted(rows[1:], key=lambda r: r[0])
    lines += _table(rows, {0, 3, 4, 5, 7, 8, 9})
    lines.append("  (row = bytes per cell)")
    lines.append("")
    rows = [("cache", "cells", "layers", "K", "V", "total", "CPU buffer")]
    for c in p.caches:
        rows.append((c.name, c.kv_size, len(c.layers), _bytes(c.size_k_bytes), _bytes(c.size_v_bytes),
                     _bytes(c.total_bytes), _bytes(c.buffer_bytes)))
    if len(p.caches) > 1:
        rows.append(("all", sum(c.kv_size for c in p.caches), sum(len(c.layers) for c in p.caches),
                     _bytes(sum(c.size_k_bytes for c in p.caches)), _bytes(sum(c.size_v_bytes for c in p.caches)),
                     _bytes(p.total_bytes), _bytes(p.buffer_bytes)))
    lines += _table(rows, {1, 2, 3, 4, 5, 6})
    lines.append(f"total: {p.total_bytes / MIB:.2f} MiB ({p.total_bytes:,} bytes)")
    lines.append("")
    lines.append("llama.cpp logs:")
    lines += [f"  {s}" for s in p.llama_log]
    return "\n".join(lines)


def _ranges(ils: Sequence[int]) -> str:
    """Layer indices compactly: 0-3,6,8-9."""
    if not ils:
        return "none"
    parts, start, prev = [], ils[0], ils[0]
    for il in list(ils[1:]) + [None]:
        if il is not None and il == prev + 1:
            prev = il
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if il is not None:
            start = prev = il
    return ",".join(parts)
