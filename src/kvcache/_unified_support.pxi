# What the unified caches of both semantics share besides their class (_unified.pxi): argument
# checks, the result types (Cells, UpdatePlan, StreamUpdate) and the update of several caches.

from libc.stdint cimport uint16_t
from libc.stdlib cimport malloc, free
from kvcache.includes.kvc_unified cimport *
from kvcache.includes.kvc_cells cimport kvc_cells_reset_shift, kvc_cells_seq_word, kvc_cell_ext
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


cdef tuple _layer_ils(const kvc_layer *layers, uint32_t n):
    """The model indices of a C layer table's layers, in its order (ascending)."""
    return tuple([layers[i].il for i in range(n)])


cdef tuple _kept_layers(const kvc_unified *c):
    """The model indices of the layers the C cache keeps, in its order (ascending)."""
    return _layer_ils(c.layers, c.n_layer)


cdef inline int64_t _layer_key(object il) except? -2:
    """Model layer il as the key of a C layer table's lookup (an int beyond int64, which no table
    holds, as -1); TypeError when il is not an int."""
    cdef int overflow = 0
    cdef long long v
    if PyLong_CheckExact(il):
        v = PyLong_AsLongLongAndOverflow(il, &overflow)
    elif _is_int(il):
        v = PyLong_AsLongLongAndOverflow(PyNumber_Index(il), &overflow)
    else:
        raise TypeError(f"il must be an int (a model layer index), not {type(il).__name__}")
    return -1 if overflow else v


cdef uint32_t _layer_index(_Unified self, object il) except? 0xFFFFFFFF:
    """The index into the C cache's layer table of model layer il (IndexError when not kept)."""
    cdef int64_t ikv = kvc_unified_layer_index(&self.c, _layer_key(il))
    if ikv < 0:
        raise IndexError(f"il = {il} is not a layer of this cache (layers: {list(_kept_layers(&self.c))})")
    return <uint32_t>ikv


cdef int _settle(_Unified self, str what) except -1:
    """Move the rows of a pending defrag before the K/V memory is handed out (a change: refused
    from a callback of another operation on the cache)."""
    lock(&self._lock, READ, what)
    try:
        if self.c.defrag_pending and self._lock.busy:
            raise_busy(what)
        with nogil:
            kvc_unified_defrag_settle(&self.c)
    finally:
        unlock(&self._lock, READ)
    return 0


cdef int _check_state_layout(const kvc_unified *c, unsigned bits, str what, bint writes=True) except -1:
    """A layout without stream counts holds one stream, one without cell extensions writes none
    (the codec refuses them too; a reader leaves the extensions at their defaults)."""
    if c.n_stream > 1 and not bits & (KVC_LAYOUT_STREAMS | KVC_LAYOUT_DETECT):
        raise ValueError(f"{what}: the cache has {c.n_stream} streams; a layout without stream counts "
                         f"holds one (use a layout with them: '2025-08' or later)")
    if writes and kvc_unified_has_ext(c) and not bits & KVC_LAYOUT_EXT_XY:
        raise ValueError(f"{what}: the cache's cells carry the per-cell extension, which layouts before "
                         f"'2026-03' have no room for (it would be lost): use '2026-03' or later")
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
        raise TypeError(f"{name} must have dtype {want}, not {_dtype_name(dt)}")
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
        il = self.c.layers[i].il
        lr.hd[i] = self._n_embd_head_k[il]
        try:
            rope.fill(&lr.params[i], il, lr.hd[i])
        except ValueError as e:
            raise ValueError(f"update: layer {il}: {e}") from None
    return lr


cdef list _update_caches(tuple cs, object rope, int32_t nmax):
    """update() of the caches in cs (whose locks the caller holds), all or nothing (C checks and
    allocates every rotation before the first cache changes): an UpdatePlan of each, a
    StreamUpdate of a cache of semantics '2026' (its stream copies run first)."""
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
        opts[k].stream_copies = isinstance(c, _Unified2026)
        shift = None
        if kvc_unified_any_shift(&c.c) or opts[k].stream_copies:   # a StreamUpdate's shift is always there
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
        if opts[k].stream_copies:
            plans.append(StreamUpdate(0 if res[k].shifted or res[k].copies else 1, res[k].shifted, int(res[k].copies),
                                      False, shifts[k], res[k].rotated))
            continue
        runs = _defrag_runs(c) if res[k].defragged else None
        plans.append(UpdatePlan(shifts[k] if res[k].shifted else None, res[k].rotated, runs, res[k].moved,
                                res[k].need_reserve))
    return plans



cdef object _defrag_runs(_Unified c):
    """The last defrag plan of c as uint32 [n_runs, 3] runs (src, dst, count); the caller holds
    c's lock."""
    cdef uint32_t n = kvc_unified_defrag_runs(&c.c, NULL)
    cdef uint32_t[:, ::1] o
    out = np.empty((n, 3), dtype=np.uint32)
    if n:
        o = out
        kvc_unified_defrag_runs(&c.c, &o[0, 0])
    return out


cdef tuple _mask_dtype(object dtype):
    """kq_mask's dtype argument: (the C mask type, the numpy dtype)."""
    try:
        return _MASK_DTYPES[dtype]
    except (KeyError, TypeError):
        raise ValueError(f"dtype = {dtype!r}: expected one of {', '.join(_MASK_DTYPES)}") from None
