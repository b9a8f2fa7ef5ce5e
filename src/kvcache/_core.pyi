"""Type stubs of kvcache._core, the compiled bridge over the C core (see the .pxi sources)."""
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from inspect import Signature
from typing import Any, ClassVar, Literal, NamedTuple, Protocol, TypedDict, TypeVar, final, overload

import numpy as np
import numpy.typing as npt
from typing_extensions import Buffer, NotRequired, Self, TypeAlias

# --- argument types ------------------------------------------------------------------------

# A ggml type: its name ("f16", "q8_0", ...) or its ggml id.
_GGMLType: TypeAlias = str | int
# One int for every layer, or one per model layer.
_PerLayer: TypeAlias = int | Sequence[int]
# Integer arrays given as lists or numpy arrays.
_IntArray: TypeAlias = Sequence[int] | npt.NDArray[np.integer[Any]]
# The sequence ids of a token (or token group): one id or several.
_SeqIds: TypeAlias = int | Sequence[int]
_SeqIdArg: TypeAlias = Sequence[_SeqIds] | npt.NDArray[np.integer[Any]]
_Flags: TypeAlias = Sequence[bool] | Sequence[int] | npt.NDArray[np.bool_] | npt.NDArray[np.integer[Any]]
# A borrowed K or V buffer: a numpy array, a buffer-protocol object or a CPU tensor with
# __dlpack__; checked when the cache is built.
_HostMemory: TypeAlias = object
# Who holds a cache's K/V memory: the cache, nobody (metadata only), or the caller's (K, V)
# pairs by model layer (a dict) or in layer order (a list).
_Buffers: TypeAlias = (
    Literal["owned", "none"] | None | Mapping[int, tuple[_HostMemory, _HostMemory]]
    | Sequence[tuple[_HostMemory, _HostMemory]]
)
_BufferMode: TypeAlias = Literal["owned", "borrowed", "none"]
_SwaType: TypeAlias = Literal["none", "standard", "chunked"]
_MaskDType: TypeAlias = Literal["f32", "f16", "bool"]
# kq_mask's options: a caller's output array of the mask's dtype; rows padded (None: the
# semantics' default)
_MaskScalar = TypeVar("_MaskScalar", bound=np.generic)
_Out: TypeAlias = npt.NDArray[_MaskScalar] | None
_Pad: TypeAlias = bool | None
_SplitMode: TypeAlias = Literal["simple", "equal", "seq"]
# a placement: per token group, its stream and the cells of its tokens
_SlotInfo: TypeAlias = list[tuple[int, npt.NDArray[np.int32]]]

class _BinaryWriter(Protocol):
    """A binary file object: write() takes bytes and says how many it took."""

    def write(self, b: memoryview, /) -> int | None: ...

# --- what the caches share ---------------------------------------------------------------------
# Structural types: every class named below has these members at runtime, with these signatures
# (stubtest holds each cache's own methods to the declarations here, found through the bases).

class _StateIO(Protocol):
    """A cache's state in llama.cpp's layouts (UnifiedCache, RecurrentCache and ISWACache)."""

    def state_size(self, seq_id: int = -1, *, layout: str = "2026", prefix: bool | None = None) -> int: ...
    def state_write(self, seq_id: int = -1, *, layout: str = "2026", prefix: bool | None = None) -> bytes: ...
    def state_write_into(
        self, buf: Buffer | _BinaryWriter, seq_id: int = -1, *, layout: str = "2026", prefix: bool | None = None
    ) -> int: ...
    def state_read(
        self, data: Buffer, seq_id: int = -1, *, convert: bool = False, exact: bool = False, layout: str | None = None
    ) -> int: ...

