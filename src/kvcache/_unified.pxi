# The unified KV cache: UnifiedCore over csrc/kvc_unified.h and its state codec.

from libc.stdint cimport uint16_t
from libc.stdlib cimport malloc, free
from kvcache.includes.kvc_unified cimport *
from kvcache.includes.kvc_cells cimport kvc_cells_reset_shift, kvc_cell_ext
from kvcache.includes.kvc_update cimport (KVC_UPDATE_MAX_PARTS, kvc_update_opts, kvc_update_result,
                                          kvc_unified_update_parts)
from kvcache.includes.kvc_rope cimport kvc_rope_params
from kvcache.includes.kvc_state cimport (kvc_unified_state_size, kvc_unified_state_write,
                                         kvc_unified_state_write_range, kvc_unified_state_size_lay,
                                         kvc_unified_state_write_range_lay)

_SWA_TYPES = {"none": KVC_SWA_NONE, "standard": KVC_SWA_STANDARD, "chunked": KVC_SWA_CHUNKED}
_SWA_NAMES = {v: k for k, v in _SWA_TYPES.items()}
_MASK_DTYPES = {"f32": (KVC_MASK_F32, np.dtype(np.float32)), "f16": (KVC_MASK_F16, np.dtype(np.float16)),
                "bool": (KVC_MASK_BOOL, np.dtype(np.bool_))}


cdef object _f32_to_half(object a, bint bf16):
    """float32 array -> uint16 array of f16 (or bf16) bits, with the C core's rounding."""
    src = np.ascontiguousarray(a, dtype=np.float32)
    out = np.empty(src.shape, dtype=np.uint16)
    cdef const float[::1] s = src.reshape(-1)
    cdef uint16_t[::1] d = out.reshape(-1)
    cdef Py_ssize_t i, n = s.shape[0]
    with nogil:
        if bf16:
            for i in range(n):
                d[i] = kvc_f32_to_bf16(s[i])
        else:
            for i in range(n):
                d[i] = kvc_f32_to_f16(s[i])
    return out


cdef tuple _head_dims_arg(object v, Py_ssize_t n_layer, tuple wk, tuple kept):
    """Per-layer K head size (n_embd_head_k), or None when not given: each kept layer's K row
    must be a whole number of heads."""
    if v is None:
        return None
    hd = widths_arg(v, n_layer, "n_embd_head_k")
    for il in kept:
        if hd[il] == 0 or wk[il] % hd[il]:
            raise ValueError(f"n_embd_k_gqa[{il}] = {wk[il]} is not a whole number of heads of "
                             f"n_embd_head_k = {hd[il]}")
    return hd


cdef int _check_rope(object rope, tuple head_k, tuple kept, str name) except -1:
    """rope: None or RopeParams that fit every kept layer's heads (needs their size)."""
    cdef kvc_rope_params p
    if rope is None:
        return 0
    if not isinstance(rope, RopeParams):
        raise TypeError(f"{name} must be a RopeParams or None, not {type(rope).__name__}")
    if head_k is None:
        raise ValueError(f"{name}: rotating keys needs the K head size; give n_embd_head_k too")
    for il in kept:
        try:
            (<RopeParams>rope).fill(&p, il, head_k[il])
        except ValueError as e:
            raise ValueError(f"{name}: layer {il}: {e}") from None
    return 0


cdef uint32_t _layer_index(_Unified self, object il) except? 0xFFFFFFFF:
    ikv = self._ikv.get(il) if type(il) is int else None
    if ikv is not None:
        return <uint32_t>ikv
    if not _is_int(il):
        raise TypeError(f"il must be an int (a model layer index), not {type(il).__name__}")
    ikv = self._ikv.get(int_c(il, "il", LLONG_MIN, LLONG_MAX))
    if ikv is None:
        raise IndexError(f"il = {il} is not a layer of this cache (layers: {list(self._layers)})")
    return <uint32_t>ikv

cdef int _settle(_Unified self, str what) except -1:
    """Move the rows of a pending defrag before the K/V memory is handed out (a change: refused
    from a callback of another operation on the cache)."""
    kvc_pylock_acquire(&self._lock)
    if self.c.defrag_pending and self._lock.busy:
        kvc_pylock_release(&self._lock)
        raise_busy(what)
    with nogil:
        kvc_unified_defrag_settle(&self.c)
        kvc_pylock_release(&self._lock)
    return 0

_SEMANTICS = {"2025": KVC_SEM_2025, "2026": KVC_SEM_2026}


cdef int _refuse_2026(_Unified self, str what, str why) except -1:
    """The operations of the 2025 semantics that today's llama.cpp no longer has."""
    if self.c.semantics == KVC_SEM_2026:
        raise ValueError(f"{what}: a cache of semantics '2026' has no {what} ({why})")
    return 0


cdef int _check_state_layout(_Unified self, unsigned bits, str what, bint writes=True) except -1:
    """A layout without stream counts holds one stream, one without cell extensions writes none
    (the codec refuses them too; a reader leaves the extensions at their defaults)."""
    if self.c.n_stream > 1 and not bits & (KVC_LAYOUT_STREAMS | KVC_LAYOUT_DETECT):
        raise ValueError(f"{what}: the cache has {self.c.n_stream} streams; a layout without stream counts "
                         f"holds one (use a layout with them: '2025-08' or later)")
    if writes and kvc_unified_has_ext(&self.c) and not bits & KVC_LAYOUT_EXT_XY:
        raise ValueError(f"{what}: the cache's cells carry the per-cell extension, which layouts before "
                         f"'2026-03' have no room for (it would be lost): use '2026-03' or later")
    return 0


cdef int _refuse_2025(_Unified self, str what) except -1:
    if self.c.semantics != KVC_SEM_2026:
        raise ValueError(f"{what}: only a cache of semantics '2026' has it")
    return 0


# bytes a call copies without releasing the GIL (more take long enough for other threads to run)
cdef enum:
    _SMALL_COPY = 65536


cdef int _require_memory(_Unified self, str what) except -1:
    if self._buffers == "none":
        raise RuntimeError(f"{what}: this cache holds no K/V memory (buffers='none'); its owner "
                           f"writes K/V at .slot and applies update()'s plan with its own kernels")
    return 0


cdef _HeldBuffer _rows_buffer(object rows, int32_t type_id, str name):
    """The rows handed to store(), taken at the edge (see hold_buffer): of the cache's element
    dtype, C-contiguous; float32 rows of an f16 / bf16 cache are converted into a copy first.
    None stays None. Their shape is checked against the placement under the lock."""
    if rows is None:
        return None
    cdef _HeldBuffer hb = hold_buffer(rows, name, False)
    dt = hb.dtype
    if dt is _element_dtype(type_id) and hb.c_contiguous():
        return hb            # the common case, without comparing dtypes by value
    if type_id == KVC_TYPE_F32:
        ok, want = dt == np.float32, "float32"
    elif type_id == KVC_TYPE_F16:
        ok, want = dt == np.float16 or dt == np.float32, "float16 or float32"
    elif type_id == KVC_TYPE_BF16:
        ok = dt == np.uint16 or dt == np.float32 or (_BF16 is not None and dt == _BF16)
        want = "bfloat16, uint16 (bf16 bits) or float32"
    else:
        ok, want = dt == np.uint8, "uint8 (quantized rows)"
    if not ok:
        raise TypeError(f"{name} must have dtype {want}, not {dt}")
    if not hb.c_contiguous():
        raise ValueError(f"{name} must be C-contiguous")
    if dt == np.float32 and type_id != KVC_TYPE_F32:
        half = _f32_to_half(hb.array, type_id == KVC_TYPE_BF16)
        hb.release()
        hb = hold_buffer(half, name, False)
    return hb


cdef int _check_rows(_HeldBuffer hb, uint32_t n, size_t width, str name) except -1:
    """rows of a store(): (n, width) elements of the cache dtype (no Python code on success)."""
    if hb.view.ndim != 2 or <size_t>hb.view.shape[0] != n or <size_t>hb.view.shape[1] != width:
        # the shape alone: the dtype was checked already (and float32 rows of a half cache are a
        # converted copy by now)
        raise ValueError(f"{name} must have shape {(n, width)}, not {hb.shape()}")
    return 0

class Cells:
    """A snapshot of a cache's cells (copies; later cache operations do not change it).

    ``pos`` (int32, -1 = empty) and ``shift`` (int32, accumulated since the last reset), one entry
    per cell, and ``seq_mask``: uint64 [size, n_words], bit b of word w set when sequence
    64 * w + b holds the cell (n_words = 1 for caches of up to 64 sequences, up to 4 for
    MAX_SEQ = 256). ``ext``: for a cache with the per-cell extension, int32 [size, 3], per cell
    its x, y (2-D position) and token id (-1: none); else None."""

    __signature__ = _signatures.ClassSignature(_signatures.cells)

    def __init__(self, *args, **kwargs):
        self.pos, self.shift, self.seq_mask, self.ext = (
            args if len(args) == 4 and not kwargs else _signatures.bind(_signatures.cells, type(self), args, kwargs))

    def __len__(self):
        return len(self.pos)

    def seq_ids(self, i):
        """Sequence ids of cell i, ascending."""
        out = []
        for w, m in enumerate(self.seq_mask[i].tolist()):
            out += [64 * w + b for b in range(64) if (m >> b) & 1]
        return out

    def holds(self, seq_id):
        """Per cell, whether sequence seq_id holds it (a bool array)."""
        if not 0 <= seq_id < 64 * self.seq_mask.shape[1]:
            return np.zeros(len(self.pos), dtype=bool)
        return ((self.seq_mask[:, seq_id >> 6] >> np.uint64(seq_id & 63)) & np.uint64(1)).astype(bool)

    def nonempty(self):
        """``[idx, pos, [seq ids ascending], shift]`` for every non-empty cell, by index."""
        idx = np.flatnonzero(self.pos != -1)
        return [[int(i), int(self.pos[i]), self.seq_ids(i), int(self.shift[i])] for i in idx]

    def __eq__(self, other):
        if not isinstance(other, Cells):
            return NotImplemented
        return (np.array_equal(self.pos, other.pos) and np.array_equal(self.shift, other.shift)
                and np.array_equal(self.seq_mask, other.seq_mask)
                and (self.ext is None) == (other.ext is None)
                and (self.ext is None or np.array_equal(self.ext, other.ext)))

    __hash__ = None

    def __repr__(self):
        return f"Cells(size={len(self.pos)}, used={int(np.count_nonzero(self.pos != -1))})"


