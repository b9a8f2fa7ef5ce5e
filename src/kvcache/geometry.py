"""Cache geometry of a model, read from its GGUF file or its transformers config: which cache
llama.cpp builds for it, with which layers, row widths, sliding window, recurrent state sizes and
RoPE parameters.

``kvcache.from_gguf(path, n_ctx)`` returns the cache llama.cpp would create for that model and
context; ``kvcache.read_gguf(path)`` returns the :class:`ModelGeometry` it is built from. Only the
metadata and, when present, the RoPE frequency-factor tensors are read, by kvcache itself in one
walk of the file's header that steps over a tokenizer's arrays (no other package is needed). ``from_transformers_config(config, n_ctx)`` and
``read_transformers_config(config)`` do the same for a transformers ``PretrainedConfig`` (or a
model), with RoPE parameters that rotate keys as the model's own rotary embedding does."""
from __future__ import annotations

import math
import mmap
import os
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Literal, Union, cast

import numpy as np
import numpy.typing as npt

from kvcache._atomic import open_regular
from kvcache._core import RopeParams, bool_arg, int_arg, swa_full_arg
from kvcache.plan import MAX_LAYERS, context_cells, v_trans_for
from kvcache.hybrid import HybridCache
from kvcache.recurrent import RecurrentCache
from kvcache.unified import UnifiedCache, UnifiedCache2025, UnifiedCache2026

if TYPE_CHECKING:
    from kvcache.iswa import ISWACache

    _SwaType = Literal["none", "standard", "chunked"]

__all__ = ["ModelGeometry", "read_gguf", "from_gguf", "read_transformers_config", "from_transformers_config", "hf_attention",
           "rope_from_transformers"]

# What from_gguf / ModelGeometry.make_cache build for a model.
AnyCache = Union[UnifiedCache, "ISWACache", RecurrentCache, HybridCache]

# RoPE layout by architecture (llama.cpp's llama_model_rope_type): "normal" rotates adjacent
# pairs, "neox" pairs offset by n_rot/2; listed architectures not here use no RoPE.
_ROPE_NORMAL = frozenset("""
    llama llada llama4 deci baichuan starcoder internlm2 minicpm xverse command-r cohere2 olmo
    arctic deepseek deepseek2 plm chatglm glm4 granite granitemoe granitehybrid chameleon solar
    bailingmoe neo-bert smollm3 arcee ernie4_5 ernie4_5-moe
""".split())
_ROPE_NEOX = frozenset("""
    falcon falcon-h1 grok dbrx bert nomic-bert nomic-bert-moe stablelm bitnet qwen qwen2 dream
    qwen2moe qwen3 qwen3moe olmo2 olmoe phi2 phi3 phimoe plamo plamo2 gemma gemma2 gemma3 gemma3n
    starcoder2 openelm gptneox codeshell orion nemotron exaone exaone4 minicpm3 dots1 hunyuan-moe
    hunyuan-dense gpt-oss lfm2 lfm2moe smallthinker glm4moe qwen3next
""".split())
_ROPE_NONE = frozenset("""
    gpt2 gptj mpt refact bloom mamba mamba2 jamba jina-bert-v2 t5 t5encoder jais rwkv6 rwkv6qwen2
    rwkv7 arwkv7 wavtokenizer-dec nemotron_h nemotron_h_moe
""".split())

# Recurrent architectures whose state sizes come from the ssm.* keys.
_SSM_ARCHS = frozenset(("mamba", "mamba2"))
_UNSUPPORTED_RECURRENT = frozenset(("rwkv6", "rwkv6qwen2", "rwkv7", "arwkv7"))
# Hybrid architectures (attention and recurrent layers: today's llama_memory_hybrid), and those
# whose recurrent memory may keep rollback snapshots (llama.cpp's llm_arch_supports_rs_rollback;
# it sets n_rs_seq to 0 for the others).
_HYBRID_ARCHS = frozenset(("lfm2", "lfm2moe", "granitehybrid", "jamba", "falcon-h1", "nemotron_h", "nemotron_h_moe",
                           "qwen3next", "plamo2"))
_RS_ROLLBACK_ARCHS = frozenset(("lfm2", "lfm2moe", "nemotron_h", "nemotron_h_moe"))
# Hybrid architectures whose loader reads {arch}.attention.sliding_window (today's
# llama_memory_hybrid_iswa when it is > 0)
_HYBRID_SWA_ARCHS = frozenset(("lfm2",))
# Hybrid architectures whose layers use RoPE only when {arch}.rope.scaling.finetuned is true (its
# default; Granite 4's converter writes false for its hybrids)
_ROPE_SWITCHED = frozenset(("granitehybrid",))

# Sliding-window layouts the architectures' loaders set: (swa type, period of the pattern,
# default window or None when the file must hold it, base/scale of the windowed layers' RoPE).
# Layer il uses the window when period == 0 or il % period < period - 1.
_SWA_ARCHS: dict[str, tuple[_SwaType, int, int | None, tuple[float, float] | None]] = {
    "gemma2": ("standard", 2, 4096, None),
    "gemma3": ("standard", 6, None, (10000.0, 1.0)),
    "cohere2": ("standard", 4, None, None),
    "llama4": ("chunked", 4, 8192, None),
}