class _CacheCore(_StateIO, Protocol):
    """The cell table of one cache (the unified of either semantics and the recurrent):
    counters, placement, the sequence operations, the K/V memory and the state."""

    @property
    def size(self) -> int: ...
    @property
    def head(self) -> int: ...
    @property
    def n(self) -> int: ...
    @property
    def used(self) -> int: ...
    @property
    def n_seq_max(self) -> int: ...
    @property
    def n_layer(self) -> int: ...
    @property
    def type_k(self) -> str: ...
    @property
    def type_v(self) -> str: ...
    @property
    def buffers(self) -> _BufferMode: ...
    @property
    def size_k_bytes(self) -> int: ...
    @property
    def size_v_bytes(self) -> int: ...
    @property
    def total_size(self) -> int: ...
    # slots and sequences
    def find_slot(self, ub: UBatch) -> bool: ...
    def place_seqs(self, pos: int, n_tokens: int = 1, n_seqs: int = 1) -> int | None: ...
    def clear(self) -> None: ...
    def seq_rm(self, seq_id: int, p0: int = -1, p1: int = -1) -> bool: ...
    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None: ...
    def seq_keep(self, seq_id: int) -> None: ...
    def seq_add(self, seq_id: int, p0: int, p1: int, shift: int) -> None: ...
    def seq_div(self, seq_id: int, p0: int, p1: int, d: int) -> None: ...
    def seq_pos_min(self, seq_id: int) -> int: ...
    def seq_pos_max(self, seq_id: int) -> int: ...
    # K/V data
    def k(self, il: int) -> npt.NDArray[Any]: ...
    def v(self, il: int) -> npt.NDArray[Any]: ...

# --- errors and the type table -------------------------------------------------------------

class StateError(ValueError):
    """A state blob is malformed, truncated or does not fit this cache."""

class GGMLType(NamedTuple):
    """A ggml tensor type: id, name, elements per block, bytes per block."""

    id: int
    name: str
    blck_size: int
    type_size: int

def ggml_types() -> tuple[GGMLType, ...]: ...

# --- the argument layer (shared by the bridge and the Python modules) ------------------------------

MAX_SEQ: int

def int_arg(v: object, name: str, lo: int | None = None, hi: int | None = None) -> int: ...
def bool_arg(v: object, name: str) -> bool: ...
def n_seq_max_arg(v: object) -> int: ...
def seq_arg(v: object, n_seq_max: int, name: str = "seq_id", allow_any: bool = False) -> int: ...
def type_arg(t: object, name: str = "type") -> GGMLType: ...
def widths_arg(v: object, n_layer: int, name: str, hi: int = 0x7FFFFFFF) -> tuple[int, ...]: ...
def layers_arg(
    layers: Iterable[int] | Callable[[int], bool] | None, n_layer: int, name: str = "layers", any_order: bool = False
) -> tuple[int, ...]: ...

class _LockState(TypedDict):
    mine: bool
    waiting: int
    busy: int

def _lock_state(obj: object) -> _LockState: ...
def ggml_type(t: _GGMLType) -> GGMLType: ...
def ggml_row_size(t: _GGMLType, n: int) -> int: ...
def ggml_type_name(type_id: int) -> str | None: ...
def view_dtype(type: _GGMLType) -> np.dtype[Any]: ...

# --- ubatches and batches --------------------------------------------------------------------

class UBatch:
    """A ubatch: the tokens placed into a cache in one step."""

    # the constructor's parameters (kvcache._signatures)
    __signature__: ClassVar[Signature]
    @property
    def output(self) -> npt.NDArray[np.bool_] | None: ...
    @property
    def max_seq(self) -> int: ...
    def __new__(
        cls,
        pos: _IntArray,
        seq_id: _SeqIdArg,
        n_seq_tokens: int = 1,
        output: _Flags | None = None,
        *,
        tokens: _IntArray | None = None,
        pos_x: _IntArray | None = None,
        pos_y: _IntArray | None = None,
    ) -> Self: ...
    @property
    def tokens(self) -> npt.NDArray[np.int32] | None: ...
    @property
    def pos_x(self) -> npt.NDArray[np.int32] | None: ...
    @property
    def pos_y(self) -> npt.NDArray[np.int32] | None: ...
    @property
    def n_tokens(self) -> int: ...
    @property
    def n_seq_tokens(self) -> int: ...
    @property
    def n_seqs(self) -> int: ...
    @property
    def pos(self) -> npt.NDArray[np.int32]: ...
    @property
    def seq_id(self) -> list[list[int]]: ...
    def __len__(self) -> int: ...