class UpdatePlan:
    """What update() did, and what the owner of the K/V memory still has to do.

    - ``k_shift``: int32 [size], the per-cell shift that was pending (None when none was).
    - ``rotated``: kvcache rotated K by it (update got ``rope``).
    - ``defrag_runs``: uint32 [n, 3] of (src, dst, count) cell runs the defrag moved (None when
      no defrag ran).
    - ``moved``: kvcache moved its K/V rows along those runs.
    - ``need_reserve`` (also ``bool(plan)``): the data changed, or has to be changed by the
      caller of a metadata-only cache: first rotate cell i's keys by ``k_shift[i]``, then move
      the runs.
    """

    __slots__ = ("k_shift", "rotated", "defrag_runs", "moved", "need_reserve")

    __signature__ = _signatures.ClassSignature(_signatures.update_plan)

    def __init__(self, *args, **kwargs):
        self.k_shift, self.rotated, self.defrag_runs, self.moved, self.need_reserve = (
            args if len(args) == 5 and not kwargs
            else _signatures.bind(_signatures.update_plan, type(self), args, kwargs))

    def __bool__(self):
        return bool(self.need_reserve)

    def __repr__(self):
        ns = None if self.k_shift is None else int(np.count_nonzero(self.k_shift))
        nr = None if self.defrag_runs is None else len(self.defrag_runs)
        return (f"UpdatePlan(shifted_cells={ns}, rotated={self.rotated}, defrag_runs={nr}, "
                f"moved={self.moved}, need_reserve={self.need_reserve})")


class StreamUpdate(UpdatePlan):
    """What update() of a cache of semantics '2026' did (llama.cpp's init_update + apply).

    - ``status``: 0 (LLAMA_MEMORY_STATUS_SUCCESS) when there was a shift or a stream copy to
      apply, else 1 (NO_UPDATE); ``bool(result)`` is ``status == 0``.
    - ``had_shift``: a shift was pending; ``has_shift``: one is pending afterwards (never).
    - ``copies``: the stream copies performed (whole K and V slabs of every layer, in order).
    - ``shift``: int32 ``[n_stream * size]``, the K-shift input read before the update,
      stream-major, 0 for empty cells.
    - ``rotated``: kvcache rotated K by it (a model with RoPE and K memory); otherwise the
      shifts were dropped (no RoPE here, or the owner of the K memory rotates).

    As an UpdatePlan: ``k_shift`` is ``shift`` when one was pending (else None), no defrag
    runs, and ``need_reserve`` when anything changed.
    """

    __slots__ = ("status", "had_shift", "copies", "has_shift", "shift")

    __signature__ = _signatures.ClassSignature(_signatures.stream_update)

    def __init__(self, *args, **kwargs):
        status, had_shift, copies, has_shift, shift, rotated = (
            args if len(args) == 6 and not kwargs
            else _signatures.bind(_signatures.stream_update, type(self), args, kwargs))
        super().__init__(shift if had_shift else None, rotated, None, False, status == 0)
        self.status = status
        self.had_shift = had_shift
        self.copies = copies
        self.has_shift = has_shift
        self.shift = shift

    def __bool__(self):
        return self.status == 0

    def __repr__(self):
        return (f"StreamUpdate(status={self.status}, had_shift={self.had_shift}, copies={self.copies}, "
                f"has_shift={self.has_shift}, rotated={self.rotated})")



cdef class _LayerRope:
    """A cache's RoPE parameters and K head size per kept layer, as C takes them."""
    cdef kvc_rope_params *params   # per kept layer
    cdef uint32_t *hd              # per kept layer: K head size

    def __dealloc__(self):
        PyMem_Free(self.params)
        PyMem_Free(self.hd)


cdef _LayerRope _layer_rope(_Unified self, RopeParams rope):
    """rope for every kept layer of the cache (ValueError naming a layer it does not fit)."""
    cdef uint32_t n = self.c.n_layer, i
    cdef _LayerRope lr = _LayerRope.__new__(_LayerRope)
    lr.params = <kvc_rope_params *>PyMem_Malloc(max(n, 1) * sizeof(kvc_rope_params))
    lr.hd = <uint32_t *>PyMem_Malloc(max(n, 1) * sizeof(uint32_t))
    if lr.params == NULL or lr.hd == NULL:
        raise MemoryError("update")
    for i in range(n):
        il = self._layers[i]
        lr.hd[i] = self._n_embd_head_k[il]
        try:
            rope.fill(&lr.params[i], il, lr.hd[i])
        except ValueError as e:
            raise ValueError(f"update: layer {il}: {e}") from None
    return lr


cdef list _update_caches(tuple cs, object rope, int32_t nmax):
    """update() of the caches in cs (whose locks the caller holds), all or nothing (C checks and
    allocates every rotation before the first cache changes)."""
    cdef _Unified c
    cdef Py_ssize_t k, n = len(cs)
    cdef kvc_unified *ptrs[KVC_UPDATE_MAX_PARTS]
    cdef kvc_update_opts opts[KVC_UPDATE_MAX_PARTS]
    cdef kvc_update_result res[KVC_UPDATE_MAX_PARTS]
    cdef _LayerRope lr
    cdef int32_t[::1] sv
    cdef kvc_err err
    cdef int r
    if n > KVC_UPDATE_MAX_PARTS:
        raise ValueError(f"update: at most {KVC_UPDATE_MAX_PARTS} caches at once")
    keep, shifts = [], []
    for k in range(n):
        c = cs[k]
        ptrs[k] = &c.c
        opts[k].rope = NULL
        opts[k].head_dim = NULL
        opts[k].n_max_nodes = nmax
        opts[k].k_shift = NULL
        shift = None
        if kvc_unified_any_shift(&c.c):
            shift = np.zeros(c.c.cells.size * c.c.n_stream, dtype=np.int32)
            sv = shift
            opts[k].k_shift = &sv[0]
            # a cache without memory leaves the rotation to its owner, unless the caller insists
            rp = rope if rope is not None else (c._rope if c._buffers != "none" else None)
            if rp is not None:
                lr = _layer_rope(c, <RopeParams>rp)
                keep.append(lr)
                opts[k].rope = lr.params
                opts[k].head_dim = lr.hd
        shifts.append(shift)
    err.msg[0] = 0
    with nogil:
        r = kvc_unified_update_parts(ptrs, <uint32_t>n, opts, res, &err)
    check_status(r, &err, "update")
    plans = []
    for k in range(n):
        c = cs[k]
        runs = c.defrag_runs() if res[k].defragged else None
        plans.append(UpdatePlan(shifts[k] if res[k].shifted else None, res[k].rotated, runs, res[k].moved,
                                res[k].need_reserve))
    return plans


cdef class UnifiedCore:
    """The unified KV cache as other extensions cimport it (_core.pxd): C-level methods only.
    Every instance is a _Unified (kvcache.UnifiedCache), which implements them."""

    def __cinit__(self, *args, **kwargs):
        if not isinstance(self, _Unified):
            raise TypeError("UnifiedCore is the cimport interface of kvcache.UnifiedCache: create a "
                            "kvcache.UnifiedCache")

    # never reached (every instance is a _Unified): inert answers
    cdef int lock_c(self) noexcept nogil:
        return -1
    cdef int unlock_c(self) noexcept nogil:
        return -1
    cdef int find_slot_c(self, const kvc_ubatch *ub) noexcept nogil:
        return KVC_E_INTERNAL
    cdef void commit_c(self) noexcept nogil:
        pass
    cdef void restore_c(self) noexcept nogil:
        pass
    cdef bint seq_rm_c(self, int32_t s, int32_t p0, int32_t p1) noexcept nogil:
        return False
    cdef void seq_cp_c(self, int32_t src, int32_t dst, int32_t p0, int32_t p1) noexcept nogil:
        pass
    cdef void seq_keep_c(self, int32_t s) noexcept nogil:
        pass
    cdef void seq_add_c(self, int32_t s, int32_t p0, int32_t p1, int32_t shift) noexcept nogil:
        pass
    cdef void seq_div_c(self, int32_t s, int32_t p0, int32_t p1, int32_t d) noexcept nogil:
        pass
    cdef void clear_c(self) noexcept nogil:
        pass
    cdef void set_full_c(self) noexcept nogil:
        pass
    cdef int store_c(self, uint32_t ikv, const void *k, const void *v) noexcept nogil:
        return KVC_E_INTERNAL
    cdef int kq_mask_c(self, const kvc_ubatch *ub, bint causal, bint alibi, int dtype, bint pad, size_t row_stride,
                       void *out) noexcept nogil:
        return KVC_E_INTERNAL
    cdef void k_shift_c(self, int32_t *out) noexcept nogil:
        pass
    cdef void reset_shift_c(self) noexcept nogil:
        pass
    cdef int32_t seq_pos_min_c(self, int32_t s) noexcept nogil:
        return -1
    cdef int32_t seq_pos_max_c(self, int32_t s) noexcept nogil:
        return -1
    cdef uint32_t head_c(self) noexcept nogil:
        return 0
    cdef uint32_t n_c(self) noexcept nogil:
        return 0
    cdef uint32_t used_c(self) noexcept nogil:
        return 0
    cdef uint32_t size_c(self) noexcept nogil:
        return 0
    cdef uint32_t n_seq_max_c(self) noexcept nogil:
        return 0
    cdef uint32_t n_layer_c(self) noexcept nogil:
        return 0