@dataclass(frozen=True)
class ModelGeometry:
    """What a KV cache needs to know about a model.

    Per-layer tuples have ``n_layer`` entries. ``n_embd_k_gqa[il] = n_embd_head_k * n_head_kv[il]``
    (likewise V). ``swa_layers`` are the layers using the sliding window (empty without one).
    Recurrent models (``recurrent``) keep ``n_embd_k_s`` / ``n_embd_v_s`` elements of state per
    layer and sequence instead of per-token rows. ``rope`` is None for models without RoPE and
    for M-RoPE models (llama.cpp never shifts their keys);
    ``rope_long`` holds the long-context frequency factors of Phi-3 style models (used when a
    sequence's share of the context exceeds ``rope.n_ctx_orig``). ``cell_ext``: today's
    llama.cpp gives the cache's cells its per-cell extension (M-RoPE models, whose GGUF has
    ``{arch}.rope.dimension_sections``, and per-layer-embedding models, ``{arch}.ple.*``);
    ``ple_token``: a per-layer-embedding model's token for ubatches without token ids (its image
    token, else its EOS token), None for other models. A hybrid model (``recurrent_layers`` not
    empty) has K/V in ``attn_layers`` and a recurrent state in ``recurrent_layers`` (a layer may
    be in both, or neither), ``n_embd_k_s`` / ``n_embd_v_s`` being the R / S widths of a
    recurrent layer; ``rs_rollback``: llama.cpp keeps rollback snapshots for its architecture."""

    arch: str
    n_layer: int
    n_embd: int
    n_ctx_train: int
    n_head: tuple[int, ...]
    n_head_kv: tuple[int, ...]
    n_embd_head_k: int
    n_embd_head_v: int
    n_swa: int = 0
    swa_type: _SwaType = "none"
    swa_layers: tuple[int, ...] = ()
    recurrent: bool = False
    n_embd_k_s: int = 0
    n_embd_v_s: int = 0
    rope: RopeParams | None = None
    rope_long: RopeParams | None = None
    cell_ext: bool = False
    ple_token: int | None = None
    recurrent_layers: tuple[int, ...] = ()
    attn_layers: tuple[int, ...] = ()
    rs_rollback: bool = False

    @property
    def hybrid(self) -> bool:
        """Attention and recurrent layers: llama.cpp's hybrid memory (a :class:`HybridCache`)."""
        return bool(self.recurrent_layers) and not self.recurrent

    @property
    def n_embd_k_gqa(self) -> tuple[int, ...]:
        """K row width of each layer (elements)."""
        return tuple(self.n_embd_head_k * h for h in self.n_head_kv)

    @property
    def n_embd_v_gqa(self) -> tuple[int, ...]:
        """V row width of each layer (elements)."""
        return tuple(self.n_embd_head_v * h for h in self.n_head_kv)

    def make_cache(self, n_ctx: int, n_seq_max: int = 1, type_k: Any = "f16", type_v: Any = "f16",
                   flash_attn: bool | None = None, swa_full: bool | None = None, n_batch: int = 512,
                   buffers: Any = "owned", semantics: str = "2025", kv_unified: bool | None = None,
                   v_trans: bool | None = None, n_rs_seq: int = 0) -> AnyCache:
        """The cache llama.cpp creates for this model and context (see :func:`from_gguf`);
        ``v_trans`` None: V transposed unless flash attention is on, as llama.cpp does."""
        n_ctx = int_arg(n_ctx, "n_ctx", 0, 2**31 - 1)
        n_seq_max = int_arg(n_seq_max, "n_seq_max", 1, 2**31 - 1)
        n_batch = int_arg(n_batch, "n_batch", 1, 2**31 - 1)
        today = semantics == "2026"
        # the defaults of each era: mid-2025 llama.cpp's flash attention off, no full SWA cache, one
        # stream; today's flash attention "auto" (a V not transposed), swa_full, a stream per sequence
        flash_attn = bool_arg(today if flash_attn is None else flash_attn, "flash_attn")
        swa_full = swa_full_arg(swa_full, semantics)
        kv_unified = bool_arg(not today if kv_unified is None else kv_unified, "kv_unified")
        n_rs_seq = int_arg(n_rs_seq, "n_rs_seq", 0, 64)
        if self.recurrent:
            # llama.cpp keeps recurrent states in f32 whatever the K/V types asked for, one cell
            # per sequence
            return RecurrentCache(n_seq_max, self.n_layer, self.n_embd_k_gqa, self.n_embd_v_gqa,
                                  type_k="f32", type_v="f32", n_embd_k_s=self.n_embd_k_s,
                                  n_embd_v_s=self.n_embd_v_s, buffers=buffers, semantics=semantics,
                                  n_rs_seq=n_rs_seq if today and self.rs_rollback else 0)
        if self.hybrid:
            return _hybrid_cache(self, n_ctx, n_seq_max, type_k, type_v, flash_attn, buffers, semantics, kv_unified,
                                 v_trans, n_rs_seq, n_batch, swa_full)
        if any(h == 0 for h in self.n_head_kv):
            missing = [il for il, h in enumerate(self.n_head_kv) if h == 0]
            raise ValueError(f"{self.arch}: layers {missing} have no KV heads; such models are not supported")
        if n_ctx == 0:
            n_ctx = self.n_ctx_train
        n_pad, kv_size, n_stream = context_cells(n_ctx, n_seq_max, flash_attn, semantics, kv_unified)
        # the context of one sequence: the 2025 share of the cells, today's stream (or, unified, all)
        n_ctx_seq = kv_size if today else kv_size // n_seq_max
        rope = self.rope
        if self.rope_long is not None and rope is not None and n_ctx_seq > rope.n_ctx_orig:
            rope = self.rope_long
        common = dict(n_layer=self.n_layer, n_embd_k_gqa=self.n_embd_k_gqa, n_embd_v_gqa=self.n_embd_v_gqa,
                      type_k=type_k, type_v=type_v,
                      v_trans=v_trans_for(flash_attn) if v_trans is None else bool_arg(v_trans, "v_trans"),
                      n_seq_max=n_seq_max,
                      n_pad=n_pad, n_embd_head_k=self.n_embd_head_k, rope=rope, buffers=buffers)
        # mid-2025 llama.cpp's cells had no extension: its caches of these models have none either
        ext: dict[str, Any] = dict(cell_ext=True, ple_token=self.ple_token) if today and self.cell_ext else {}
        if self.swa_type == "none":
            if today:
                return UnifiedCache2026(kv_size=kv_size, kv_unified=n_stream == 1, **common, **ext)
            return UnifiedCache2025(kv_size=kv_size, **common)
        from kvcache.iswa import ISWACache
        # llama.cpp caps the batch at the (unpadded) context of a causal model
        extra: dict[str, Any] = dict(semantics="2026", kv_unified=n_stream == 1, **ext) if today else {}
        pair: ISWACache = ISWACache(kv_size=kv_size, swa_layers=self.swa_layers, n_swa=self.n_swa,
                                    swa_type=self.swa_type, n_batch=min(n_ctx, n_batch), swa_full=swa_full,
                                    **common, **extra)
        return pair


# GGUF value types (gguf.GGUFValueType): the bytes of each fixed-size one, and the others
_GGUF_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_GGUF_NAMES = {0: "u8", 1: "i8", 2: "u16", 3: "i16", 4: "u32", 5: "i32", 6: "f32", 7: "bool", 8: "string",
               9: "array", 10: "u64", 11: "i64", 12: "f64"}
_GGUF_INTS = frozenset((0, 1, 2, 3, 4, 5, 10, 11))
_GGUF_FLOATS = frozenset((6, 12))
_GGUF_BOOL, _GGUF_STRING, _GGUF_ARRAY = 7, 8, 9
_GGUF_MAX_NESTING = 8          # arrays of arrays (llama.cpp reads none; the walk recurses)
_UINT32_MAX = 2**32 - 1        # llama.cpp's hyperparameters are uint32


# struct formats of the fixed-size GGUF value types
_GGUF_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
# arrays longer than this are not copied out of the file: kvcache reads none (the per-layer
# arrays of MAX_LAYERS entries are far below it; a tokenizer's vocabulary is not read at all)
_GGUF_ARRAY_READ_MAX = 1 << 20
# the tensors kvcache reads (RoPE frequency factors), copied while the file is open
_GGUF_TENSORS_READ = frozenset(("rope_freqs.weight", "rope_factors_short.weight", "rope_factors_long.weight"))
_GGUF_DEFAULT_ALIGNMENT = 32


class _GGUFField:
    """A metadata value as _Fields reads it: its GGUF types (an array's: the array's, then its
    items') and contents() (a scalar, a str, or a list for an array)."""
    __slots__ = ("types", "_value")

    def __init__(self, types: list[int], value: Callable[[], Any]) -> None:
        self.types = types
        self._value = value

    def contents(self) -> Any:
        return self._value()


class _GGUFMeta:
    """What read_gguf takes from a GGUF file: its metadata (fields) and the tensors it reads."""

    def __init__(self) -> None:
        self.fields: dict[str, _GGUFField] = {}
        self.tensors: dict[str, npt.NDArray[np.float32]] = {}    # those kvcache reads, as float32