class SplitUBatch(UBatch):
    """A UBatch produced by Batch: ids[i] is the batch index of its i-th token."""

    @property
    def ids(self) -> npt.NDArray[np.int64]: ...
    @property
    def equal_seqs(self) -> bool: ...

class Batch:
    """A batch of tokens cut into ubatches the way llama.cpp's decoder does."""

    # the constructor's parameters (kvcache._signatures)
    __signature__: ClassVar[Signature]
    def __new__(
        cls,
        pos: _IntArray,
        seq_id: _SeqIdArg,
        output: _Flags | None = None,
        logits_all: bool = False,
        simple_split: bool = True,
        *,
        tokens: _IntArray | None = None,
        pos_x: _IntArray | None = None,
        pos_y: _IntArray | None = None,
    ) -> Self: ...
    @property
    def n_tokens(self) -> int: ...
    @property
    def n_tokens_left(self) -> int: ...
    @property
    def simple_split(self) -> bool: ...
    @property
    def logits_all(self) -> bool: ...
    @property
    def out_ids(self) -> npt.NDArray[np.int64]: ...
    def __len__(self) -> int: ...
    def split_simple(self, n_ubatch: int) -> SplitUBatch | None: ...
    def split_equal(self, n_ubatch: int) -> SplitUBatch | None: ...
    def split_seq(self, n_ubatch: int) -> SplitUBatch | None: ...
    def ubatches(self, n_ubatch: int, mode: _SplitMode | None = None) -> Iterator[SplitUBatch]: ...

# --- the unified cache -------------------------------------------------------------------------

class Cells:
    """A snapshot of a cache's cells: pos, shift and seq_mask ([size, n_words]) per cell."""

    pos: npt.NDArray[np.int32]
    shift: npt.NDArray[np.int32]
    seq_mask: npt.NDArray[np.uint64]
    ext: npt.NDArray[np.int32] | None
    __hash__: ClassVar[None]  # type: ignore[assignment]
    # the constructor's parameters (kvcache._signatures)
    __signature__: ClassVar[Signature]
    def __init__(
        self,
        pos: npt.NDArray[np.int32],
        shift: npt.NDArray[np.int32],
        seq_mask: npt.NDArray[np.uint64],
        ext: npt.NDArray[np.int32] | None = None,
    ) -> None: ...
    def __len__(self) -> int: ...
    def __eq__(self, other: object) -> bool: ...
    def seq_ids(self, i: int) -> list[int]: ...
    def holds(self, seq_id: int) -> npt.NDArray[np.bool_]: ...
    def nonempty(self) -> list[list[int | list[int]]]: ...

class UpdatePlan:
    """What update() did, and what the owner of the K/V memory still has to do."""

    k_shift: npt.NDArray[np.int32] | None
    rotated: bool
    defrag_runs: npt.NDArray[np.uint32] | None
    moved: bool
    need_reserve: bool
    # the constructor's parameters (kvcache._signatures)
    __signature__: ClassVar[Signature]
    def __init__(
        self,
        k_shift: npt.NDArray[np.int32] | None = None,
        rotated: bool = False,
        defrag_runs: npt.NDArray[np.uint32] | None = None,
        moved: bool = False,
        need_reserve: bool = False,
    ) -> None: ...
    def __bool__(self) -> bool: ...

class StreamUpdate(UpdatePlan):
    """What update() of a cache of semantics '2026' did."""

    status: int
    had_shift: bool
    copies: int
    has_shift: bool
    shift: npt.NDArray[np.int32]
    # the constructor's parameters (kvcache._signatures)
    __signature__: ClassVar[Signature]
    def __init__(
        self,
        status: int,
        had_shift: bool,
        copies: int,
        has_shift: bool,
        shift: npt.NDArray[np.int32],
        rotated: bool = False,
    ) -> None: ...