cdef class _Unified(UnifiedCore):
    """The unified KV cache (see kvcache.UnifiedCache for the documented public class)."""
    cdef kvc_unified c             # the C cache: cells, head/n, recovery, defrag plan, layer table
    cdef bint _ready               # c is initialised (kvc_unified_free is due)
    cdef uint32_t _n_layer_model   # model layer count given to the constructor
    cdef tuple _layers             # kept model layer indices, ascending (the cache's layer order)
    cdef dict _ikv                 # model layer index -> index into c.layers
    cdef tuple _n_embd_k           # K row width per model layer
    cdef tuple _n_embd_v           # V row width per model layer
    cdef list _k_mem               # per kept layer: K memory as uint8 (owned, aligned; borrowed: None until
                                   # a view is made); empty without memory
    cdef list _v_mem               # per kept layer: V memory likewise
    cdef list _k_view              # per kept layer: K as the cache dtype, (size, n_embd_k) or (size, row_bytes)
    cdef list _v_view              # per kept layer: V likewise, (n_embd_v, size) when v_trans
    cdef str _buffers              # buffer mode: "owned", "borrowed" or "none" (metadata only)
    cdef object _borrowed          # borrowed mode: (the caller's (K, V) objects, their _HeldBuffers) per kept layer
    cdef tuple _n_embd_head_k      # K head size per model layer, or None (needed by the RoPE K-shift)
    cdef object _rope              # the model's RopeParams, or None (update() rotates K with them)
    cdef kvc_pylock _lock          # held by every Python method (see "locking" in _common.pxi)

    __signature__ = _signatures.ClassSignature(_signatures.unified)

    def __cinit__(self, *args, **kwargs):
        (kv_size, n_layer, n_embd_k_gqa, n_embd_v_gqa, type_k, type_v, v_trans, n_seq_max, n_pad, n_swa, swa_type,
         layers, buffers, n_embd_head_k, rope, semantics, kv_unified, cell_ext,
         ple_token) = _signatures.bind(_signatures.unified, type(self), args, kwargs)
        cdef kvc_unified_params p
        cdef kvc_err err
        cdef const kvc_type_info *tk
        cdef const kvc_type_info *tv
        cdef Py_ssize_t i, nl
        cdef kvc_layer *lay
        err.msg[0] = 0
        if kvc_pylock_init(&self._lock) != 0:
            raise MemoryError("UnifiedCache: cannot allocate its lock")

        # arguments converted to their C types here; their meaning (kv_size a multiple of n_pad,
        # widths whole blocks of the type, v_trans with a block-1 V type, ...) is kvc_unified_init's
        mode = _buffers_mode(buffers)
        nl = int_c(n_layer, "n_layer", 0, 0x7FFFFFFF)
        n_pad_ = int_c(n_pad, "n_pad", 0, UINT32_MAX)
        kv_size_ = int_c(kv_size, "kv_size", 0, UINT32_MAX)
        n_seq_max_ = int_c(n_seq_max, "n_seq_max", 0, UINT32_MAX)
        tk = type_c(type_k, "type_k")
        tv = type_c(type_v, "type_v")
        if not isinstance(v_trans, (bool, np.bool_, int, np.integer)):
            raise TypeError(f"v_trans must be a bool, not {type(v_trans).__name__}")
        v_trans_ = bool(v_trans)
        if not isinstance(swa_type, str):
            raise TypeError(f"swa_type must be a str, not {type(swa_type).__name__}")
        if swa_type not in _SWA_TYPES:
            raise ValueError(f"swa_type = {swa_type!r}: expected one of {', '.join(_SWA_TYPES)}")
        n_swa_ = int_c(n_swa, "n_swa", 0, UINT32_MAX)
        if not isinstance(semantics, str):
            raise TypeError(f"semantics must be a str, not {type(semantics).__name__}")
        if semantics not in _SEMANTICS:
            raise ValueError(f"semantics = {semantics!r}: expected one of {', '.join(_SEMANTICS)}")
        if not isinstance(kv_unified, (bool, np.bool_, int, np.integer)):
            raise TypeError(f"kv_unified must be a bool, not {type(kv_unified).__name__}")
        cell_ext_ = bool_arg(cell_ext, "cell_ext")
        if cell_ext_ and semantics != "2026":
            raise ValueError("cell_ext: the per-cell extension is today's llama.cpp's (semantics='2026'); "
                             "the cells of semantics '2025' have none")
        if ple_token is not None and not cell_ext_:
            raise ValueError("ple_token: a per-layer-embedding model's cache has the per-cell extension "
                             "(cell_ext=True)")
        ple_token_ = pos_c(ple_token, "ple_token") if ple_token is not None else 0
        wk = widths_arg(n_embd_k_gqa, nl, "n_embd_k_gqa", UINT32_MAX)
        wv = widths_arg(n_embd_v_gqa, nl, "n_embd_v_gqa", UINT32_MAX)
        kept = layers_arg(layers, nl)
        pairs = _buffer_pairs(buffers, kept) if mode == "borrowed" else None

        # the layer table C copies: kept layer, K and V widths, one spare entry each (never empty);
        # on the stack for up to 64 kept layers (no numpy: a constructor runs inside decode loops)
        cdef Py_ssize_t n_kept = len(kept)
        cdef uint32_t table_small[3 * 65]
        cdef uint32_t *table = table_small
        if n_kept > 64:
            table = <uint32_t *>PyMem_Malloc(3 * (<size_t>n_kept + 1) * sizeof(uint32_t))
            if table == NULL:
                raise MemoryError("UnifiedCache")
        cdef int32_t *t_il = <int32_t *>table
        cdef uint32_t *t_k = table + n_kept + 1
        cdef uint32_t *t_v = t_k + n_kept + 1
        for i in range(n_kept):
            il = kept[i]
            t_il[i] = <int32_t>il
            t_k[i] = <uint32_t>wk[il]
            t_v[i] = <uint32_t>wv[il]
        t_il[n_kept] = 0
        t_k[n_kept] = 0
        t_v[n_kept] = 0
        p.kv_size = <uint32_t>kv_size_
        p.semantics = _SEMANTICS[semantics]
        p.stream_per_seq = not bool(kv_unified)
        p.n_seq_max = <uint32_t>n_seq_max_
        p.n_pad = <uint32_t>n_pad_
        p.n_swa = <uint32_t>n_swa_
        p.swa_type = _SWA_TYPES[swa_type]
        p.type_k = tk.id
        p.type_v = tv.id
        p.v_trans = v_trans_
        p.n_layer = <uint32_t>n_kept
        p.layer_il = t_il
        p.n_embd_k = t_k
        p.n_embd_v = t_v
        p.cell_ext = cell_ext_
        p.ple = ple_token is not None
        p.ple_token = ple_token_
        try:
            check_status(kvc_unified_init(&self.c, &p, &err), &err, "UnifiedCache")
        finally:
            if table != table_small:
                PyMem_Free(table)
        self._ready = True
        head_k = _head_dims_arg(n_embd_head_k, nl, wk, kept)
        _check_rope(rope, head_k, kept, "rope")

        self._n_layer_model = <uint32_t>nl
        self._layers = kept
        self._ikv = {il: i for i, il in enumerate(kept)}
        self._n_embd_k = wk
        self._n_embd_v = wv
        self._n_embd_head_k = head_k
        self._rope = rope
        self._buffers = mode
        held = []                       # the borrowed buffers, pinned as long as the cache lives
        self._borrowed = (pairs, held)
        self._k_mem, self._v_mem, self._k_view, self._v_view = [], [], [], []
        if mode == "none":
            return
        dv = _element_dtype(tv.id)
        size = <Py_ssize_t>self.c.cells.size
        n_stream = <Py_ssize_t>self.c.n_stream
        rows = size * n_stream            # K / V rows: stream s at [s * size, (s + 1) * size)
        regions = []
        # error messages are formatted only when one is raised (a constructor runs inside decode loops)
        per = f"{n_stream} streams x " if n_stream > 1 else ""
        addr = []                       # per kept layer: where its K and V memory starts
        for i, il in enumerate(kept):
            lay = &self.c.layers[i]
            nk = rows * lay.k_row_bytes
            nv = rows * lay.v_row_bytes
            if mode == "owned":
                kmem = _aligned_zeros(nk)
                vmem = _aligned_zeros(nv)
                addr.append((_data_address(kmem), _data_address(vmem)))
            else:
                # the caller's memory, held; its uint8 views are made with the first k(il) / v(il)
                vlay = (("{}{} x {} cells of {} bytes, transposed", per, lay.n_embd_v, size, dv.itemsize) if v_trans_
                        else ("{}{} cells x {} bytes", per, size, lay.v_row_bytes))
                hk = _borrowed_held(pairs[i][0], nk, tk.id, ("buffers[{}] K", il),
                                    ("{}{} cells x {} bytes", per, size, lay.k_row_bytes))
                held.append(hk)
                hv = _borrowed_held(pairs[i][1], nv, tv.id, ("buffers[{}] V", il), vlay)
                held.append(hv)
                kmem = vmem = None
                addr.append((<size_t>(<_HeldBuffer>hk).view.buf, <size_t>(<_HeldBuffer>hv).view.buf))
                regions += [(("buffers[{}] K", il), addr[i][0], nk), (("buffers[{}] V", il), addr[i][1], nv)]
            self._k_mem.append(kmem)
            self._v_mem.append(vmem)
            self._k_view.append(None)   # made by the first k(il) / v(il)
            self._v_view.append(None)
        _check_disjoint(regions)
        for i in range(n_kept):
            kvc_unified_set_layer_buffers(&self.c, <uint32_t>i, <uint8_t *><uintptr_t>addr[i][0],
                                          <uint8_t *><uintptr_t>addr[i][1])

    cdef object _layer_view(self, Py_ssize_t i, bint is_v):
        """The typed view k(il) / v(il) returns of kept layer i (made once, then kept)."""
        views = self._v_view if is_v else self._k_view
        view = views[i]
        if view is not None:
            return view
        cdef kvc_layer *lay = &self.c.layers[i]
        cdef Py_ssize_t size = <Py_ssize_t>self.c.cells.size
        cdef Py_ssize_t n_stream = <Py_ssize_t>self.c.n_stream
        cdef Py_ssize_t rows = size * n_stream
        mems = self._v_mem if is_v else self._k_mem
        mem = mems[i]
        if mem is None:                 # borrowed: the held buffer's bytes of this layer
            mem = mems[i] = _held_bytes(self._borrowed[1][2 * i + is_v],
                                        <size_t>rows * (lay.v_row_bytes if is_v else lay.k_row_bytes))
        dt = _element_dtype(self.c.type_v if is_v else self.c.type_k)
        if not is_v:
            view = (mem.reshape(rows, lay.k_row_bytes) if dt.itemsize == 1
                    else _typed_view(mem, dt, (rows, lay.n_embd_k)))
        elif dt.itemsize == 1:
            view = mem.reshape(rows, lay.v_row_bytes)
        elif self.c.v_trans and self.c.semantics == KVC_SEM_2026:
            view = _typed_view(mem, dt, (n_stream, lay.n_embd_v, size))
        elif self.c.v_trans:
            view = _typed_view(mem, dt, (lay.n_embd_v, size))
        else:
            view = _typed_view(mem, dt, (rows, lay.n_embd_v))
        views[i] = view
        return view

    def __dealloc__(self):
        if self._ready:
            kvc_unified_free(&self.c)
            self._ready = False
        kvc_pylock_free(&self._lock)

    def __repr__(self):
        cdef uint32_t head, n, used
        kvc_pylock_acquire(&self._lock)
        head, n, used = self.c.head, self.c.n, self.c.cells.used
        kvc_pylock_release(&self._lock)
        return (f"{type(self).__name__}(kv_size={self.c.cells.size}, n_layer={self._n_layer_model}, "
                f"layers={list(self._layers)}, type_k={self.type_k!r}, type_v={self.type_v!r}, "
                f"v_trans={bool(self.c.v_trans)}, n_seq_max={self.c.n_seq_max}, head={head}, "
                f"n={n}, used={used})")

    # --- C-level operations (declared in _core.pxd) ---------------------------------------
    cdef int lock_c(self) noexcept nogil:
        return kvc_pylock_acquire_change_nogil(&self._lock)

    cdef int unlock_c(self) noexcept nogil:
        if not kvc_pylock_mine(&self._lock):
            return -1
        kvc_pylock_release(&self._lock)
        return 0

    cdef int find_slot_c(self, const kvc_ubatch *ub) noexcept nogil:
        return kvc_unified_find_slot(&self.c, ub)

    cdef void commit_c(self) noexcept nogil:
        kvc_unified_commit(&self.c)

    cdef void restore_c(self) noexcept nogil:
        kvc_unified_restore(&self.c)

    cdef bint seq_rm_c(self, int32_t s, int32_t p0, int32_t p1) noexcept nogil:
        return kvc_unified_seq_ops.seq_rm(&self.c, s, p0, p1)

    cdef void seq_cp_c(self, int32_t src, int32_t dst, int32_t p0, int32_t p1) noexcept nogil:
        kvc_unified_seq_ops.seq_cp(&self.c, src, dst, p0, p1)

    cdef void seq_keep_c(self, int32_t s) noexcept nogil:
        kvc_unified_seq_ops.seq_keep(&self.c, s)

    cdef void seq_add_c(self, int32_t s, int32_t p0, int32_t p1, int32_t shift) noexcept nogil:
        kvc_unified_seq_ops.seq_add(&self.c, s, p0, p1, shift)

    cdef void seq_div_c(self, int32_t s, int32_t p0, int32_t p1, int32_t d) noexcept nogil:
        kvc_unified_seq_ops.seq_div(&self.c, s, p0, p1, d)

    cdef void clear_c(self) noexcept nogil:
        kvc_unified_seq_ops.clear(&self.c)

    cdef void set_full_c(self) noexcept nogil:
        kvc_unified_set_full(&self.c)

    cdef int store_c(self, uint32_t ikv, const void *k, const void *v) noexcept nogil:
        return kvc_unified_store(&self.c, ikv, kvc_unified_slot_n(&self.c), k, v)

    cdef int kq_mask_c(self, const kvc_ubatch *ub, bint causal, bint alibi, int dtype, bint pad, size_t row_stride,
                       void *out) noexcept nogil:
        # remembered as the buffer's content, so that a later kq_mask(reuse=True) into it is exact
        return kvc_unified_kq_mask_reuse(&self.c, ub, causal, alibi, dtype, pad, row_stride, out, False)

    cdef void k_shift_c(self, int32_t *out) noexcept nogil:
        kvc_unified_k_shift(&self.c, out)

    cdef void reset_shift_c(self) noexcept nogil:
        kvc_cells_reset_shift(&self.c.cells)

    cdef int32_t seq_pos_min_c(self, int32_t s) noexcept nogil:
        return kvc_unified_seq_pos_min(&self.c, s)

    cdef int32_t seq_pos_max_c(self, int32_t s) noexcept nogil:
        return kvc_unified_seq_pos_max(&self.c, s)

    cdef uint32_t head_c(self) noexcept nogil:
        return self.c.head

    cdef uint32_t n_c(self) noexcept nogil:
        return self.c.n

    cdef uint32_t used_c(self) noexcept nogil:
        return self.c.cells.used

    cdef uint32_t size_c(self) noexcept nogil:
        return self.c.cells.size

    cdef uint32_t n_seq_max_c(self) noexcept nogil:
        return self.c.n_seq_max

    cdef uint32_t n_layer_c(self) noexcept nogil:
        return self.c.n_layer

    # --- geometry and counters -----------------------------------------------------------
    @property
    def head(self):
        """Where the next slot search starts (after find_slot: where the ubatch was placed);
        semantics '2026': stream 0's (see heads)."""
        cdef uint32_t r
        kvc_pylock_acquire(&self._lock)
        r = self.c.head
        kvc_pylock_release(&self._lock)
        return r

    @property
    def n(self):
        """Number of cells the attention looks at (the KQ mask's columns); semantics '2026':
        the largest of n_kv_per_stream."""
        cdef uint32_t r, s
        kvc_pylock_acquire(&self._lock)
        r = self.c.n
        if self.c.semantics == KVC_SEM_2026:
            for s in range(self.c.n_stream):
                r = max(r, kvc_unified_stream_n_kv(&self.c, s))
        kvc_pylock_release(&self._lock)
        return r

    @property
    def used(self):
        """Number of non-empty cells (of every stream)."""
        cdef uint32_t r = 0, s
        kvc_pylock_acquire(&self._lock)
        for s in range(self.c.n_stream):
            r += kvc_unified_stream_cells_c(&self.c, s).used
        kvc_pylock_release(&self._lock)
        return r

    # --- streams (semantics '2026'; one stream otherwise) ---------------------------------
    @property
    def semantics(self):
        """'2025' (llama.cpp as of mid-2025: contiguous placement, commit/restore, defrag) or '2026'
        (today's llama.cpp: streams, scattered placement, stream copies)."""
        return "2026" if self.c.semantics == KVC_SEM_2026 else "2025"

    @property
    def kv_unified(self):
        """True when every sequence shares one stream (always with semantics '2025')."""
        return self.c.n_stream == 1

    @property
    def cell_ext(self):
        """True when every cell carries llama.cpp's per-cell extension (a 2-D position and a token
        id: the caches of M-RoPE and per-layer-embedding models; semantics '2026' only)."""
        return kvc_unified_has_ext(&self.c)

    @property
    def ple_token(self):
        """The token id a ubatch without token ids stores in the cells (a per-layer-embedding
        model's image or EOS token), or None: such a ubatch stores an extension only when it has
        2-D positions."""
        return self.c.ple_token if self.c.ple else None

    @property
    def n_stream(self):
        """Cell tables (streams): 1, or n_seq_max with kv_unified=False (sequence s in stream s);
        size is the size of each."""
        return self.c.n_stream

    cdef tuple _per_stream(self, int what):
        cdef uint32_t s
        cdef const kvc_cells *t
        out = []
        kvc_pylock_acquire(&self._lock)
        for s in range(self.c.n_stream):
            t = kvc_unified_stream_cells_c(&self.c, s)
            if what == 0:
                out.append(kvc_unified_stream_head_c(&self.c, s))
            elif what == 1:
                out.append(t.used)
            elif what == 2:
                out.append(t.used_max_p1)
            else:
                out.append(kvc_unified_stream_n_kv(&self.c, s) if self.c.semantics == KVC_SEM_2026 else self.c.n)
        kvc_pylock_release(&self._lock)
        return tuple(out)

    @property
    def heads(self):
        """Per stream, the cell where the next slot search starts (a tuple)."""
        return self._per_stream(0)

    @property
    def used_per_stream(self):
        """Per stream, the number of non-empty cells."""
        return self._per_stream(1)

    @property
    def used_max_p1_per_stream(self):
        """Per stream, the index of the last non-empty cell + 1 (0 when empty)."""
        return self._per_stream(2)

    @property
    def n_kv_per_stream(self):
        """Per stream, the cells the attention spans: semantics '2026': min(size, max(P,
        pad(used_max_p1, P))) with P = max(n_pad, 256); '2025': n."""
        return self._per_stream(3)

    @property
    def pending_copies(self):
        """Stream copies queued by seq_cp across streams for the next update()."""
        return self.c.n_copies

    @property
    def size(self):
        """Number of cells (kv_size)."""
        return self.c.cells.size

    @property
    def n_seq_max(self):
        """Valid sequence ids are [0, n_seq_max)."""
        return self.c.n_seq_max

    @property
    def n_layer(self):
        """Number of model layers given to the constructor (kept or not)."""
        return self._n_layer_model

    @property
    def layers(self):
        """Model indices of the kept layers, ascending (the cache's layer order)."""
        return self._layers

    @property
    def type_k(self):
        """ggml type name of K."""
        return kvc_type_get(self.c.type_k).name.decode()

    @property
    def type_v(self):
        """ggml type name of V."""
        return kvc_type_get(self.c.type_v).name.decode()

    @property
    def v_trans(self):
        """Whether V is stored transposed (element e of cell c at e * size + c)."""
        return bool(self.c.v_trans)

    @property
    def n_pad(self):
        """kv_size and n are multiples of n_pad."""
        return self.c.n_pad

    @property
    def n_swa(self):
        """Sliding window size (0 without a window)."""
        return self.c.n_swa

    @property
    def swa_type(self):
        """'none', 'standard' or 'chunked'."""
        return _SWA_NAMES[self.c.swa_type]

    @property
    def buffers(self):
        """How the K/V memory is held: 'owned' (numpy arrays of the cache), 'borrowed' (the
        caller's buffers) or 'none' (metadata only: the caller applies the plans)."""
        return self._buffers

    @property
    def n_embd_head_k(self):
        """K head size per model layer (a tuple), or None when not given to the constructor."""
        return self._n_embd_head_k

    @property
    def rope(self):
        """The model's RopeParams given to the constructor (update() rotates K with them), or None."""
        return self._rope

    @property
    def slot(self):
        """(head, n_tokens): the cells [head, head + n_tokens) the last successful find_slot
        put its ubatch in, where that ubatch's K/V rows go; None when no placement is current
        (after restore, a sequence operation, clear, set_full, defrag or a state read)."""
        cdef uint32_t head, placed
        if self.c.semantics == KVC_SEM_2026:
            raise ValueError("slot: a placement of semantics '2026' is scattered; see slot_info() / slot_indices()")
        kvc_pylock_acquire(&self._lock)
        placed = kvc_unified_slot_n(&self.c)
        head = kvc_unified_slot_cell(&self.c, 0) if placed else 0
        kvc_pylock_release(&self._lock)
        if placed == 0:
            return None
        return (head, placed)

    def slot_indices(self, out=None):
        """The cell of each token the last successful find_slot placed, in token order: an int32
        array (empty when no placement is current, see ``slot``). Index K/V memory kept
        elsewhere with it, e.g. ``k_dev[il].index_copy_(0, idx, k_rows)``. With several
        streams the cells are those of each token's stream (``slot_info()`` has the streams;
        the K/V row of a cell c of stream s is ``s * size + c``).

        out: a writable 1-D int32 or int64 buffer (numpy, buffer protocol or a CPU tensor: int64
        is what torch's index ops take) of at least that length; its first slot_n elements are
        written and returned as for kq_mask (out itself when that is all of it)."""
        cdef int32_t[::1] o
        cdef _HeldBuffer ob = None
        cdef uint32_t n, t, head
        cdef int64_t *p64
        if out is not None:
            ob = hold_buffer(out, "out", True)
            if ob.dtype not in (np.dtype(np.int32), np.dtype(np.int64)) or ob.view.ndim != 1 or not _rows_ok(ob):
                raise ValueError(f"out must be a writable contiguous 1-D int32 or int64 array, got {ob.describe()}")
        kvc_pylock_acquire(&self._lock)
        try:
            n = kvc_unified_slot_n(&self.c)
            if ob is None:
                out = np.empty(n, dtype=np.int32)
                if n:
                    o = out
                    kvc_unified_slot_cells(&self.c, &o[0])
                return out
            if ob.dim(0) < <Py_ssize_t>n:
                raise ValueError(f"out holds {ob.dim(0)} elements; the placement has {n} tokens")
            if n and ob.dtype == np.dtype(np.int32):
                kvc_unified_slot_cells(&self.c, <int32_t *>ob.view.buf)
            elif n:
                p64 = <int64_t *>ob.view.buf
                with nogil:
                    for t in range(n):
                        p64[t] = kvc_unified_slot_cell(&self.c, t)
            return _block(out, ob, n, 0)
        finally:
            kvc_pylock_release(&self._lock)
            if ob is not None:
                ob.release()

    def seq_cells(self, seq_id):
        """The cells of seq_id ordered by position: ``(cells, positions)``, two int32 arrays
        (empty when it holds none). For attention over K/V kept elsewhere: gather rows
        ``cells`` of a layer's K/V to get the sequence in position order (varlen / paged
        attention). After a metadata-only state_read, this is where the restored cells went.
        With several streams the cells are those of the sequence's stream."""
        cdef int32_t s = seq_c(seq_id, self.c.n_seq_max, "seq_id", False)
        cdef int32_t[::1] oc, op
        cdef int r = 0
        cdef const kvc_cells *t
        kvc_pylock_acquire(&self._lock)
        try:
            t = kvc_unified_stream_cells_c(&self.c, kvc_unified_stream_of(&self.c, s))
            n = t.seq_pos[s].n
            cells = np.empty(n, dtype=np.int32)
            pos = np.empty(n, dtype=np.int32)
            if n:
                oc = cells
                op = pos
                with nogil:
                    r = kvc_cells_seq_cells(t, s, &oc[0], &op[0])
        finally:
            kvc_pylock_release(&self._lock)
        if r < 0:
            raise_status(r, NULL, "seq_cells")
        return cells, pos

    def slot_info(self):
        """Where the last successful find_slot put each token, per token group: a list of
        ``(stream, int32 cells)`` — token ``g * n_seq_tokens + i`` of group g in cell
        ``cells[i]`` of the group's stream; ``[]`` when no placement is current. A cache of
        semantics '2025' has one group, stream 0, the run of cells of ``slot``."""
        cdef uint32_t placed, g, ng, nst
        cdef int32_t[::1] o
        kvc_pylock_acquire(&self._lock)
        try:
            placed = kvc_unified_slot_n(&self.c)
            if placed == 0:
                return []
            cells = np.empty(placed, dtype=np.int32)
            o = cells
            kvc_unified_slot_cells(&self.c, &o[0])
            if self.c.semantics != KVC_SEM_2026:
                return [(0, cells)]
            ng, nst = self.c.scatter.n_groups, self.c.scatter.n_seq_tokens
            return [(<int>self.c.scatter.strm[g], cells[g * nst:(g + 1) * nst].copy()) for g in range(ng)]
        finally:
            kvc_pylock_release(&self._lock)

    def prepare(self, ubatches):
        """The dry run of placing several ubatches in turn (semantics '2026'): the slot_info()
        each would get, found against the state holding the ubatches before it (placements
        and the cells they reuse), or None when one does not fit. The cache is left exactly as
        it was. Every ubatch is checked first (ValueError, nothing changed)."""
        cdef kvc_err err
        cdef list ubs = list(ubatches)
        cdef Py_ssize_t n_ub = len(ubs), u, total = 0, off
        cdef kvc_ubatch *arr
        cdef UBatch ub
        cdef int32_t[::1] oc
        cdef uint32_t[::1] os_
        cdef uint32_t[::1] og
        cdef int r
        cdef uint32_t ns = self.c.n_stream
        err.msg[0] = 0
        _refuse_2025(self, "prepare")
        if n_ub == 0:
            raise ValueError("prepare needs at least one ubatch")
        for u in range(n_ub):
            if not isinstance(ubs[u], UBatch):
                raise TypeError(f"ubatches[{u}] must be a UBatch, not {type(ubs[u]).__name__}")
            (<UBatch>ubs[u]).check(self.c.n_seq_max, kvc_unified_has_ext(&self.c))
            total += (<UBatch>ubs[u]).c.n_tokens
        cells = np.zeros(max(total, 1), dtype=np.int32)
        strm = np.zeros(n_ub * ns, dtype=np.uint32)
        groups = np.zeros(n_ub, dtype=np.uint32)
        oc, os_, og = cells, strm, groups
        arr = <kvc_ubatch *>malloc(n_ub * sizeof(kvc_ubatch))
        if arr == NULL:
            raise MemoryError("prepare")
        try:
            for u in range(n_ub):
                ub = ubs[u]
                arr[u] = ub.c
            lock_change(&self._lock, "prepare")
            with nogil:
                r = kvc_unified_prepare_2026(&self.c, arr, <uint32_t>n_ub, &oc[0], &os_[0], &og[0], &err)
                kvc_pylock_release(&self._lock)
        finally:
            free(arr)
        if r < 0:
            raise_status(r, &err, "prepare")
        if r == 0:
            return None
        out = []
        off = 0
        for u in range(n_ub):
            ub = ubs[u]
            ng = int(groups[u])
            nst = ub.c.n_tokens // ng
            out.append([(int(strm[u * ns + g]), cells[off + g * nst:off + (g + 1) * nst].copy()) for g in range(ng)])
            off += ub.c.n_tokens
        return out

    @property
    def has_shift(self):
        """True when positions were shifted since the last reset_shift (a K-shift is due), in
        any stream."""
        cdef bint r
        kvc_pylock_acquire(&self._lock)
        r = kvc_unified_any_shift(&self.c)
        kvc_pylock_release(&self._lock)
        return r

    @property
    def n_threads(self):
        """Threads a K/V move of 16 MiB or more (defrag_move, update) may share its layers among,
        never more than there are layers: 0 (the default) takes the online processors, at most 4
        (more did not move memory faster); 1 keeps every move on the calling thread. Settable,
        up to 64. A KQ mask of 16 MiB or more shares its rows, and a state write of this many
        times 16 MiB or more its bytes, among this many threads only when it is set above 1
        (with 0, the default, masks and states are written on the calling thread)."""
        return self.c.n_threads

    @n_threads.setter
    def n_threads(self, value):
        cdef uint32_t n = <uint32_t>int_c(value, "n_threads", 0, UINT32_MAX)
        cdef kvc_err err
        cdef int r
        err.msg[0] = 0
        lock_change(&self._lock, "n_threads")
        r = kvc_unified_set_n_threads(&self.c, n, &err)
        kvc_pylock_release(&self._lock)
        check_status(r, &err, "n_threads")

    @property
    def fragmentation(self):
        """The fragmentation defrag_sched measures: max(0, 1 - (used + n_pad) / n) (0 while n is
        0), in llama.cpp's float32 arithmetic. defrag_sched takes it as 0 below n = 2048."""
        cdef float r
        kvc_pylock_acquire(&self._lock)
        r = kvc_unified_fragmentation(&self.c)
        kvc_pylock_release(&self._lock)
        return r

    @property
    def do_defrag(self):
        """True when defrag_sched asked for a defragmentation (cleared by defrag_move/update)."""
        cdef bint r
        kvc_pylock_acquire(&self._lock)
        r = self.c.do_defrag
        kvc_pylock_release(&self._lock)
        return r

    # --- slots and sequences -------------------------------------------------------------
    def find_slot(self, ub):
        """Place the ubatch's tokens in contiguous empty cells starting at head.

        Returns True when placed (head is where), False when there is no room; head may move
        either way, as in llama.cpp. Undo with restore(), keep with commit().

        Semantics '2026' (today's find_slot(cont=false) + apply_ubatch): each token group goes
        to usable cells of its stream from the stream's head on, wrapping, not necessarily
        contiguous (slot_info() tells where); a cell whose one sequence's sliding window has
        left it is reused, and that sequence loses its positions up to the one overwritten.
        The placement is final (no commit / restore); a failed find_slot changes nothing.
        With several streams the tokens of each sequence must be together, one id per token,
        every sequence with as many tokens (ValueError otherwise)."""
        cdef UBatch u = ubatch_c(ub)
        cdef int r = 0
        cdef kvc_err err
        err.msg[0] = 0
        u.check(self.c.n_seq_max, kvc_unified_has_ext(&self.c))
        if self.c.semantics == KVC_SEM_2026:
            lock_change(&self._lock, "find_slot")
            with nogil:
                r = kvc_unified_find_slot_2026(&self.c, &u.c, &err)
                kvc_pylock_release(&self._lock)
            if r < 0:
                raise_status(r, &err, "find_slot")
            return r == 1
        with nogil:
            if kvc_pylock_acquire_change_nogil(&self._lock) == 0:
                r = self.find_slot_c(&u.c)
                kvc_pylock_release(&self._lock)
            else:
                r = _BUSY
        if r == _BUSY:
            raise_busy("find_slot")
        if r < 0:
            raise_status(r, NULL, "find_slot")
        return r == 1

    def place_seqs(self, pos, n_tokens=1, n_seqs=1):
        """Place, for good, positions ``pos .. pos + n_tokens - 1`` of each of the sequences
        ``0 .. n_seqs - 1`` (a batch of equal rows: row s is sequence s), in one call and
        without a UBatch: the ubatch whose token ``j * n_seqs + s`` is sequence s at position
        ``pos + j`` (one token per group), found a slot for and committed (semantics "2026":
        find_slot alone, final there).

        Returns the cell of the first token when the tokens' cells are consecutive in token
        order (always so in "2025": ``slot`` is then ``(cell, n_tokens * n_seqs)``), -1 when
        they are scattered ("2026": ``slot_indices()`` lists them), None when there is no room
        (nothing placed; as after a failed find_slot, ``head`` may have moved). Commits the
        find_slot calls before it too."""
        cdef int32_t p0 = pos_c(pos, "pos")
        cdef uint32_t q = <uint32_t>int_c(n_tokens, "n_tokens", 1, INT32_MAX)
        cdef uint32_t rows = <uint32_t>int_c(n_seqs, "n_seqs", 1, KVC_MAX_SEQ)
        cdef uint64_t n = <uint64_t>q * rows
        cdef uint32_t t, first = 0
        cdef int r = 0
        cdef kvc_err err
        cdef kvc_ubatch ub
        # one block: seq_off [n + 1], pos [n], seq_ids [n]; small ubatches (a decode step) on the stack
        cdef uint32_t small[3 * 64 + 1]
        cdef uint32_t *mem = small
        err.msg[0] = 0
        if p0 < 0 or <int64_t>p0 + q - 1 > INT32_MAX:
            raise ValueError(f"pos .. pos + n_tokens - 1 = {p0} .. {<int64_t>p0 + q - 1} must lie in [0, 2**31 - 1]")
        if rows > self.c.n_seq_max:
            raise ValueError(f"n_seqs = {rows}: the cache holds sequences 0 .. {self.c.n_seq_max - 1}")
        if n > UINT32_MAX // 4:
            raise ValueError(f"{n} tokens in one placement")
        if n > 64:
            mem = <uint32_t *>PyMem_Malloc((3 * <size_t>n + 1) * sizeof(uint32_t))
            if mem == NULL:
                raise MemoryError("place_seqs")
        cdef uint32_t *off = mem
        cdef int32_t *pp = <int32_t *>(mem + n + 1)
        cdef int32_t *ids = pp + n
        try:
            for t in range(<uint32_t>n):
                off[t] = t
                pp[t] = p0 + <int32_t>(t // rows)
                ids[t] = <int32_t>(t % rows)
            off[n] = <uint32_t>n
            ub.n_tokens = <uint32_t>n
            ub.n_seq_tokens = 1
            ub.n_seqs = <uint32_t>n
            ub.pos = pp
            ub.seq_off = off
            ub.seq_ids = ids
            ub.pos_x = NULL
            ub.pos_y = NULL
            ub.token = NULL
            lock_change(&self._lock, "place_seqs")
            with nogil:
                if self.c.semantics == KVC_SEM_2026:
                    r = kvc_unified_find_slot_2026(&self.c, &ub, &err)
                else:
                    r = kvc_unified_find_slot(&self.c, &ub)
                    if r == 1:
                        kvc_unified_commit(&self.c)
                if r == 1:
                    first = kvc_unified_slot_cell(&self.c, 0)
                    for t in range(1, <uint32_t>n):
                        if kvc_unified_slot_cell(&self.c, t) != first + t:
                            first = UINT32_MAX
                            break
                kvc_pylock_release(&self._lock)
        finally:
            if mem != small:
                PyMem_Free(mem)
        if r < 0:
            raise_status(r, &err if self.c.semantics == KVC_SEM_2026 else NULL, "place_seqs")
        if r == 0:
            return None
        return -1 if first == UINT32_MAX else first

    def commit(self):
        """Forget the recovery information of the find_slot calls since the last commit."""
        _refuse_2026(self, "commit", "find_slot places for good; prepare() is the dry run")
        lock_change(&self._lock, "commit")
        kvc_unified_commit(&self.c)
        kvc_pylock_release(&self._lock)

    def restore(self):
        """Undo the cell changes of the find_slot calls since the last commit (data is kept):
        the cells are exactly as before those calls (head stays where the search left it, as
        in llama.cpp)."""
        _refuse_2026(self, "restore", "find_slot places for good; prepare() is the dry run")
        lock_change(&self._lock, "restore")
        self.restore_c()
        kvc_pylock_release(&self._lock)

    def set_full(self):
        """n = size and head = 0, as when reserving the worst-case graph."""
        _refuse_2026(self, "set_full", "n_kv follows each stream's cells")
        lock_change(&self._lock, "set_full")
        self.set_full_c()
        kvc_pylock_release(&self._lock)

    def clear(self):
        """Empty every cell, reset shifts, head = 0 and zero the K/V memory (n is kept)."""
        lock_change(&self._lock, "clear")
        with nogil:
            self.clear_c()
            kvc_pylock_release(&self._lock)

    def seq_rm(self, seq_id, p0=-1, p1=-1):
        """Remove seq_id (-1: every sequence) from the cells with p0 <= pos < p1.

        p0 < 0 means 0, p1 < 0 means no upper bound. Returns True."""
        cdef int32_t s = seq_c(seq_id, self.c.n_seq_max, "seq_id", True)
        cdef int32_t a = pos_c(p0, "p0"), b = pos_c(p1, "p1")
        cdef bint r
        lock_change(&self._lock, "seq_rm")
        r = self.seq_rm_c(s, a, b)
        kvc_pylock_release(&self._lock)
        return r

    def seq_cp(self, src, dst, p0=-1, p1=-1):
        """Add dst to every cell of src with p0 <= pos < p1."""
        cdef int32_t s = seq_c(src, self.c.n_seq_max, "src", False)
        cdef int32_t d = seq_c(dst, self.c.n_seq_max, "dst", False)
        cdef int32_t a = pos_c(p0, "p0"), b = pos_c(p1, "p1")
        cdef kvc_err err
        cdef int r
        err.msg[0] = 0
        lock_change(&self._lock, "seq_cp")
        r = kvc_unified_seq_cp_check(&self.c, s, d, a, b, &err)
        if r == KVC_OK:
            self.seq_cp_c(s, d, a, b)
        kvc_pylock_release(&self._lock)
        check_status(r, &err, "seq_cp")

    def seq_keep(self, seq_id):
        """Keep only seq_id: cells without it are emptied, cells with it hold only it."""
        cdef int32_t s = seq_c(seq_id, self.c.n_seq_max, "seq_id", False)
        lock_change(&self._lock, "seq_keep")
        self.seq_keep_c(s)
        kvc_pylock_release(&self._lock)

    def seq_add(self, seq_id, p0, p1, shift):
        """Add shift to the positions of seq_id in [p0, p1); cells pushed below 0 are emptied."""
        cdef int32_t s = seq_c(seq_id, self.c.n_seq_max, "seq_id", False)
        cdef int32_t a = pos_c(p0, "p0"), b = pos_c(p1, "p1")
        cdef int32_t d = pos_c(shift, "shift")
        lock_change(&self._lock, "seq_add")
        self.seq_add_c(s, a, b, d)
        kvc_pylock_release(&self._lock)

    def seq_div(self, seq_id, p0, p1, d):
        """Integer-divide the positions of seq_id in [p0, p1) by d (> 0)."""
        cdef int32_t s = seq_c(seq_id, self.c.n_seq_max, "seq_id", False)
        cdef int32_t a = pos_c(p0, "p0"), b = pos_c(p1, "p1")
        cdef int32_t dd = pos_c(d, "d")
        if dd <= 0:
            raise ValueError(f"d = {dd} must be positive")
        lock_change(&self._lock, "seq_div")
        self.seq_div_c(s, a, b, dd)
        kvc_pylock_release(&self._lock)

    def seq_pos_min(self, seq_id):
        """Smallest position of seq_id, -1 when it holds no cell."""
        cdef int32_t s = seq_c(seq_id, self.c.n_seq_max, "seq_id", False), r
        kvc_pylock_acquire(&self._lock)
        r = kvc_unified_seq_pos_min(&self.c, s)
        kvc_pylock_release(&self._lock)
        return r

    def seq_pos_max(self, seq_id):
        """Largest position of seq_id, -1 when it holds no cell."""
        cdef int32_t s = seq_c(seq_id, self.c.n_seq_max, "seq_id", False), r
        kvc_pylock_acquire(&self._lock)
        r = kvc_unified_seq_pos_max(&self.c, s)
        kvc_pylock_release(&self._lock)
        return r

    def prune_swa(self, seq_id, pmin, pmax):
        """Slide the window of seq_id after a batch that gave it positions pmin..pmax (what an
        iSWA cache does on commit): seq_id leaves every cell that no position up to pmax can see.

        Returns True when fewer than min(n_swa, pmin) cells of seq_id were visible from pmin,
        i.e. the cache holds only part of the window (information may have been lost). Needs a
        cache with a sliding window (ValueError otherwise)."""
        cdef int32_t s = seq_c(seq_id, self.c.n_seq_max, "seq_id", False)
        cdef int32_t a = pos_c(pmin, "pmin"), b = pos_c(pmax, "pmax")
        cdef int r
        _refuse_2026(self, "prune_swa", "find_slot reuses the cells a window has left")
        if self.c.swa_type == KVC_SWA_NONE:
            raise ValueError("prune_swa: the cache has no sliding window (swa_type 'none')")
        lock_change(&self._lock, "prune_swa")
        with nogil:
            r = kvc_unified_prune_swa(&self.c, s, a, b)
            kvc_pylock_release(&self._lock)
        if r < 0:
            raise_status(r, NULL, "prune_swa")
        return r == 1

    # --- K/V data ------------------------------------------------------------------------
    def k(self, il):
        """K of model layer il: a writable view (size, n_embd_k) of float32 / float16 / bfloat16
        (see view_dtype), or (size, row_bytes) uint8 when quantized. Zero-copy into other array
        libraries through DLPack (``torch.from_dlpack(cache.k(il))``)."""
        cdef uint32_t ikv = _layer_index(self, il)
        _require_memory(self, "k")
        _settle(self, "k")
        return self._layer_view(ikv, False)

    def v(self, il):
        """V of model layer il: a view (size, n_embd_v), (n_embd_v, size) when v_trans, or
        (size, row_bytes) uint8 when quantized."""
        cdef uint32_t ikv = _layer_index(self, il)
        _require_memory(self, "v")
        _settle(self, "v")
        return self._layer_view(ikv, True)

    def store(self, il, k_rows, v_rows):
        """Write the K and V rows of the tokens placed by the last successful find_slot.

        il: model layer index. k_rows / v_rows: (n_tokens, n_embd) arrays of the cache dtype
        (float32 is also accepted for f16 / bf16 caches), or (n_tokens, row_bytes) uint8 for
        quantized types; numpy arrays, buffer-protocol objects or CPU tensors (DLPack), used
        without a copy; either may be None. V is transposed on the way in when v_trans."""
        cdef uint32_t ikv = _layer_index(self, il)
        _require_memory(self, "store")
        cdef kvc_layer *lay = &self.c.layers[ikv]       # the layer table is fixed at construction
        cdef bint quant_k = kvc_type_get(self.c.type_k).blck_size != 1
        cdef bint quant_v = kvc_type_get(self.c.type_v).blck_size != 1
        # the rows are taken (and pinned) before the cache is locked: the Python code that may
        # run meanwhile (an exporter's hooks) sees the cache as any other call would
        cdef _HeldBuffer kb = _rows_buffer(k_rows, self.c.type_k, "k_rows")
        cdef _HeldBuffer vb = _rows_buffer(v_rows, self.c.type_v, "v_rows")
        cdef const void *pk = kb.view.buf if kb is not None else NULL
        cdef const void *pv = vb.view.buf if vb is not None else NULL
        # from the lock to the copy no Python code runs: the placement checked is the one written
        cdef uint32_t placed
        cdef int r
        lock_change(&self._lock, "store")
        try:
            placed = kvc_unified_slot_n(&self.c)
            if placed == 0:
                raise RuntimeError("store: no ubatch is placed (call it right after a successful find_slot)")
            if kb is not None:
                _check_rows(kb, placed, lay.k_row_bytes if quant_k else lay.n_embd_k, "k_rows")
            if vb is not None:
                _check_rows(vb, placed, lay.v_row_bytes if quant_v else lay.n_embd_v, "v_rows")
            # a decode step's few rows are copied holding the GIL: releasing it would cost more
            if <size_t>placed * (lay.k_row_bytes + lay.v_row_bytes) <= _SMALL_COPY:
                r = self.store_c(ikv, pk, pv)
            else:
                with nogil:
                    r = self.store_c(ikv, pk, pv)
            check_status(r, NULL, "store")
        finally:
            kvc_pylock_release(&self._lock)
            if kb is not None:
                kb.release()
            if vb is not None:
                vb.release()

    @property
    def size_k_bytes(self):
        """Bytes of K memory over all kept layers."""
        cdef size_t t = 0
        for i in range(self.c.n_layer):
            t += self.c.layers[i].k_row_bytes * self.c.cells.size * self.c.n_stream
        return t

    @property
    def size_v_bytes(self):
        """Bytes of V memory over all kept layers."""
        cdef size_t t = 0
        for i in range(self.c.n_layer):
            t += self.c.layers[i].v_row_bytes * self.c.cells.size * self.c.n_stream
        return t

    @property
    def total_size(self):
        """size_k_bytes + size_v_bytes."""
        return self.size_k_bytes + self.size_v_bytes

    # --- graph inputs --------------------------------------------------------------------
    def kq_mask(self, ub, causal=True, alibi=False, out=None, dtype="f32", pad=None, reuse=False):
        """The KQ mask of ub against the cache. Semantics '2025': [rows, n], rows = pad(n_tokens,
        64) (pad None or True, llama.cpp's layout: the padding rows see nothing) or n_tokens
        (pad=False).

        Semantics '2026' (pad None or False): [streams, rows, n_kv] without padding rows, a
        block of rows per token group over the cells of the group's stream (streams 1 and
        rows n_tokens with one stream), n_kv the largest n_kv_per_stream of those streams.

        dtype "f32" (default) or "f16": 0 where token t sees cell j (-|p_cell - p_token| with
        alibi), -inf elsewhere; "bool": True where it sees the cell (torch's
        scaled_dot_product_attention reads a bool attn_mask the same way: True takes part).
        out: a writable 2-D array of that dtype (a numpy array, a buffer-protocol object or a
        CPU tensor) of at least [rows, n], each row's elements contiguous, rows any stride
        apart (one [rows_cap, cols_cap] buffer serves as n grows). Only out[:rows, :n] is
        written; returned is out when that is its whole shape, else that block (a view).

        reuse=True (a decode loop's mask): out holds the mask this cache last wrote into it,
        untouched since. When this call's mask has the same shape there (dtype, rows, n, row
        stride, padding, causal, the ubatch's token groups and streams), only what changed is
        rewritten: the cells whose position or sequences changed since, and whole rows whose
        sequence or window start moved; anything else (ALiBi, another buffer or shape, a cache
        restored from a state, more changes than a full write costs) writes the whole mask. The
        result is always equal to a fresh mask."""
        cdef UBatch u = ubatch_c(ub)
        cdef bint c_causal = bool_c(causal, "causal"), c_alibi = bool_c(alibi, "alibi")
        cdef bint c_pad = True if pad is None else bool_c(pad, "pad")
        cdef bint c_reuse = bool_c(reuse, "reuse")
        cdef int mdt, r = 0
        cdef uint8_t[::1] o
        cdef void *p = NULL
        cdef Py_ssize_t rows, cols
        cdef size_t stride = 0
        cdef _HeldBuffer ob = None
        try:
            mdt, npdt = _MASK_DTYPES[dtype]
        except (KeyError, TypeError):
            raise ValueError(f"dtype = {dtype!r}: expected one of {', '.join(_MASK_DTYPES)}") from None
        u.check(self.c.n_seq_max, kvc_unified_has_ext(&self.c))
        if c_reuse and out is None:
            raise ValueError("kq_mask: reuse=True needs out (the buffer of the previous mask)")
        if self.c.semantics == KVC_SEM_2026:
            if pad:
                raise ValueError("kq_mask: a cache of semantics '2026' has no padding rows (pad=False)")
            return self._kq_mask_2026(u, c_causal, c_alibi, mdt, npdt, out, c_reuse)
        if out is not None:
            # taken before the lock: an exporter's hooks see the cache as any other call would
            ob = hold_buffer(out, "out", True)
            if (ob.dtype is not npdt and ob.dtype != npdt) or ob.view.ndim != 2 or not _rows_ok(ob):
                raise ValueError(f"out must be a writable 2-D {npdt} array with contiguous rows of at "
                                 f"least (rows, n) (rows = {'pad(n_tokens, 64)' if c_pad else 'n_tokens'}), "
                                 f"got {ob.describe()}")
        op_begin(&self._lock, False, "kq_mask")
        try:
            # the shape follows n, which holds still while the operation runs
            rows = <Py_ssize_t>(kvc_pad_u32(u.c.n_tokens, KVC_KQ_MASK_PAD) if c_pad else u.c.n_tokens)
            cols = <Py_ssize_t>self.c.n
            if ob is None:
                out = np.empty((rows, cols), dtype=npdt)
                if rows * cols:
                    o = out.reshape(-1).view(np.uint8)
                    p = &o[0]
            else:
                if ob.dim(0) < rows or ob.dim(1) < cols:
                    raise ValueError(f"out must be a writable 2-D {npdt} array of shape at least "
                                     f"{(rows, cols)}, got {ob.describe()}")
                p = ob.view.buf
                if rows > 1:
                    stride = <size_t>ob.view.strides[0]
            if rows * cols:
                with nogil:
                    r = kvc_unified_kq_mask_reuse(&self.c, &u.c, c_causal, c_alibi, mdt, c_pad, stride, p, c_reuse)
            res = out if ob is None else _block(out, ob, rows, cols)
        finally:
            op_end(&self._lock)
            if ob is not None:
                ob.release()
        if r < 0:
            raise_status(r, NULL, "kq_mask")
        return res

    def _kq_mask_2026(self, UBatch ub, bint causal, bint alibi, int mdt, object npdt, object out, bint reuse):
        cdef uint32_t strm[256]      # KVC_MAX_SEQ groups at most
        cdef uint32_t ng = 0, nst = 0, n_kv
        cdef kvc_err err
        cdef int r = 0
        cdef uint8_t[::1] o
        cdef void *p = NULL
        cdef _HeldBuffer ob = None
        err.msg[0] = 0
        if out is not None:
            ob = hold_buffer(out, "out", True)
            if (ob.dtype is not npdt and ob.dtype != npdt) or not ob.c_contiguous() or ob.view.ndim != 3:
                raise ValueError(f"out must be a writable C-contiguous {npdt} array of shape "
                                 f"(streams, rows, n_kv), got {ob.describe()}")
        op_begin(&self._lock, False, "kq_mask")
        try:
            r = kvc_unified_groups(&self.c, &ub.c, strm, &ng, &nst, &err)
            if r < 0:
                raise_status(r, &err, "kq_mask")
            n_kv = kvc_unified_kq_mask_2026_n_kv(&self.c, strm, ng)
            shape = (<Py_ssize_t>ng, <Py_ssize_t>nst, <Py_ssize_t>n_kv)
            if ob is None:
                out = np.empty(shape, dtype=npdt)
                if out.size:
                    o = out.reshape(-1).view(np.uint8)
                    p = &o[0]
            else:
                if (ob.dim(0), ob.dim(1), ob.dim(2)) != shape:
                    raise ValueError(f"out must be a writable C-contiguous {npdt} array of shape "
                                     f"{shape}, got {ob.describe()}")
                p = ob.view.buf
            if n_kv:
                with nogil:
                    r = kvc_unified_kq_mask_2026_reuse(&self.c, &ub.c, causal, alibi, mdt, p, reuse, &err)
        finally:
            op_end(&self._lock)
            if ob is not None:
                ob.release()
        if r < 0:
            raise_status(r, &err, "kq_mask")
        return out

    def pos_bucket(self, ub, n_buckets):
        """T5 relative position buckets of ub against the cache: int32 [n_tokens, n]."""
        cdef UBatch u = ubatch_c(ub)
        cdef uint32_t nb = <uint32_t>int_c(n_buckets, "n_buckets", 2, 0x7FFFFFFF)
        cdef int32_t[::1] o
        u.check(self.c.n_seq_max, kvc_unified_has_ext(&self.c))
        if self.c.n_stream != 1:
            raise ValueError("pos_bucket: position buckets need a cache of one stream")
        op_begin(&self._lock, False, "pos_bucket")
        try:
            out = np.empty((u.c.n_tokens, kvc_unified_stream_n_kv(&self.c, 0) if self.c.semantics == KVC_SEM_2026
                            else self.c.n), dtype=np.int32)
            if out.size == 0:
                return out
            o = out.reshape(-1)
            with nogil:
                kvc_unified_pos_bucket(&self.c, &u.c, nb, &o[0])
        finally:
            op_end(&self._lock)
        return out

    def k_shift(self):
        """The per-cell K-shift input: int32 [size] (0 for empty cells); with several streams
        [n_stream * size], stream-major."""
        out = np.empty(self.c.cells.size * self.c.n_stream, dtype=np.int32)
        cdef int32_t[::1] o = out
        with nogil:
            kvc_pylock_acquire_nogil(&self._lock)
            self.k_shift_c(&o[0])
            kvc_pylock_release(&self._lock)
        return out

    def reset_shift(self):
        """Zero every cell's shift and clear has_shift (after the K-shift was applied)."""
        lock_change(&self._lock, "reset_shift")
        self.reset_shift_c()
        kvc_pylock_release(&self._lock)

    # --- defragmentation -----------------------------------------------------------------
    def defrag_sched(self, thold):
        """Request a defrag (do_defrag) when fragmentation exceeds thold (only for n >= 2048)."""
        if not isinstance(thold, (int, float, np.integer, np.floating)) or isinstance(thold, bool):
            raise TypeError(f"thold must be a number, not {type(thold).__name__}")
        cdef float t = <float>float(thold)
        _refuse_2026(self, "defrag_sched", "today's llama.cpp does not defragment")
        lock_change(&self._lock, "defrag_sched")
        kvc_unified_defrag_sched(&self.c, t)
        kvc_pylock_release(&self._lock)

    def defrag_prepare(self, n_max_nodes):
        """Plan a defrag and move the cell metadata; the K/V moves are in defrag_ids.

        n_max_nodes bounds the moves as llama.cpp's graph budget does. True when
        something moves."""
        cdef int32_t nmax = <int32_t>int_c(n_max_nodes, "n_max_nodes", INT32_MIN, INT32_MAX)
        cdef int r
        _refuse_2026(self, "defrag_prepare", "today's llama.cpp does not defragment")
        lock_change(&self._lock, "defrag_prepare")
        with nogil:
            r = kvc_unified_defrag_prepare(&self.c, nmax)
            kvc_pylock_release(&self._lock)
        if r < 0:
            raise_status(r, NULL, "defrag_prepare")
        return r == 1

    @property
    def defrag_ids(self):
        """The last plan (a copy): cell i moves to ids[i]; ids[i] == i or len(ids): stays."""
        cdef uint32_t[::1] o
        op_begin(&self._lock, False, "defrag_ids")
        try:
            out = np.empty(self.c.n_defrag_ids, dtype=np.uint32)
            o = out
            if self.c.n_defrag_ids:
                memcpy(&o[0], self.c.defrag_ids, self.c.n_defrag_ids * sizeof(uint32_t))
        finally:
            op_end(&self._lock)
        return out

    def defrag_runs(self):
        """The last plan as runs: uint32 [n_runs, 3] of (src, dst, count), cells
        [src, src + count) moving to [dst, dst + count). No run reads cells another run writes,
        so they can be applied in any order; defrag_move applies them to the K/V rows (and a
        metadata-only cache's owner to its own memory)."""
        cdef uint32_t n
        cdef uint32_t[:, ::1] o
        op_begin(&self._lock, False, "defrag_runs")
        try:
            n = kvc_unified_defrag_runs(&self.c, NULL)
            out = np.empty((n, 3), dtype=np.uint32)
            o = out
            if n:
                kvc_unified_defrag_runs(&self.c, &o[0, 0])
        finally:
            op_end(&self._lock)
        return out

    def defrag_move(self):
        """Move the K/V rows as the last defrag_prepare planned (once) and clear do_defrag.

        Until then the plan is pending: the next operation that reads or writes K/V data or
        changes the cells (find_slot, store, k/v, sequence operations, clear, state writes and
        reads, update, another defrag_prepare) moves the rows first. A metadata-only cache moves
        nothing: read defrag_runs() right after defrag_prepare and move your rows; any such
        operation drops the plan (defrag_runs() is then empty)."""
        _refuse_2026(self, "defrag_move", "today's llama.cpp does not defragment")
        lock_change(&self._lock, "defrag_move")
        with nogil:
            kvc_unified_defrag_move(&self.c)
            kvc_pylock_release(&self._lock)

    def _check_update(self, rope, n_max_nodes):
        """Raise what update(rope, n_max_nodes) would raise before changing anything."""
        int_c(n_max_nodes, "n_max_nodes", INT32_MIN, INT32_MAX)
        if rope is not None and not isinstance(rope, RopeParams):
            raise TypeError(f"rope must be a RopeParams or None, not {type(rope).__name__}")
        if rope is not None and self._buffers == "none":
            raise ValueError("update: a metadata-only cache holds no K to rotate; call update() "
                             "without rope and apply the plan's k_shift with your own kernels")
        if rope is not None:
            _check_rope(rope, self._n_embd_head_k, self._layers, "rope")

    def update(self, rope=None, n_max_nodes=65536):
        """Apply the pending K-shift, then the scheduled defrag, as llama.cpp's update() does.

        rope: the model's RopeParams (default: the ones given to the constructor): every kept
        layer's K is rotated in place by each cell's shift, with the layer's freq_base /
        freq_scale overrides (needs n_embd_head_k from the constructor). Without any, the model
        has no RoPE and the shifts are dropped. A metadata-only cache rotates and moves nothing:
        apply the returned plan's k_shift, then its defrag_runs, to your own K/V memory.

        Returns an UpdatePlan (true when the data changed or has to, i.e. the graph needs a new
        reservation). Arguments are checked before anything changes."""
        cdef int32_t nmax = <int32_t>int_c(n_max_nodes, "n_max_nodes", INT32_MIN, INT32_MAX)
        self._check_update(rope, n_max_nodes)
        if self.c.semantics == KVC_SEM_2026:
            return self._update_2026(rope, nmax)
        op_begin(&self._lock, True, "update")
        try:
            return _update_caches((self,), rope, nmax)[0]
        finally:
            op_end(&self._lock)

    def _update_2026(self, rope, int32_t nmax):
        # today's update(): the stream copies, then the K-shift (rotated with RoPE when the
        # model has it and the cache holds K, else the shifts are dropped)
        cdef uint32_t copies = 0
        cdef bint had_shift = False, rotated = False, drop
        cdef int32_t[::1] sv
        rp = rope if rope is not None else (self._rope if self._buffers != "none" else None)
        op_begin(&self._lock, True, "update")
        try:
            shift = np.empty(self.c.cells.size * self.c.n_stream, dtype=np.int32)
            sv = shift
            kvc_unified_k_shift(&self.c, &sv[0])
            drop = rp is None
            with nogil:
                had_shift = kvc_unified_update_2026(&self.c, &copies, drop)
            if had_shift and not drop:
                # the copied slabs first, then every stream's rows rotated by their shifts
                rotated = _update_caches((self,), rp, nmax)[0].rotated
        finally:
            op_end(&self._lock)
        return StreamUpdate(0 if had_shift or copies else 1, bool(had_shift), int(copies), False, shift, bool(rotated))

    # --- inspection ----------------------------------------------------------------------
    def cells(self):
        """A snapshot (copies) of every cell's pos, shift and sequence bits: a Cells object (of
        the one stream; with several, see stream_cells())."""
        if self.c.n_stream != 1:
            raise ValueError("cells: the cache has several streams; stream_cells() has one snapshot per stream")
        return self._stream_cells(0)

    def stream_cells(self):
        """One Cells snapshot per stream (a tuple; one entry for a cache of one stream)."""
        return tuple(self._stream_cells(s) for s in range(self.c.n_stream))

    def _stream_cells(self, uint32_t st):
        cdef const kvc_cells *t = kvc_unified_stream_cells_c(&self.c, st)
        cdef Py_ssize_t n = t.size, nw = t.seq_words
        pos = np.empty(n, dtype=np.int32)
        shift = np.empty(n, dtype=np.int32)
        planes = np.empty((nw, n), dtype=np.uint64)     # the table's layout: one plane per word
        ext = np.empty((max(n, 1), 3), dtype=np.int32) if t.ext != NULL else None
        cdef int32_t[::1] vp = pos
        cdef int32_t[::1] vs = shift
        cdef uint64_t[:, ::1] vq = planes
        cdef int32_t[:, ::1] ve
        cdef int32_t *pe = NULL
        if ext is not None:
            ve = ext
            pe = &ve[0, 0]
        with nogil:
            kvc_pylock_acquire_nogil(&self._lock)
            memcpy(&vp[0], t.pos, n * sizeof(int32_t))
            memcpy(&vs[0], t.shift, n * sizeof(int32_t))
            memcpy(&vq[0, 0], t.seq, nw * n * sizeof(uint64_t))
            if pe != NULL:
                memcpy(pe, t.ext, n * sizeof(kvc_cell_ext))
            kvc_pylock_release(&self._lock)
        return Cells(pos, shift, np.ascontiguousarray(planes.T), None if ext is None else ext[:n])

    # --- state ---------------------------------------------------------------------------
    def state_size(self, seq_id=-1, *, layout=DEFAULT_LAYOUT, prefix=None):
        """Bytes state_write(seq_id, layout=layout, prefix=prefix) produces."""
        cdef int32_t s = seq_c(seq_id, self.c.n_seq_max, "seq_id", True)
        cdef unsigned bits = write_layout_bits(layout, prefix, s)
        cdef size_t r
        _check_state_layout(self, bits, "state_size")
        with nogil:
            kvc_pylock_acquire_nogil(&self._lock)
            r = kvc_unified_state_size_lay(&self.c, s, bits)
            kvc_pylock_release(&self._lock)
        return r

    def state_write(self, seq_id=-1, *, layout=DEFAULT_LAYOUT, prefix=None):
        """The state of seq_id (-1: the whole cache) as bytes, in llama.cpp's layout ``layout``
        (a name of kvcache.LAYOUTS; "2026": today's llama.cpp, "2025": llama-cpp-python 0.3.10).
        A sequence's state in a layout with the sequence-blob prefix is what
        ``llama_state_seq_get_data`` returns (the magic, the seq id, the memory state);
        prefix=False gives the memory state alone (what a sequence file holds)."""
        _check_state_layout(self, write_layout_bits(layout, prefix, seq_c(seq_id, self.c.n_seq_max, "seq_id", True)),
                            "state_write")
        return _state_write_parts((self,), seq_id, layout, prefix)

    def state_write_into(self, buf, seq_id=-1, *, layout=DEFAULT_LAYOUT, prefix=None):
        """Write the state of seq_id (-1: the whole cache) into buf; returns the bytes written.

        buf: a writable C-contiguous buffer of at least state_size(seq_id) bytes (bytearray,
        numpy array, mmap, memoryview...), filled from C without an intermediate copy; or a
        binary file object, written in chunks of bounded size. The blob is the state of one
        moment: a change of the cache from the file's write() raises RuntimeError there.
        layout, prefix: as state_write."""
        cdef int32_t s = seq_c(seq_id, self.c.n_seq_max, "seq_id", True)
        cdef unsigned bits = write_layout_bits(layout, prefix, s)
        _check_state_layout(self, bits, "state_write_into")
        target = state_target(buf)      # taken before the lock, like every array argument
        op_begin(&self._lock, False, "state_write_into")
        try:
            return state_write_into(&self.c, _unified_state_range, s, bits,
                                    kvc_unified_state_size_lay(&self.c, s, bits), target)
        finally:
            op_end(&self._lock)
            if isinstance(target, _HeldBuffer):
                (<_HeldBuffer>target).release()

    def state_read(self, data, seq_id=-1, *, convert=False, exact=False, layout=None):
        """Restore a state written by state_write (or llama.cpp) into seq_id (-1: whole cache).

        data: any C-contiguous buffer (bytes, bytearray, memoryview, numpy array, mmap; not
        copied). Returns the bytes consumed (bytes after the state are not read, unless exact).
        convert: accept a blob whose V layout (transposed or not) differs from this cache's and
        convert it (llama.cpp refuses such a blob), in either semantics. exact: the state must
        end at the end of data. layout: a name of kvcache.LAYOUTS, or None (the default) to find it from the
        bytes: the sequence-blob magic says a layout with stream counts; otherwise the state must
        parse to exactly the end of data in one layout (StateError asks for layout= when it does
        in both). A sequence's state may come with or without the sequence-blob prefix. Raises
        StateError on a malformed or incompatible blob, leaving the cache exactly as it was."""
        _check_state_layout(self, read_layout_bits(layout), "state_read", False)
        return _state_read_parts((self,), data, seq_id, convert=convert, exact=exact, layout=layout)


cdef int _unified_state_range(const void *c, int32_t seq_id, unsigned layout, uint64_t offset, uint8_t *out,
                              size_t cap, size_t *written) noexcept nogil:
    # the writer settles a pending defrag first: the cache is not const (state_write_into holds its lock)
    return kvc_unified_state_write_range_lay(<kvc_unified *>c, seq_id, layout, offset, out, cap, written)