def _read_gguf_layout(buf: Any, path: str) -> _GGUFMeta:
    """Walk the header, metadata and tensor list of a GGUF file (v2/v3, either byte order),
    checking that every length and count fits in the bytes the file has and that no key repeats,
    and take the metadata and the RoPE factor tensors. One pass in the cost of the metadata's
    values, not of their items: a tokenizer's arrays are stepped over, not decoded."""
    end = len(buf)
    if end < 24 or buf[:4] != b"GGUF":
        raise ValueError(f"{path}: not a GGUF file (no GGUF header)")
    order = "<"
    version = struct.unpack_from("<I", buf, 4)[0]
    if version & 0xFFFF == 0:   # written on a machine of the other byte order (as gguf decides)
        order = ">"
        version = struct.unpack_from(">I", buf, 4)[0]
    if version not in (2, 3):
        raise ValueError(f"{path}: GGUF version {version} is not supported (2 and 3 are)")
    u32, u64 = struct.Struct(order + "I").unpack_from, struct.Struct(order + "Q").unpack_from
    n_tensors, n_kv = int(u64(buf, 8)[0]), int(u64(buf, 16)[0])
    meta = _GGUFMeta()

    def need(pos: int, n: int, what: str) -> None:
        if n > end - pos:
            raise ValueError(f"{path}: {what} runs past the end of the file ({end - pos} bytes left, "
                             f"{n} needed)")

    def string(pos: int, what: str) -> int:
        need(pos, 8, what)
        n = int(u64(buf, pos)[0])
        need(pos + 8, n, what)
        return pos + 8 + n

    def text(start: int, stop: int) -> str:
        return bytes(buf[start + 8:stop]).decode("utf-8", errors="replace")

    def value(pos: int, t: int, what: str, depth: int, types: list[int]) -> tuple[int, Callable[[], Any]]:
        """The end of the value of type t at pos, and its contents (copied now: the file closes)."""
        types.append(t)
        fmt = _GGUF_FORMATS.get(t)
        if fmt is not None:
            size = _GGUF_SIZES[t]
            need(pos, size, what)
            v = struct.unpack_from(order + fmt, buf, pos)[0]
            return pos + size, lambda: v
        if t == _GGUF_STRING:
            stop = string(pos, what)
            s = text(pos, stop)
            return stop, lambda: s
        if t != _GGUF_ARRAY:
            raise ValueError(f"{path}: {what} has the unknown GGUF type {t}")
        if depth == _GGUF_MAX_NESTING:
            raise ValueError(f"{path}: {what} nests arrays more than {_GGUF_MAX_NESTING} deep")
        need(pos, 12, what)
        it, count = int(u32(buf, pos)[0]), int(u64(buf, pos + 4)[0])
        pos += 12
        items = f"{what} (an array of {count} {_GGUF_NAMES.get(it, f'type {it}')})"
        start = pos
        item_size = _GGUF_SIZES.get(it)
        if item_size is not None:
            size = count * item_size
            need(pos, size, items)
            types.append(it)
            pos += size
            if size > _GGUF_ARRAY_READ_MAX:
                return pos, _too_long(path, what, count)
            arr = np.frombuffer(buf, np.dtype(order + _GGUF_FORMATS[it]), count, start).tolist()
            return pos, lambda: arr
        if it not in (_GGUF_STRING, _GGUF_ARRAY):
            raise ValueError(f"{path}: {what} is an array of the unknown GGUF type {it}")
        # every item takes at least its length (8 bytes) or its type and count (12): a count
        # the file cannot hold is refused before the loop
        need(pos, count * (8 if it == _GGUF_STRING else 12), items)
        if it == _GGUF_STRING:
            types.append(it)
            for _ in range(count):
                if end - pos < 8:       # (past the end too: a string's length overran it)
                    break
                pos += 8 + u64(buf, pos)[0]
            else:
                if pos <= end:
                    if pos - start > _GGUF_ARRAY_READ_MAX:
                        return pos, _too_long(path, what, count)
                    strs, q = [], start
                    for _ in range(count):
                        stop = q + 8 + int(u64(buf, q)[0])
                        strs.append(text(q, stop))
                        q = stop
                    return pos, lambda: strs
            raise ValueError(f"{path}: {items} runs past the end of the file ({end} bytes)")
        inner: list[Callable[[], Any]] = []
        item_types: list[int] = []
        for _ in range(count):
            item_types = []
            pos, get = value(pos, _GGUF_ARRAY, what, depth + 1, item_types)
            inner.append(get)
        types.extend(item_types or [_GGUF_ARRAY])
        return pos, lambda: [g() for g in inner]

    pos = 24
    for i in range(n_kv):
        start = pos
        pos = string(pos, f"metadata key {i}")
        try:
            key = bytes(buf[start + 8:pos]).decode()
        except UnicodeDecodeError:
            raise ValueError(f"{path}: metadata key {i} is not UTF-8 text") from None
        if key in meta.fields:
            raise ValueError(f"{path}: the metadata key {key!r} appears twice")
        need(pos, 4, f"the type of {key!r}")
        types: list[int] = []
        pos, get = value(pos + 4, int(u32(buf, pos)[0]), f"the value of {key!r}", 0, types)
        meta.fields[key] = _GGUFField(types, get)
    wanted = []
    for i in range(n_tensors):
        what = f"tensor {i}'s description"
        start = pos
        pos = string(pos, what)
        need(pos, 4, what)
        n_dims = int(u32(buf, pos)[0])
        need(pos + 4, n_dims * 8 + 12, what)   # the dimensions, type and offset
        name = text(start, pos)
        if name in _GGUF_TENSORS_READ:
            dims = struct.unpack_from(f"{order}{n_dims}Q", buf, pos + 4)
            t_type, offset = u32(buf, pos + 4 + n_dims * 8)[0], u64(buf, pos + 8 + n_dims * 8)[0]
            wanted.append((name, math.prod(dims), int(t_type), int(offset)))
        pos += 4 + n_dims * 8 + 12
    align = _GGUF_DEFAULT_ALIGNMENT
    if "general.alignment" in meta.fields:
        align = meta.fields["general.alignment"].contents()
        if not isinstance(align, int) or isinstance(align, bool) or align <= 0 or align & (align - 1):
            raise ValueError(f"{path}: general.alignment = {align!r}, expected a power of two")
    data = -(-pos // align) * align
    for name, n, t_type, offset in wanted:
        if t_type not in (0, 1):    # ggml's f32 and f16: the only types RoPE factors come in
            raise ValueError(f"{path}: the tensor {name!r} has the ggml type {t_type}, expected f32 or f16")
        nbytes = n * (4 if t_type == 0 else 2)
        need(data + offset, nbytes, f"the data of the tensor {name!r}")
        # (a copy at once: no view of the file outlives the walk, so that it can close)
        meta.tensors[name] = np.frombuffer(buf, np.dtype(order + ("f4" if t_type == 0 else "f2")), n,
                                           data + offset).astype(np.float32)
    return meta


def _too_long(path: str, what: str, count: int) -> Callable[[], Any]:
    """contents() of an array too long to take from the file (kvcache reads none such)."""
    def refuse() -> Any:
        raise ValueError(f"{path}: {what} is an array of {count} items, longer than any kvcache reads")
    return refuse


class _Fields:
    """The metadata of a GGUF file with llama.cpp's lookup rules (arch-prefixed keys) and its
    typing: an integer key holds an integer, a bool key a bool (llama.cpp refuses a key of
    another GGUF type)."""

    def __init__(self, reader: _GGUFMeta, path: str):
        self._r = reader
        self.path = path
        self.arch = self.get("general.architecture", str)

    def has(self, key: str) -> bool:
        return key.format(arch=self.arch) in self._r.fields

    def _field(self, key: str, default: Any) -> tuple[str, Any]:
        name = key.format(arch=getattr(self, "arch", ""))
        field = self._r.fields.get(name)
        if field is None and default is ...:
            raise ValueError(f"{self.path}: the GGUF file lacks the key {name!r}")
        return name, field

    def _int(self, name: str, t: int, v: Any, lo: int, hi: int) -> int:
        if t not in _GGUF_INTS:
            raise ValueError(f"{self.path}: {name} has the GGUF type {_GGUF_NAMES.get(t, t)}, expected an integer")
        try:
            return int(int_arg(int(v), name, lo, hi))
        except ValueError as e:
            raise ValueError(f"{self.path}: {e}") from None

    def get(self, key: str, kind: type, default: Any = ..., lo: int | float = 0, hi: int = _UINT32_MAX) -> Any:
        """A single value of the type kind (str, bool, int within [lo, hi], float: finite, >= lo)."""
        name, field = self._field(key, default)
        if field is None:
            return default
        t = int(field.types[0])
        if t == _GGUF_ARRAY:
            raise ValueError(f"{self.path}: {name} is an array, expected one {kind.__name__}")
        v = field.contents()
        if kind is str:
            if t != _GGUF_STRING:
                raise ValueError(f"{self.path}: {name} is not a string")
            return v
        if kind is bool:
            if t != _GGUF_BOOL:
                raise ValueError(f"{self.path}: {name} has the GGUF type {_GGUF_NAMES.get(t, t)}, expected a bool")
            return bool(v)
        if kind is int:
            return self._int(name, t, v, int(lo), hi)
        if t not in _GGUF_FLOATS and t not in _GGUF_INTS:
            raise ValueError(f"{self.path}: {name} is not a number")
        x = float(v)
        if not math.isfinite(x) or x < lo:
            raise ValueError(f"{self.path}: {name} = {x!r}, expected a finite number >= {lo}")
        return x

    def per_layer(self, key: str, n_layer: int, default: Any = ...) -> tuple[int, ...]:
        """An integer given once or per layer (llama.cpp's get_key_or_arr), each within uint32."""
        name, field = self._field(key, default)
        if field is None:
            return cast("tuple[int, ...]", default)
        types = [int(t) for t in field.types]
        if types[0] != _GGUF_ARRAY:
            return (self.get(key, int),) * n_layer
        v = field.contents()
        if len(v) != n_layer:
            raise ValueError(f"{self.path}: {name} has {len(v)} entries, expected one per layer ({n_layer})")
        t = types[1] if len(types) > 1 else _GGUF_ARRAY   # (an empty array names no item type)
        return tuple(self._int(name, t, x, 0, _UINT32_MAX) for x in v)

    def ints(self, key: str) -> tuple[int, ...]:
        """An array of integers, or () when the file lacks the key."""
        name, field = self._field(key, None)
        if field is None:
            return ()
        types = [int(t) for t in field.types]
        if types[0] != _GGUF_ARRAY or (len(types) > 1 and types[1] not in _GGUF_INTS):
            raise ValueError(f"{self.path}: {name} is not an array of integers")
        return tuple(int(x) for x in field.contents())

    def tensor(self, name: str) -> npt.NDArray[np.float32] | None:
        t: npt.NDArray[np.float32] | None = self._r.tensors.get(name)
        return t


def _hybrid_cache(g: ModelGeometry, n_ctx: int, n_seq_max: int, type_k: Any, type_v: Any, flash_attn: bool,
                  buffers: Any, semantics: str, kv_unified: bool, v_trans: bool | None, n_rs_seq: int,
                  n_batch: int, swa_full: bool) -> HybridCache:
    """ModelGeometry.make_cache of a hybrid model: today's llama_memory_hybrid."""
    if semantics != "2026":
        raise ValueError(f"{g.arch}: a hybrid model's memory is modelled as today's llama.cpp has it: "
                         f"semantics '2026', not {semantics!r}")
    if n_ctx == 0:
        n_ctx = g.n_ctx_train
    # the attention part: the unified cache of the context, without padding; RoPE shifts its keys
    _, kv_size, n_stream = context_cells(n_ctx, n_seq_max, flash_attn, semantics, kv_unified)
    # with a window, llama_memory_hybrid_iswa: the iSWA pair sized for the ubatch (capped at the
    # context, as llama.cpp caps it)
    window: dict[str, Any] = dict(n_swa=g.n_swa, swa_type=g.swa_type, swa_layers=g.swa_layers,
                                  n_batch=min(n_ctx, n_batch), swa_full=swa_full) if g.n_swa else {}
    return HybridCache(kv_size, g.n_layer, g.recurrent_layers, g.n_embd_k_gqa, g.n_embd_v_gqa, g.n_embd_k_s,
                       g.n_embd_v_s, n_seq_max=n_seq_max, type_k=type_k, type_v=type_v,
                       v_trans=v_trans_for(flash_attn) if v_trans is None else bool_arg(v_trans, "v_trans"),
                       # llama.cpp keeps no snapshot for the other architectures, silently
                       n_rs_seq=n_rs_seq if g.rs_rollback else 0, attn_layers=g.attn_layers,
                       kv_unified=n_stream == 1, n_embd_head_k=g.n_embd_head_k, rope=g.rope, buffers=buffers,
                       **window)


def _hybrid_layers(f: _Fields, arch: str, n_layer: int, n_head_kv: tuple[int, ...]
                   ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(recurrent layers, attention layers) of a hybrid model, as llama.cpp's loaders mark them."""
    if arch == "falcon-h1":
        every = tuple(range(n_layer))
        return every, every
    if arch == "qwen3next":
        if f.has("{arch}.attention.recurrent_layers"):
            flags = f.per_layer("{arch}.attention.recurrent_layers", n_layer)
        else:
            interval = f.get("{arch}.full_attention_interval", int, 4, lo=1)
            flags = tuple(int((il + 1) % interval != 0) for il in range(n_layer))
        recr = tuple(il for il in range(n_layer) if flags[il])
        return recr, tuple(il for il in range(n_layer) if not flags[il])
    if arch in ("nemotron_h", "nemotron_h_moe"):
        # the feed-forward layers have neither K/V nor a state
        n_ff = f.per_layer("{arch}.feed_forward_length", n_layer, (0,) * n_layer)
        recr = tuple(il for il in range(n_layer) if n_head_kv[il] == 0 and n_ff[il] == 0)
        return recr, tuple(il for il in range(n_layer) if n_head_kv[il] != 0 and n_ff[il] == 0)
    recr = tuple(il for il in range(n_layer) if n_head_kv[il] == 0)
    return recr, tuple(il for il in range(n_layer) if n_head_kv[il] != 0)


def read_gguf(path: Any) -> ModelGeometry:
    """The cache geometry of the model in a GGUF file (ValueError when it is not a GGUF file or
    lacks a key the geometry needs)."""
    path = str(path)
    # a FIFO or a device in place of the file would block the read, or never end
    with open_regular(path) as file:
        size = os.fstat(file.fileno()).st_size
        if size < 24:
            raise ValueError(f"{path}: not a GGUF file ({size} bytes)")
        with mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            meta = _read_gguf_layout(buf, path)
    f = _Fields(meta, path)
    arch = f.arch
    n_layer = f.get("{arch}.block_count", int, lo=1, hi=MAX_LAYERS)
    n_embd = f.get("{arch}.embedding_length", int)
    n_ctx_train = f.get("{arch}.context_length", int)

    recurrent = arch in _SSM_ARCHS or arch in _UNSUPPORTED_RECURRENT
    if arch in _UNSUPPORTED_RECURRENT:
        raise ValueError(f"{path}: the {arch!r} architecture (recurrent) is not supported")
    hybrid = arch in _HYBRID_ARCHS

    n_head = f.per_layer("{arch}.attention.head_count", n_layer, (0,) * n_layer)
    n_head_kv = f.per_layer("{arch}.attention.head_count_kv", n_layer, n_head)
    # a hybrid model's recurrent layers may have no heads: the attention layers' size the heads
    head0 = max(n_head, default=0) if hybrid else (n_head[0] if n_head else 0)
    if head0 > 0:
        n_embd_head_k = f.get("{arch}.attention.key_length", int, n_embd // head0)
        n_embd_head_v = f.get("{arch}.attention.value_length", int, n_embd // head0)
        n_rot = f.get("{arch}.rope.dimension_count", int, n_embd_head_k)
    else:
        n_embd_head_k = n_embd_head_v = n_rot = 0

    n_embd_k_s = n_embd_v_s = 0
    recurrent_layers: tuple[int, ...] = ()
    attn_layers: tuple[int, ...] = ()
    if hybrid:
        recurrent_layers, attn_layers = _hybrid_layers(f, arch, n_layer, n_head_kv)
    if hybrid and f.has("{arch}.shortconv.l_cache"):
        # LFM2's short convolution: l_cache - 1 columns of the input, no S state
        n_embd_k_s = n_embd * (f.get("{arch}.shortconv.l_cache", int) - 1)
    elif recurrent or hybrid:
        d_conv = f.get("{arch}.ssm.conv_kernel", int)
        d_inner = f.get("{arch}.ssm.inner_size", int)
        d_state = f.get("{arch}.ssm.state_size", int)
        n_group = f.get("{arch}.ssm.group_count", int, 0)
        # the rolling conv state holds d_conv - 1 columns of x (and B, C for grouped SSMs)
        n_embd_k_s = (d_conv - 1 if d_conv > 0 else 0) * (d_inner + 2 * n_group * d_state)
        n_embd_v_s = d_state * d_inner

    swa_type: _SwaType
    if hybrid:
        # LFM2's loader alone reads a window: every attention layer windowed (llama.cpp's
        # llama_memory_hybrid_iswa); the other hybrid loaders read no window key
        n_swa = f.get("{arch}.attention.sliding_window", int, 0) if arch in _HYBRID_SWA_ARCHS else 0
        swa_type = "standard" if n_swa > 0 else "none"
        swa_layers, swa_rope = (attn_layers if n_swa > 0 else ()), None
        n_swa = max(n_swa, 0)
    else:
        n_swa, swa_type, swa_layers, swa_rope = _sliding_window(f, arch, n_layer)
    # llama.cpp's has_cell_ext(): M-RoPE (positions in sections) or per-layer embeddings
    # (ple_n_heads = (ngram_size - 1) * heads_per_ngram gathers per token)
    mrope = any(f.ints("{arch}.rope.dimension_sections"))
    ple = (f.get("{arch}.ple.ngram_size", int, 0) - 1) * f.get("{arch}.ple.heads_per_ngram", int, 0) > 0
    ple_token = None
    if ple:
        ple_token = f.get("{arch}.ple.image_token_id", int, 0) or f.get("{arch}.ple.eos_token_id", int, 0)
    rope = rope_long = None
    # llama.cpp's K-shift skips the layers without RoPE
    no_rope = arch in _ROPE_SWITCHED and not f.get("{arch}.rope.scaling.finetuned", bool, True)
    # M-RoPE keys are never shifted (llama.cpp cannot: get_can_shift() is false for them)
    if not recurrent and head0 > 0 and not mrope and not no_rope:
        rope, rope_long = _rope_params(f, arch, n_rot, n_ctx_train, swa_layers, swa_rope)
    return ModelGeometry(arch=arch, n_layer=n_layer, n_embd=n_embd, n_ctx_train=n_ctx_train,
                         n_head=n_head, n_head_kv=n_head_kv, n_embd_head_k=n_embd_head_k,
                         n_embd_head_v=n_embd_head_v, n_swa=n_swa, swa_type=swa_type,
                         swa_layers=swa_layers, recurrent=recurrent, n_embd_k_s=n_embd_k_s,
                         n_embd_v_s=n_embd_v_s, rope=rope, rope_long=rope_long, cell_ext=mrope or ple,
                         ple_token=ple_token, recurrent_layers=recurrent_layers, attn_layers=attn_layers,
                         rs_rollback=arch in _RS_ROLLBACK_ARCHS)


def _sliding_window(f: _Fields, arch: str, n_layer: int
                    ) -> tuple[int, _SwaType, tuple[int, ...], tuple[float, float] | None]:
    """(n_swa, swa_type, swa layers, (freq_base, freq_scale) of the windowed layers or None)."""
    known = _SWA_ARCHS.get(arch)
    n_swa = f.get("{arch}.attention.sliding_window", int, 0)
    swa_type: _SwaType
    swa_rope: tuple[float, float] | None
    if arch in ("phi3", "phimoe"):
        return 0, "none", (), None   # llama.cpp runs these with full attention
    if known is None:
        # a window is used only where the file also says which layers have it
        if n_swa <= 0 or not f.has("{arch}.attention.sliding_window_pattern"):
            return 0, "none", (), None
        swa_type, period, swa_rope = "standard", 0, None
    else:
        swa_type, period, default_window, swa_rope = known
        if arch == "llama4" and f.has("{arch}.attention.sliding_window") and n_swa == 0:
            return 0, "none", (), None   # a Llama 4 variant without chunked attention
        if arch == "llama4" or not f.has("{arch}.attention.sliding_window"):
            if default_window is None:
                f.get("{arch}.attention.sliding_window", int)   # raises: the key is required
            n_swa = default_window
    pattern = f._r.fields.get(f"{arch}.attention.sliding_window_pattern")
    if pattern is not None:
        types = [int(t) for t in pattern.types]
        if types[0] == _GGUF_ARRAY:
            v = pattern.contents()
            if len(v) != n_layer:
                raise ValueError(f"{f.path}: {arch}.attention.sliding_window_pattern has {len(v)} "
                                 f"entries, expected {n_layer}")
            if len(types) > 1 and types[1] != _GGUF_BOOL and types[1] not in _GGUF_INTS:
                raise ValueError(f"{f.path}: {arch}.attention.sliding_window_pattern is not an array "
                                 f"of bools")
            layers = tuple(il for il, on in enumerate(v) if on)
            return n_swa, swa_type, layers, swa_rope
        period = f.get("{arch}.attention.sliding_window_pattern", int)
    layers = tuple(il for il in range(n_layer) if period == 0 or il % period < period - 1)
    if f.has("{arch}.rope.freq_base_swa"):
        swa_rope = (f.get("{arch}.rope.freq_base_swa", float), 1.0)
    return n_swa, swa_type, layers, swa_rope


def _rope_params(f: _Fields, arch: str, n_rot: int, n_ctx_train: int, swa_layers: tuple[int, ...],
                 swa_rope: tuple[float, float] | None) -> tuple[RopeParams | None, RopeParams | None]:
    """The K-shift's RoPE parameters as llama.cpp's context derives them by default: (params,
    params with the long-context factors or None)."""
    mode: Literal["normal", "neox"]
    if arch in _ROPE_NORMAL:
        mode = "normal"
    elif arch in _ROPE_NEOX:
        mode = "neox"
    elif arch in _ROPE_NONE:
        return None, None
    else:
        raise ValueError(f"{f.path}: unknown architecture {arch!r}: its RoPE layout is not known")
    freq_base = f.get("{arch}.rope.freq_base", float, 10000.0)
    factor = f.get("{arch}.rope.scaling.factor", float, 0.0)
    if factor == 0.0:
        factor = f.get("{arch}.rope.scale_linear", float, 0.0)
    freq_scale = 1.0 if factor == 0.0 else 1.0 / factor
    scaling = f.get("{arch}.rope.scaling.type", str, "linear")
    if scaling not in ("none", "linear", "yarn", "longrope"):
        raise ValueError(f"{f.path}: {arch}.rope.scaling.type = {scaling!r} is not known")
    if scaling == "none":
        freq_scale = 1.0
    n_ctx_orig = f.get("{arch}.rope.scaling.original_context_length", int, n_ctx_train)
    ext_factor = 1.0 if scaling == "yarn" else 0.0
    attn_factor = f.get("{arch}.rope.scaling.attn_factor", float, 1.0)
    if arch == "deepseek2":
        # DeepSeek-V2's graph folds the YaRN magnitude into attn_factor (its K-shift too)
        mscale = 1.0 + 0.1 * math.log(1.0 / freq_scale)
        if mscale <= 0.0:
            raise ValueError(f"{f.path}: {arch}.rope.scaling.factor = {1.0 / freq_scale!r} gives "
                             f"DeepSeek-V2's attention factor no positive value")
        attn_factor = 1.0 / mscale
    layer_base = layer_scale = None
    if swa_rope is not None and swa_layers:
        layer_base = {il: swa_rope[0] for il in swa_layers}
        layer_scale = {il: swa_rope[1] for il in swa_layers}

    def make(factors: npt.NDArray[np.float32] | None) -> RopeParams:
        if factors is not None and factors.shape[0] != n_rot // 2:
            raise ValueError(f"{f.path}: RoPE frequency factors hold {factors.shape[0]} values, "
                             f"expected n_rot / 2 = {n_rot // 2}")
        return RopeParams(n_rot, mode=mode, n_ctx_orig=n_ctx_orig, freq_base=freq_base,
                          freq_scale=freq_scale, ext_factor=ext_factor, attn_factor=attn_factor,
                          freq_factors=factors, layer_freq_base=layer_base, layer_freq_scale=layer_scale)

    factors = f.tensor("rope_freqs.weight")
    if factors is not None:
        return make(factors), None
    short, long = f.tensor("rope_factors_short.weight"), f.tensor("rope_factors_long.weight")
    return make(short), (make(long) if long is not None else None)


def from_gguf(path: Any, n_ctx: int, n_seq_max: int = 1, type_k: Any = "f16", type_v: Any = "f16",
              flash_attn: bool | None = None, swa_full: bool | None = None, n_batch: int = 512,
              buffers: Any = "owned", semantics: str = "2025", kv_unified: bool | None = None,
              n_rs_seq: int = 0) -> AnyCache:
    """The KV cache llama.cpp creates for the model in a GGUF file and this context.

    - ``n_ctx``: context size in tokens (0: the model's training context); the cache gets
      ``pad(n_ctx, n_pad)`` cells, ``n_pad`` being 256 with ``flash_attn`` and 32 without.
    - ``n_seq_max``: parallel sequences; ``n_batch``: the largest ubatch (llama.cpp's
      ``n_ubatch``, default 512: it sizes the SWA cache, see :func:`kvcache.plan.swa_size`).
    - ``type_k`` / ``type_v``: cache types; ``flash_attn``: V is stored transposed without it.
    - ``swa_full``: give the sliding-window cache the full size (with semantics "2025": and never
      prune it).
    - ``buffers``: as for the cache classes ("owned", borrowed per-layer buffers, or None).
    - ``semantics``: "2025" (llama.cpp as of mid-2025, llama-cpp-python 0.3.10; the default) or
      "2026" (today's: n_pad 1, n_ctx padded to 256; ``kv_unified`` False (its default) gives each
      sequence a stream of ``pad(n_ctx // n_seq_max, 256)`` cells, True one stream of all; ``flash_attn`` defaults
      to today's "auto", a V not transposed; ``swa_full`` to True). The 2025 defaults:
      ``flash_attn`` False, ``swa_full`` False, one stream.

    Returns a :class:`kvcache.UnifiedCache` (with the model's K head size and RoPE parameters,
    so ``update()`` rotates shifted keys), a :class:`kvcache.ISWACache` for interleaved
    sliding-window models (Gemma 2/3, Cohere 2, Llama 4), a :class:`kvcache.RecurrentCache`
    (of the semantics asked; f32 states, one cell per sequence) for Mamba, or a :class:`kvcache.HybridCache` for the hybrid
    models (LFM2, Granite 4, Jamba, Falcon-H1, Nemotron-H, Qwen3-Next, PLaMo 2; semantics "2026"
    only), whose recurrent part keeps ``n_rs_seq`` rollback snapshots where llama.cpp allows them
    (LFM2, Nemotron-H; 0 for the others, as llama.cpp sets it). With semantics "2026", the caches of M-RoPE
    and per-layer-embedding models have the per-cell extension (``cell_ext``, ``ple_token``:
    see :class:`ModelGeometry`)."""
    return read_gguf(path).make_cache(n_ctx, n_seq_max=n_seq_max, type_k=type_k, type_v=type_v,
                                      flash_attn=flash_attn, swa_full=swa_full, n_batch=n_batch,
                                      buffers=buffers, semantics=semantics, kv_unified=kv_unified,
                                      n_rs_seq=n_rs_seq)


# --- transformers configs ----------------------------------------------------------------------

# How the modeling code of each transformers architecture (config.model_type) pairs the
# dimensions it rotates: rotate_half on the two halves is llama.cpp's "neox"; interleaved
# pairs (rotate_every_two) are its "normal". Not the GGUF table above: llama.cpp's converter
# permutes Llama's q/k rows so that its files use "normal", while keys computed by transformers
# are always in the layout of the model's own code.
_HF_ROPE_NEOX = frozenset("""
    llama mistral mixtral qwen2 qwen2_moe qwen3 qwen3_moe gemma gemma2 gemma3 gemma3_text phi phi3 gpt_neox
    stablelm falcon olmo olmo2 starcoder2 granite granitemoe persimmon minimax exaone4 smollm3 gpt_oss
    lfm2 lfm2_moe granitemoehybrid bamba falcon_h1 qwen3_next
""".split())
_HF_ROPE_NORMAL = frozenset("gptj codegen cohere cohere2 glm glm4".split())


def _hf_text_config(config: Any) -> Any:
    config = getattr(config, "config", config)          # a model: its config
    get = getattr(config, "get_text_config", None)
    return get(decoder=True) if get is not None else config


_HF_INT_MAX = 2**31 - 1


def _hf_int(cfg: Any, name: str, lo: int, hi: int = _HF_INT_MAX, default: Any = ...) -> int:
    """The integer attribute name of a transformers config, in [lo, hi]; default when it is
    missing or None (ValueError without one). Bools, floats and strings are refused (TypeError),
    not truncated: a config of 2.9 layers is malformed."""
    v = getattr(cfg, name, None)
    if v is None:
        if default is ...:
            raise ValueError(f"the transformers config has no {name}")
        return cast(int, default)
    return int_arg(v, f"config.{name}", lo, hi)


def _hf_real(v: Any, name: str, hi: float = math.inf) -> float:
    """A real-valued config entry (a RoPE factor or base): finite, > 0 and <= hi."""
    if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be a real number, not {type(v).__name__}")
    x = float(v)
    if not (0.0 < x <= hi and math.isfinite(x)):
        raise ValueError(f"{name} = {v!r} must be finite and > 0" + (f", at most {hi}" if hi < math.inf else ""))
    return x


def _hf_heads(cfg: Any) -> tuple[int, int, int, int]:
    """(n_layer, n_head, n_head_kv, head_dim) of a transformers config; the layer count first and
    bounded, as every per-layer table is as long as it."""
    from kvcache.plan import MAX_LAYERS

    n_layer = _hf_int(cfg, "num_hidden_layers", 1, MAX_LAYERS)
    n_head = _hf_int(cfg, "num_attention_heads", 1)
    n_head_kv = _hf_int(cfg, "num_key_value_heads", 1, default=n_head)
    head_dim = _hf_int(cfg, "head_dim", 1, default=0)
    if not head_dim:
        head_dim = _hf_int(cfg, "hidden_size", 1) // n_head
        if not head_dim:
            raise ValueError(f"config.hidden_size < num_attention_heads ({n_head}) and no head_dim: no head size")
    return n_layer, n_head, n_head_kv, head_dim


def _hf_rope_dict(v: Any, name: str) -> dict[str, Any]:
    if not isinstance(v, dict):
        raise TypeError(f"{name} must be a dict of RoPE parameters, not {type(v).__name__}")
    return v


def _hf_layer_rope(cfg: Any, n_rot: int, rp: dict[str, Any], layer_type: str | None,
                   n_ctx_seq: int | None) -> tuple[float, float, npt.NDArray[np.float32] | None]:
    """(freq_base, freq_scale, freq_factors) of one RoPE parameter set of a transformers config."""
    kind = rp.get("rope_type", rp.get("type", "default"))
    if not isinstance(kind, str):
        raise TypeError(f"the config's rope_type must be a str, not {type(kind).__name__}")
    theta = _hf_real(rp.get("rope_theta", getattr(cfg, "rope_theta", None) or 10000.0), "config.rope_theta")
    if kind == "default":
        return theta, 1.0, None
    if kind == "linear":
        if rp.get("factor") is None:
            raise ValueError("rope_type 'linear' without its factor in the config's RoPE parameters")
        return theta, 1.0 / _hf_real(rp["factor"], "the config's linear RoPE factor"), None
    if kind == "dynamic":
        # transformers keeps the plain frequencies while a forward's positions stay within
        # max_position_embeddings and recomputes the base per forward past it: cached keys keep
        # the old base there, and no fixed K-shift matches
        orig = _hf_int(cfg, "max_position_embeddings", 1)
        if n_ctx_seq is not None and n_ctx_seq > orig:
            raise ValueError(f"rope_type 'dynamic' with {n_ctx_seq} cache indices per sequence: past "
                             f"max_position_embeddings ({orig}) the model recomputes its base in every forward "
                             f"and keys already cached keep the old one; no fixed K-shift matches (use n_ctx <= {orig} "
                             f"per sequence)")
        return theta, 1.0, None
    if kind not in ("yarn", "llama3", "longrope"):
        raise ValueError(f"rope_type {kind!r} is not supported")
    # the model's own inverse frequencies, as factors over the plain ones
    import torch  # type: ignore[import-not-found,unused-ignore]
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # type: ignore[import-not-found,import-untyped,unused-ignore]
    seq_len = None
    if kind == "longrope":
        orig = (int_arg(rp["original_max_position_embeddings"], "config original_max_position_embeddings", 1,
                        _HF_INT_MAX) if rp.get("original_max_position_embeddings") is not None
                else _hf_int(cfg, "max_position_embeddings", 1))
        # transformers picks short or long factors per forward; a cache fixes one set: the set
        # of sequences no longer than the original context, else the long one
        seq_len = orig + 1 if n_ctx_seq is not None and n_ctx_seq > orig else orig
    kwargs: dict[str, Any] = {"layer_type": layer_type} if layer_type is not None else {}
    try:
        with torch.no_grad():
            inv_t, _ = ROPE_INIT_FUNCTIONS[kind](cfg, None, seq_len, **kwargs)
    except (KeyError, AttributeError, TypeError, ValueError, ZeroDivisionError, OverflowError) as e:
        # transformers' own reading of the parameters: its error, named as the config's
        raise ValueError(f"rope_type {kind!r}: the config's RoPE parameters are malformed "
                         f"({type(e).__name__}: {e})") from e
    inv = np.asarray(inv_t.double().numpy(), dtype=np.float64)
    if inv.shape[0] != n_rot // 2:
        raise ValueError(f"the rotary embedding has {inv.shape[0]} frequencies, expected n_rot / 2 = {n_rot // 2}")
    plain = theta ** (-np.arange(0, n_rot, 2, dtype=np.float64) / n_rot)
    return theta, 1.0, (plain / inv).astype(np.float32)


def rope_from_transformers(config: Any, n_ctx_seq: int | None = None) -> RopeParams | None:
    """The RoPE K-shift parameters of a transformers config (or model): ``RopeParams`` whose
    rotation by a position delta moves a key the model rotated at position p to p + delta, as
    the model's own rotary embedding would have rotated it. None for models without RoPE.

    The mode is always explicit: "neox" for the rotate_half architectures (Llama, Mistral,
    Qwen, Gemma, Phi, ...), "normal" for the interleaved ones (GPT-J, Cohere, GLM); the default
    mode of ``RopeParams`` ("normal") is llama.cpp's for Llama GGUF files and wrong for keys
    computed by transformers' Llama. rope_type default, linear, yarn, llama3 and longrope are
    mapped (yarn, llama3 and longrope as per-pair frequency factors, exact); attention_scaling
    is not part of a shift (attn_factor 1: the model applied it when it made the key); dynamic
    is the plain rotation within max_position_embeddings and raises ValueError when ``n_ctx_seq``
    exceeds it. longrope: the short factors unless ``n_ctx_seq`` (cache indices per
    sequence) exceeds the original context. Gemma 3's per-layer-type parameters become the
    per-layer base and scale of its sliding layers."""
    model_config = config
    cfg = _hf_text_config(config)
    arch = str(getattr(cfg, "model_type", ""))
    mode: Literal["normal", "neox"]
    if arch in _HF_ROPE_NEOX:
        mode = "neox"
    elif arch in _HF_ROPE_NORMAL:
        mode = "normal"
    else:
        raise ValueError(f"transformers architecture {arch!r}: its RoPE layout is not known here")
    head_dim = _hf_heads(cfg)[3]
    source = "rope_parameters" if getattr(cfg, "rope_parameters", None) else "rope_scaling"
    params = _hf_rope_dict(getattr(cfg, source, None) or {}, f"config.{source}")
    types = _hf_layer_types(cfg) or []
    first = params.get("full_attention", params.get("sliding_attention"))
    nested = isinstance(first, dict)
    if nested:
        for t in ("full_attention", "sliding_attention"):
            if t in params:
                _hf_rope_dict(params[t], f"config.{source}[{t!r}]")
    main: dict[str, Any] = first if isinstance(first, dict) else params
    factor = main.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", None))
    factor = 1.0 if factor is None else _hf_real(factor, "config.partial_rotary_factor", 1.0)
    n_rot = int(head_dim * factor)
    rotary = getattr(getattr(model_config, "model", None), "rotary_emb", None)
    if rotary is not None and hasattr(rotary, "inv_freq"):
        n_rot = 2 * int(rotary.inv_freq.numel())        # what the model computes (Llama ignores the factor)
    base, scale, factors = _hf_layer_rope(cfg, n_rot, main, "full_attention" if nested else None, n_ctx_seq)
    layer_base = layer_scale = None
    if nested and "sliding_attention" in params and "full_attention" in params:
        sb, ss, sf = _hf_layer_rope(cfg, n_rot, params["sliding_attention"], "sliding_attention", n_ctx_seq)
        if sf is not None:
            raise ValueError("per-layer frequency factors are not supported (sliding layers' rope_type)")
        sliding = [il for il, t in enumerate(types) if t == "sliding_attention"]
        layer_base = {il: sb for il in sliding}
        layer_scale = {il: ss for il in sliding}
    orig = main.get("original_max_position_embeddings")
    orig = (_hf_int(cfg, "max_position_embeddings", 0, default=0) if orig is None
            else int_arg(orig, "config original_max_position_embeddings", 0, _HF_INT_MAX))
    return RopeParams(n_rot, mode=mode, n_ctx_orig=orig, freq_base=base, freq_scale=scale, freq_factors=factors,
                      layer_freq_base=layer_base, layer_freq_scale=layer_scale)


def hf_attention(config: Any, chunked_as_sliding: bool = False) -> tuple[int, int, int, int, int, list[str]]:
    """(n_layer, n_head, n_head_kv, head_dim, sliding_window or 0, layer types) of a
    transformers config (or model): the layer types are ``layer_types``, else every layer
    sliding when there is a ``sliding_window`` (Mistral). Types other than "full_attention" and
    "sliding_attention" raise ValueError. With ``chunked_as_sliding``, "chunked_attention"
    layers (Llama 4) are given as "sliding_attention" of a window of ``attention_chunk_size``:
    the positions a chunk's queries can see lie in that window, which is how transformers'
    own caches keep them (its masks then apply the chunks)."""
    cfg = _hf_text_config(config)
    n_layer, n_head, n_head_kv, head_dim = _hf_heads(cfg)
    window = _hf_int(cfg, "sliding_window", 0, default=0)
    types = _hf_layer_types(cfg) or ["sliding_attention" if window else "full_attention"] * n_layer
    if chunked_as_sliding and "chunked_attention" in types:
        if "sliding_attention" in types:
            raise ValueError("the config has both sliding and chunked layers: one window size maps to a kvcache cache")
        window = _hf_int(cfg, "attention_chunk_size", 0, default=0)
        if not window:
            raise ValueError("the config has chunked layers but no attention_chunk_size")
        types = ["sliding_attention" if t == "chunked_attention" else t for t in types]
    if len(types) != n_layer or set(types) - {"full_attention", "sliding_attention"}:
        raise ValueError(f"layer_types {sorted(set(types))} ({len(types)} for {n_layer} layers): only full and "
                         f"sliding attention map to a kvcache cache")
    if "sliding_attention" in types and not window:
        raise ValueError("the config has sliding layers but no sliding_window")
    return n_layer, n_head, n_head_kv, head_dim, window if "sliding_attention" in types else 0, types


def _hf_layer_types(cfg: Any) -> list[str] | None:
    """config.layer_types as a list of str, None when absent."""
    v = getattr(cfg, "layer_types", None)
    if v is None or (isinstance(v, (list, tuple)) and not v):
        return None
    if not isinstance(v, (list, tuple)) or not all(isinstance(t, str) for t in v):
        raise TypeError(f"config.layer_types must be a list of str, not {type(v).__name__}"
                        f"{'' if not isinstance(v, (list, tuple)) else ' holding other values'}")
    return list(v)


# The hybrid architectures of transformers (config.model_type) and llama.cpp's name of each, as
# its converter writes them.
_HF_HYBRID = {"lfm2": "lfm2", "lfm2_moe": "lfm2moe", "granitemoehybrid": "granitehybrid", "jamba": "jamba",
              "falcon_h1": "falcon-h1", "nemotron_h": "nemotron_h", "qwen3_next": "qwen3next",
              # Bamba: llama.cpp's converter writes it as granitehybrid (Granite 4's Mamba-2 layers
              # and attention, RoPE on)
              "bamba": "granitehybrid"}
# Hybrid architectures of transformers that llama.cpp does not have (its converter maps none)
_HF_HYBRID_UNSUPPORTED = {"zamba": "Zamba", "zamba2": "Zamba2"}


def _hf_hybrid(config: Any, cfg: Any, arch: str, n_ctx_seq: int | None) -> ModelGeometry:
    """read_transformers_config of a hybrid model: the layers and row widths llama.cpp's
    converter and loader give the same model (llama_memory_hybrid's geometry)."""
    n_layer, n_head, n_head_kv, head_dim = _hf_heads(cfg)
    n_embd = _hf_int(cfg, "hidden_size", 1)
    # transformers names a layer by its mixer; older names ("mamba", "attention") are today's
    # "linear_attention" and "full_attention"
    legacy = {"mamba": "linear_attention", "attention": "full_attention"}
    if arch == "jamba":
        period = _hf_int(cfg, "attn_layer_period", 1)
        offset = _hf_int(cfg, "attn_layer_offset", 0, period - 1)
        types = ["full_attention" if il % period == offset else "linear_attention" for il in range(n_layer)]
    elif arch == "falcon_h1":
        types = ["both"] * n_layer          # a Mamba-2 mixer and attention in every layer
    else:
        types = [legacy.get(t, t) for t in (_hf_layer_types(cfg) or [])]
    if len(types) != n_layer:
        raise ValueError(f"{arch}: {len(types)} layer types for {n_layer} layers")
    recurrent_kind = "conv" if arch in ("lfm2", "lfm2_moe") else "linear_attention"
    recr = tuple(il for il, t in enumerate(types) if t in (recurrent_kind, "both"))
    attn = tuple(il for il, t in enumerate(types) if t in ("full_attention", "both"))
    other = sorted({t for t in types if t not in (recurrent_kind, "full_attention", "both")})
    # Nemotron-H's feed-forward layers have neither K/V nor a state
    if other and not (arch == "nemotron_h" and set(other) <= {"mlp", "moe"}):
        raise ValueError(f"{arch}: layer types {other} map to no part of a hybrid memory")
    if arch in ("lfm2", "lfm2_moe"):
        # the short convolution keeps L_cache - 1 columns of its input
        n_embd_r, n_embd_s = n_embd * (_hf_int(cfg, "conv_L_cache", 1) - 1), 0
    elif arch == "qwen3_next":
        # the gated delta net: a convolution over q, k and v; a k x v state per value head
        k_dim, v_dim = _hf_int(cfg, "linear_key_head_dim", 1), _hf_int(cfg, "linear_value_head_dim", 1)
        n_k, n_v = _hf_int(cfg, "linear_num_key_heads", 1), _hf_int(cfg, "linear_num_value_heads", 1)
        n_embd_r = (_hf_int(cfg, "linear_conv_kernel_dim", 1) - 1) * (2 * n_k * k_dim + n_v * v_dim)
        n_embd_s = k_dim * v_dim * n_v
    else:
        # Mamba (Jamba: one group-less B and C) and Mamba-2: the convolution's d_conv - 1
        # columns of x, B and C; a d_state x d_inner state
        if arch == "nemotron_h":
            d_inner = _hf_int(cfg, "mamba_num_heads", 1) * _hf_int(cfg, "mamba_head_dim", 1)
            d_state, d_conv = _hf_int(cfg, "ssm_state_size", 1), _hf_int(cfg, "conv_kernel", 1)
            n_group = _hf_int(cfg, "n_groups", 1)
        else:
            d_inner = _hf_int(cfg, "mamba_d_ssm", 0, default=0) or _hf_int(cfg, "mamba_expand", 1) * n_embd
            d_state, d_conv = _hf_int(cfg, "mamba_d_state", 1), _hf_int(cfg, "mamba_d_conv", 1)
            n_group = 0 if arch == "jamba" else _hf_int(cfg, "mamba_n_groups", 1)
        n_embd_r = (d_conv - 1) * (d_inner + 2 * n_group * d_state)
        n_embd_s = d_state * d_inner
    uses_rope = arch not in ("jamba", "nemotron_h") and (
        arch != "granitemoehybrid" or getattr(cfg, "position_embedding_type", None) == "rope")
    heads_kv = tuple(n_head_kv if il in attn else 0 for il in range(n_layer))
    # llama.cpp's converter names Nemotron-H with experts nemotron_h_moe
    name = "nemotron_h_moe" if arch == "nemotron_h" and "moe" in types else _HF_HYBRID[arch]
    # the converter writes a window for LFM2.5's audio tokenizer only (Lfm25AudioTokenizer), and
    # LFM2's loader then windows every attention layer: llama_memory_hybrid_iswa
    window = _hf_int(cfg, "sliding_window", 0, default=0)
    if not (arch == "lfm2" and "Lfm25AudioTokenizer" in (getattr(cfg, "architectures", None) or [])):
        window = 0
    return ModelGeometry(
        arch=name, n_layer=n_layer, n_embd=n_embd,
        n_ctx_train=_hf_int(cfg, "max_position_embeddings", 0, default=0), n_head=(n_head,) * n_layer,
        n_head_kv=heads_kv, n_embd_head_k=head_dim, n_embd_head_v=head_dim, n_embd_k_s=n_embd_r,
        n_embd_v_s=n_embd_s, rope=rope_from_transformers(config, n_ctx_seq) if uses_rope else None,
        recurrent_layers=recr, attn_layers=attn, rs_rollback=name in _RS_ROLLBACK_ARCHS, n_swa=window,
        swa_type="standard" if window else "none", swa_layers=attn if window else ())


def read_transformers_config(config: Any, n_ctx_seq: int | None = None) -> ModelGeometry:
    """The cache geometry of a transformers ``PretrainedConfig`` (or a model): layers, KV heads,
    head size, sliding-window layers (``layer_types``; every layer when there is a
    ``sliding_window`` and no ``layer_types``, as Mistral) and :func:`rope_from_transformers`.
    Layer types other than full and sliding attention raise ValueError, except in the hybrid
    models (LFM2, Granite 4, Bamba, Jamba, Falcon-H1, Nemotron-H, Qwen3-Next), whose geometry is
    llama.cpp's for the same model (ValueError for Zamba and Zamba2, which llama.cpp lacks): attention and recurrent layers, the recurrent R / S widths
    (``n_embd_k_s`` / ``n_embd_v_s``), the architecture under llama.cpp's name."""
    cfg = _hf_text_config(config)
    arch = str(getattr(cfg, "model_type", ""))
    if arch in _HF_HYBRID_UNSUPPORTED:
        raise ValueError(f"transformers architecture {arch!r}: llama.cpp (llama-cpp-python 0.3.36) has no "
                         f"{_HF_HYBRID_UNSUPPORTED[arch]} model (its converter maps none), so there is no llama.cpp "
                         f"memory for kvcache to reproduce")
    if arch in _HF_HYBRID:
        return _hf_hybrid(config, cfg, arch, n_ctx_seq)
    n_layer, n_head, n_head_kv, head_dim, window, types = hf_attention(cfg)
    swa_layers = tuple(il for il, t in enumerate(types) if t == "sliding_attention")
    return ModelGeometry(
        arch=str(getattr(cfg, "model_type", "")), n_layer=n_layer, n_embd=_hf_int(cfg, "hidden_size", 1),
        n_ctx_train=_hf_int(cfg, "max_position_embeddings", 0, default=0), n_head=(n_head,) * n_layer,
        n_head_kv=(n_head_kv,) * n_layer, n_embd_head_k=head_dim, n_embd_head_v=head_dim,
        n_swa=window, swa_type="standard" if swa_layers else "none", swa_layers=swa_layers,
        rope=rope_from_transformers(config, n_ctx_seq))


def from_transformers_config(config: Any, n_ctx: int, n_seq_max: int = 1, type_k: Any = "f16", type_v: Any = "f16",
                             v_trans: bool = False, swa_full: bool | None = None, n_batch: int = 512,
                             buffers: Any = "owned", n_rs_seq: int = 0) -> AnyCache:
    """A KV cache for a transformers model: a :class:`UnifiedCache`, or an :class:`ISWACache`
    when it has sliding-window layers (the window is transformers' ``sliding_window``, the same
    rule: a key is hidden once the query is ``sliding_window`` positions past it), with the
    model's head size and RoPE parameters (:func:`rope_from_transformers`) so ``update()``
    shifts keys as the model rotates them. ``n_ctx`` cells over all sequences (padded to 32);
    ``v_trans`` False by default: V as torch reads it, without a transpose per layer. The other
    arguments as :func:`from_gguf`'s (``swa_full`` None: the default of the cache's semantics, False
    for an ISWACache, True for a hybrid memory).

    A hybrid model (LFM2, Granite 4, Jamba, Falcon-H1, Nemotron-H, Qwen3-Next) gets the
    :class:`HybridCache` ``from_gguf(..., semantics="2026", kv_unified=True)`` builds for its
    GGUF file: one stream of ``pad(n_ctx, 256)`` cells for the attention layers, a recurrent cell
    per sequence with ``n_rs_seq`` rollback snapshots where llama.cpp allows them (LFM2,
    Nemotron-H); with a sliding window (LFM2.5's audio tokenizer, ``Lfm25AudioTokenizer``, the one
    LFM2 whose converter writes it) its attention part is an iSWA pair of ``n_batch`` and
    ``swa_full`` (None: True, today's default, as ``from_gguf(..., semantics="2026")`` gives it),
    llama.cpp's ``llama_memory_hybrid_iswa``. Bamba (``BambaForCausalLM``) is
    converted to llama.cpp's granitehybrid and gets its memory; Zamba2 raises ValueError: llama.cpp
    has no Zamba2 architecture."""
    n_ctx = int_arg(n_ctx, "n_ctx", 1, 2**31 - 1)
    n_seq_max = int_arg(n_seq_max, "n_seq_max", 1, 2**31 - 1)
    n_rs_seq = int_arg(n_rs_seq, "n_rs_seq", 0, 64)
    geo = read_transformers_config(config, n_ctx_seq=max(n_ctx // n_seq_max, 1))
    if n_rs_seq and not geo.hybrid:
        raise ValueError(f"n_rs_seq = {n_rs_seq}: rollback snapshots apply to hybrid models; {geo.arch!r} is not one")
    if geo.hybrid:
        return geo.make_cache(n_ctx, n_seq_max=n_seq_max, type_k=type_k, type_v=type_v, buffers=buffers,
                              v_trans=v_trans, semantics="2026", kv_unified=True, n_rs_seq=n_rs_seq,
                              swa_full=swa_full, n_batch=n_batch)
    return geo.make_cache(n_ctx, n_seq_max=n_seq_max, type_k=type_k, type_v=type_v, swa_full=swa_full,
                          n_batch=n_batch, buffers=buffers, v_trans=v_trans)