class UnifiedCore:
    """The unified KV cache's cimport interface (C-level methods only; see _core.pxd)."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Self: ...

# what a placement undone until commit has (the unified cache of semantics "2025", the recurrent)
class _Commits(Protocol):
    def commit(self) -> None: ...
    def restore(self) -> None: ...
    def set_full(self) -> None: ...
    def defrag_sched(self, thold: float) -> None: ...

class _Unified(UnifiedCore, _CacheCore):
    """What the unified caches of both semantics share (kvcache.UnifiedCache is the documented
    public class)."""

    # the constructor's parameters (kvcache._signatures)
    __signature__: ClassVar[Signature]
    def __new__(
        cls,
        kv_size: int,
        n_layer: int,
        n_embd_k_gqa: _PerLayer,
        n_embd_v_gqa: _PerLayer,
        type_k: _GGMLType = "f16",
        type_v: _GGMLType = "f16",
        v_trans: bool = True,
        n_seq_max: int = 1,
        n_pad: int = 32,
        n_swa: int = 0,
        swa_type: _SwaType = "none",
        layers: Sequence[int] | Callable[[int], bool] | None = None,
        buffers: _Buffers = "owned",
        n_embd_head_k: _PerLayer | None = None,
        rope: RopeParams | None = None,
        semantics: str | None = None,
        kv_unified: bool = True,
        cell_ext: bool = False,
        ple_token: int | None = None,
    ) -> Self: ...

    # geometry and counters
    @property
    def semantics(self) -> str: ...
    @property
    def kv_unified(self) -> bool: ...
    @property
    def cell_ext(self) -> bool: ...
    @property
    def ple_token(self) -> int | None: ...
    @property
    def n_stream(self) -> int: ...
    @property
    def heads(self) -> tuple[int, ...]: ...
    @property
    def used_per_stream(self) -> tuple[int, ...]: ...
    @property
    def used_max_p1_per_stream(self) -> tuple[int, ...]: ...
    @property
    def n_kv_per_stream(self) -> tuple[int, ...]: ...
    @property
    def layers(self) -> tuple[int, ...]: ...
    @property
    def v_trans(self) -> bool: ...
    @property
    def n_pad(self) -> int: ...
    @property
    def n_swa(self) -> int: ...
    @property
    def swa_type(self) -> _SwaType: ...
    @property
    def n_embd_head_k(self) -> tuple[int, ...] | None: ...
    @property
    def rope(self) -> RopeParams | None: ...
    @overload
    def slot_indices(self, out: None = None) -> npt.NDArray[np.int32]: ...
    @overload
    def slot_indices(self, out: Any) -> Any: ...
    def seq_cells(self, seq_id: int) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.int32]]: ...
    @property
    def has_shift(self) -> bool: ...
    @property
    def fragmentation(self) -> float: ...
    @property
    def n_threads(self) -> int: ...
    @n_threads.setter
    def n_threads(self, value: int) -> None: ...
    # K/V data
    def store(self, il: int, k_rows: npt.NDArray[Any] | None, v_rows: npt.NDArray[Any] | None) -> None: ...
    def pos_bucket(self, ub: UBatch, n_buckets: int) -> npt.NDArray[np.int32]: ...
    def k_shift(self) -> npt.NDArray[np.int32]: ...
    def reset_shift(self) -> None: ...
    # what each semantics' class defines its own way (the mask's shape, where find_slot puts the
    # tokens, what update does)
    def slot_info(self) -> _SlotInfo: ...
    # the mask's dtype follows `dtype` (or a numpy `out`); any other buffer, such as a CPU
    # tensor, is given back as it came
    @overload
    def kq_mask(self, ub: UBatch, causal: bool = True, alibi: bool = False, out: _Out[np.float32] = None,
                dtype: Literal["f32"] = "f32", pad: _Pad = None, reuse: bool = False) -> npt.NDArray[np.float32]: ...
    @overload
    def kq_mask(self, ub: UBatch, causal: bool = True, alibi: bool = False, out: _Out[np.float16] = None, *,
                dtype: Literal["f16"], pad: _Pad = None, reuse: bool = False) -> npt.NDArray[np.float16]: ...
    @overload
    def kq_mask(self, ub: UBatch, causal: bool = True, alibi: bool = False, out: _Out[np.bool_] = None, *,
                dtype: Literal["bool"], pad: _Pad = None, reuse: bool = False) -> npt.NDArray[np.bool_]: ...
    @overload
    def kq_mask(self, ub: UBatch, causal: bool = True, alibi: bool = False, out: Any = None,
                dtype: _MaskDType = "f32", pad: _Pad = None, reuse: bool = False) -> Any: ...
    def update(self, rope: RopeParams | None = None, n_max_nodes: int = 65536) -> UpdatePlan: ...
    def _check_update(self, rope: RopeParams | None, n_max_nodes: int) -> None: ...
    # inspection
    def cells(self) -> Cells: ...
    def stream_cells(self) -> tuple[Cells, ...]: ...

class _Unified2025(_Unified, _Commits):
    """The unified cache of llama.cpp as of mid-2025 (kvcache.UnifiedCache2025)."""

    # the constructor's parameters are _Unified's (semantics None: this class's)
    __signature__: ClassVar[Signature]
    def __new__(cls, *args: Any, semantics: Literal["2025"] | None = None, **kwargs: Any) -> Self: ...
    @property
    def slot(self) -> tuple[int, int] | None: ...
    def slot_info(self) -> _SlotInfo: ...
    def prune_swa(self, seq_id: int, pmin: int, pmax: int) -> bool: ...
    # defragmentation and update
    @property
    def do_defrag(self) -> bool: ...
    @property
    def defrag_ids(self) -> npt.NDArray[np.uint32]: ...
    def defrag_prepare(self, n_max_nodes: int) -> bool: ...
    def defrag_runs(self) -> npt.NDArray[np.uint32]: ...
    def defrag_move(self) -> None: ...
    def update(self, rope: RopeParams | None = None, n_max_nodes: int = 65536) -> UpdatePlan: ...

class _Unified2026(_Unified):
    """The unified cache of today's llama.cpp (kvcache.UnifiedCache2026)."""

    # the constructor's parameters are _Unified's (semantics None: this class's)
    __signature__: ClassVar[Signature]
    def __new__(cls, *args: Any, semantics: Literal["2026"] | None = None, **kwargs: Any) -> Self: ...
    def slot_info(self) -> _SlotInfo: ...
    def prepare(self, ubatches: Iterable[UBatch]) -> list[_SlotInfo] | None: ...
    @property
    def pending_copies(self) -> int: ...
    def update(self, rope: RopeParams | None = None, n_max_nodes: int = 65536) -> StreamUpdate: ...

# --- the recurrent cache ------------------------------------------------------------------------

class _RecurrentCells(TypedDict):
    pos: npt.NDArray[np.int32]
    src: npt.NDArray[np.int32]
    tail: npt.NDArray[np.int32]
    seq_id: list[list[int]]

class RecurrentCore:
    """The recurrent cache's cimport interface (C-level methods only; see _core.pxd)."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Self: ...

class _Recurrent(RecurrentCore, _CacheCore, _Commits):
    """The recurrent-state cache of Mamba / RWKV style models."""

    # the constructor's parameters (kvcache._signatures)
    __signature__: ClassVar[Signature]
    def __new__(
        cls,
        n_seq_max: int,
        n_layer: int,
        n_embd_k_gqa: _PerLayer,
        n_embd_v_gqa: _PerLayer,
        type_k: _GGMLType = "f32",
        type_v: _GGMLType = "f32",
        kv_size: int | None = None,
        n_embd_k_s: _PerLayer = 0,
        n_embd_v_s: _PerLayer = 0,
        buffers: _Buffers = "owned",
    ) -> Self: ...
    @property
    def can_shift(self) -> bool: ...
    @property
    def n_embd_k(self) -> list[int]: ...
    @property
    def n_embd_v(self) -> list[int]: ...
    @property
    def warnings(self) -> list[str]: ...
    def store(
        self, il: int, k_rows: npt.ArrayLike | None = None, v_rows: npt.ArrayLike | None = None
    ) -> None: ...
    def update(self) -> bool: ...
    def s_copy(self) -> npt.NDArray[np.int32]: ...
    def s_mask(self) -> npt.NDArray[np.float32]: ...
    def cell_max(self) -> int: ...
    def cells(self) -> _RecurrentCells: ...

# --- RoPE and (de)quantization ------------------------------------------------------------------

# Per-layer overrides: {model layer: value}, or a list indexed by layer (None: the default).
_LayerValues: TypeAlias = Mapping[int, float | None] | Sequence[float | None]

class RopeParams:
    """The parameters of a RoPE K-shift, as ggml's extended RoPE takes them."""

    # the constructor's parameters (kvcache._signatures)
    __signature__: ClassVar[Signature]
    def __new__(
        cls,
        n_rot: int,
        mode: int | Literal["normal", "neox"] = 0,
        n_ctx_orig: int = 0,
        freq_base: float = 10000.0,
        freq_scale: float = 1.0,
        ext_factor: float = 0.0,
        attn_factor: float = 1.0,
        beta_fast: float = 32.0,
        beta_slow: float = 1.0,
        freq_factors: npt.ArrayLike | None = None,
        layer_freq_base: _LayerValues | None = None,
        layer_freq_scale: _LayerValues | None = None,
    ) -> Self: ...
    def freq_base_for(self, layer: int | None = None) -> float: ...
    def freq_scale_for(self, layer: int | None = None) -> float: ...
    def angles(
        self, pos: int, layer: int | None = None
    ) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.float32]]: ...
    def corr_dims(self, layer: int | None = None) -> tuple[float, float]: ...
    @property
    def n_rot(self) -> int: ...
    @property
    def mode(self) -> int: ...
    @property
    def n_ctx_orig(self) -> int: ...
    @property
    def freq_base(self) -> float: ...
    @property
    def freq_scale(self) -> float: ...
    @property
    def ext_factor(self) -> float: ...
    @property
    def attn_factor(self) -> float: ...
    @property
    def beta_fast(self) -> float: ...
    @property
    def beta_slow(self) -> float: ...
    @property
    def freq_factors(self) -> npt.NDArray[np.float32] | None: ...
    @property
    def layer_freq_base(self) -> dict[int, float] | None: ...
    @property
    def layer_freq_scale(self) -> dict[int, float] | None: ...

def rope_shift(
    k: npt.NDArray[Any],
    type_k: _GGMLType,
    n_head: int,
    head_dim: int,
    shift: _IntArray,
    params: RopeParams,
    layer: int | None = None,
) -> None: ...
def quantize(x: npt.ArrayLike, type: _GGMLType) -> npt.NDArray[np.uint8]: ...
def dequantize(raw: npt.NDArray[Any] | bytes | bytearray | memoryview, type: _GGMLType, n: int) -> npt.NDArray[np.float32]: ...

# --- K/V memory ----------------------------------------------------------------------------------

class BFloat16View(np.ndarray[Any, np.dtype[Any]]):
    """A bfloat16 array that exports itself through DLPack as bfloat16."""

    def __dlpack__(
        self,
        *,
        stream: int | Any | None = None,
        max_version: tuple[int, int] | None = None,
        dl_device: tuple[int, int] | None = None,
        copy: bool | None = None,
    ) -> Any: ...
    def __dlpack_device__(self) -> tuple[Literal[1], Literal[0]]: ...

# --- states --------------------------------------------------------------------------------------

class _LayerDescription(TypedDict, total=False):
    k_type: int
    k_row_size: int
    k_offset: int
    k_bytes: int
    v_type: int
    v_offset: int
    v_bytes: int
    v_row_size: int  # V rows (not transposed)
    v_elem_size: int  # transposed V
    v_width: int  # transposed V

class _StateDescription(TypedDict):
    cell_count: int
    v_trans: bool
    n_layer: int
    data_offset: int
    size: int
    n_seq_id_min: int
    n_seq_id_max: int
    pos: npt.NDArray[np.int32]
    seq: npt.NDArray[np.uint64]
    layers: list[_LayerDescription]
    ext: NotRequired[npt.NDArray[np.int32]]

def describe_state(data: Buffer, cell_ext: int = 0) -> _StateDescription: ...

class _LayoutInfo(TypedDict):
    name: str
    streams: bool
    prefix: bool
    swa_trim: bool
    outputs: bool
    session_version: int
    sequence_version: int
    cell_ext: int
    llama_cpp_python: str

class _FrameDescription(TypedDict):
    prefixed: bool
    src_seq_id: int | None
    n_stream: int
    size: int
    sections: list[tuple[int, int]]

LAYOUTS: tuple[str, ...]
DEFAULT_LAYOUT: str
SEQ_MAGIC: int

def layout_info(layout: str) -> _LayoutInfo: ...
def describe_frame(
    data: Buffer, streams: bool, allow_prefix: bool = True, cell_ext: int = 0
) -> _FrameDescription: ...

class SWAPending:
    """The pending SWA-pruning ranges of an iSWA cache."""

    def __init__(self) -> None: ...
    def set(self, batch: Batch | UBatch, n_seq_max: int, record: bool = True) -> None: ...
    def clear(self) -> None: ...
    def items(self) -> list[list[int]]: ...
    def __len__(self) -> int: ...

# operations over several caches (an iSWA cache's two), all or nothing
class _Hold:
    """Holds the locks of several caches for a ``with`` block."""

    def __new__(cls, *caches: _Unified | _Recurrent, busy: bool = False) -> Self: ...
    def __enter__(self) -> Self: ...
    def __exit__(self, *exc: object) -> Literal[False]: ...

def _find_slot_parts(caches: Iterable[_Unified], ub: UBatch) -> list[bool]: ...
def _update_parts(
    caches: Iterable[_Unified], rope: RopeParams | None = None, n_max_nodes: int = 65536
) -> list[UpdatePlan]: ...
def _state_size_parts(
    caches: Iterable[_Unified], seq_id: int = -1, layout: str = "2026", prefix: bool | None = None
) -> int: ...
def _state_write_parts(
    caches: Iterable[_Unified], seq_id: int = -1, layout: str = "2026", prefix: bool | None = None
) -> bytes: ...
def _state_read_parts(
    caches: Iterable[_Unified],
    data: Buffer,
    seq_id: int = -1,
    *,
    convert: bool = False,
    exact: bool = False,
    layout: str | None = None,
) -> int: ...

# --- handing a sequence to another process (_handoff.pxi) ------------------------------------------

@final
class SeqExport:
    # made by UnifiedCache.seq_export / seq_import_begin; calling the class raises TypeError
    def __init__(self, *args: object, **kwargs: object) -> None: ...
    @property
    def cache(self) -> _Unified: ...
    @property
    def seq_id(self) -> int: ...
    @property
    def header(self) -> bytes: ...
    @property
    def regions(self) -> npt.NDArray[np.uint64]: ...
    @property
    def cells(self) -> npt.NDArray[np.int32]: ...
    @property
    def n_bytes(self) -> int: ...
    @property
    def n_cells(self) -> int: ...
    def gather(self, out: Buffer | None = None) -> Any: ...

@final
class SeqImport:
    # made by UnifiedCache.seq_export / seq_import_begin; calling the class raises TypeError
    def __init__(self, *args: object, **kwargs: object) -> None: ...
    @property
    def regions(self) -> npt.NDArray[np.uint64]: ...
    @property
    def cells(self) -> npt.NDArray[np.int32]: ...
    @property
    def seq_id(self) -> int: ...
    @property
    def active(self) -> bool: ...
    @property
    def n_bytes(self) -> int: ...
    @property
    def n_cells(self) -> int: ...
    def scatter(self, data: Buffer | npt.NDArray[Any]) -> None: ...
    def check(self) -> None: ...
    def commit(self) -> None: ...
    def abort(self) -> None: ...
    def __enter__(self) -> Self: ...
    def __exit__(self, exc_type: object, exc: object, tb: object) -> Literal[False]: ...

def _seq_export(cache: _Unified, seq_id: int) -> SeqExport: ...
def _seq_import_begin(cache: _Unified, header: Buffer, seq_id: int | None = None) -> SeqImport: ...
