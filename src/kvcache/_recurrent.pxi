# The recurrent-state cache (Mamba / RWKV): csrc/kvc_recurrent.h behind a Python class.

from kvcache.includes.kvc_recurrent cimport *
from kvcache.includes.kvc_checkpoint cimport *
from libc.stdlib cimport calloc

import warnings as _warnings


cdef object _rec_layer_view(_Recurrent cache, list bufs, object il, bint is_k, object plane=0):
    """Layer il's K or V memory (snapshot plane `plane`) viewed as one row per cell."""
    if not _is_int(il):
        raise TypeError(f"il must be an int, not {type(il).__name__}")
    cdef long long i = int_c(il, "il", LLONG_MIN, LLONG_MAX)
    if not 0 <= i < cache.c.n_layer:
        raise IndexError(f"il = {i} is outside [0, {cache.c.n_layer})")
    cdef Py_ssize_t pl = _rec_plane(cache, plane)
    if cache._buffers == "none":
        raise RuntimeError(f"{'k' if is_k else 'v'}: this cache holds no K/V memory (buffers='none')")
    cdef kvc_layer *L = &cache.c.layers[<uint32_t>i]
    cdef Py_ssize_t size = cache.c.cells.size
    cdef Py_ssize_t row = L.k_row_bytes if is_k else L.v_row_bytes
    cdef Py_ssize_t width = L.n_embd_k if is_k else L.n_embd_v
    buf = bufs[i][pl * size * row:(pl + 1) * size * row]
    dt = _element_dtype(cache.c.type_k if is_k else cache.c.type_v)
    if dt.itemsize == 1:
        return buf.reshape(size, row)
    return _typed_view(buf, dt, (size, width))


cdef Py_ssize_t _rec_plane(_Recurrent cache, object plane) except -1:
    """plane as a snapshot plane of the cache: 0 (the states) .. n_rs_seq."""
    if not _is_int(plane):
        raise TypeError(f"plane must be an int, not {type(plane).__name__}")
    cdef long long p = int_c(plane, "plane", LLONG_MIN, LLONG_MAX)
    if not 0 <= p <= cache.c.n_rs_seq:
        raise ValueError(f"plane = {p} is outside [0, n_rs_seq = {cache.c.n_rs_seq}]")
    return <Py_ssize_t>p


cdef object _rec_rows(object rows, str name, object dt):
    """store() rows in the cache dtype dt; bfloat16 bits are decoded for a float cache. A bf16
    cache without ml_dtypes (dt uint16, its bits) takes bf16 bits as they are and other floats
    rounded to bf16 as the C core rounds them (a cast to uint16 would take their integer part)."""
    a = host_array(rows, name)
    if dt is _U16 and _holds_floats(a.dtype) and not _is_bf16_bits(a.dtype):
        return _f32_to_half(_decoded(a), True)
    return np.ascontiguousarray(_decoded(a) if dt.kind == "f" else a, dtype=dt)


cdef class RecurrentCore:
    """The recurrent cache as other extensions cimport it (_core.pxd): C-level methods only.
    Every instance is a _Recurrent (kvcache.RecurrentCache), which implements them."""

    def __cinit__(self, *args, **kwargs):
        if not isinstance(self, _Recurrent):
            raise TypeError("RecurrentCore is the cimport interface of kvcache.RecurrentCache: create a "
                            "kvcache.RecurrentCache")

    # never reached (every instance is a _Recurrent): inert answers
    cdef int lock_c(self) noexcept nogil:
        return -1
    cdef int unlock_c(self) noexcept nogil:
        return -1
    cdef int find_slot_c(self, const kvc_ubatch *ub) noexcept nogil:
        return KVC_E_INTERNAL
    cdef bint seq_rm_c(self, int32_t seq_id, int32_t p0, int32_t p1) noexcept nogil:
        return False
    cdef int s_copy_c(self, int32_t *out) noexcept nogil:
        return KVC_E_INTERNAL
    cdef int s_mask_c(self, float *out) noexcept nogil:
        return KVC_E_INTERNAL
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


cdef class _Recurrent(RecurrentCore):
    """The recurrent-state cache of Mamba / RWKV style models (llama.cpp's
    ``llama_kv_cache_recurrent``, today ``llama_memory_recurrent``): one cell holds the whole
    state of a sequence.

    ``RecurrentCache(n_seq_max, n_layer, n_embd_k_gqa, n_embd_v_gqa, type_k="f32", type_v="f32",
    kv_size=None, n_embd_k_s=0, n_embd_v_s=0, buffers="owned", semantics="2025", n_rs_seq=0)``
    makes a :class:`RecurrentCache2025` (``semantics="2025"``, the default: llama.cpp as of
    mid-2025, ``s_copy`` / ``s_mask`` move the cells' sources) or a :class:`RecurrentCache2026`
    (``semantics="2026"``: today's, ``find_slot`` stages each cell's source, ``s_copy`` reads it,
    a new state reads the zero row ``rs_z``; rollback snapshots, prefix reuse); both are
    RecurrentCache instances and can be made directly (without ``semantics``). This class has
    what both have; each adds what only its llama.cpp has.

    - ``n_rs_seq`` (a RecurrentCache2026's, at most 64; 0 for a RecurrentCache2025): rollback
      snapshots per state. Each layer's memory holds ``1 + n_rs_seq`` planes of ``kv_size`` rows:
      plane p the states p tokens before the last one (``k(il, plane)``, ``store(..., plane=p)``),
      and ``seq_rm(s, p0, -1)`` with ``0 < p0 <= seq_pos_max(s)`` rolls s back to position
      ``p0 - 1`` (docs/semantics.md, rule C9).

    - ``n_embd_k_gqa`` / ``n_embd_v_gqa`` and ``n_embd_k_s`` / ``n_embd_v_s``: an int or one int
      per layer; a layer's K row holds ``n_embd_k_gqa + n_embd_k_s`` elements (the rolling state),
      its V row ``n_embd_v_gqa + n_embd_v_s`` (the recurrent state).
    - ``kv_size``: number of cells, at least (and by default) ``max(1, n_seq_max)``.
    - ``buffers``: ``"owned"`` (default): the cache owns zero-initialised, 64-byte aligned K
      and V memory per layer (``k(il)`` / ``v(il)`` are numpy views of it); a dict
      ``{layer: (K, V)}`` or a list of one (K, V) pair per layer: host buffers to borrow
      (numpy arrays, memoryviews, CPU tensors with ``__dlpack__``; C-contiguous, writable, of the
      element dtype or raw uint8, at least ``size`` rows); ``None`` / ``"none"``: metadata only
      (``k``, ``v`` and ``store`` raise RuntimeError; ``s_copy`` (and a RecurrentCache2025's
      ``s_mask``) and the placement are the plan for the caller's own memory).

    Valid sequence ids are ``[0, n_seq_max)``; ``seq_rm`` also takes -1 (every sequence, the
    reference semantics: only an empty or the whole range), ``state_write`` / ``state_read``
    take -1 for the whole cache. Any other id raises ValueError and changes nothing.
    """

    cdef kvc_recurrent c           # the C cache: cells, head/n/used, layer table
    cdef bint _ready               # c is initialised (and must be freed)
    cdef list _k                   # per layer: the owned K buffer (uint8, size rows)
    cdef list _v                   # per layer: the owned V buffer (uint8, size rows)
    cdef list _warnings            # messages of the last find_slot
    cdef str _buffers              # buffer mode: "owned", "borrowed" or "none" (metadata only)
    cdef object _borrowed          # borrowed mode: (the caller's (K, V) objects, their _HeldBuffers)
    cdef readonly str type_k       # K type name ("f32", "f16", ...)
    cdef readonly str type_v       # V type name
    cdef kvc_lock _lock            # held by every Python method (see "locking" in _common.pxi)
    cdef uint32_t _imports         # imports into a hybrid memory of this part pending: changes refused
    # a RecurrentCache2026's prefix reuse, here so that the cache frees it however its construction
    # ended (a subclass's fields are not set when this class's __cinit__ raises)
    cdef kvc_ckpt_pool *_ckpt      # the checkpoint pool (NULL: off)
    cdef object _ckpt_mem          # the caller's checkpoint memory (a _HeldBuffer), or None
    cdef object _spill_sink        # write-back at eviction: called with the evicted checkpoints, or None

    __signature__ = _signatures.ClassSignature(_signatures.recurrent, semantics="2025")

    def __cinit__(self, *args, **kwargs):
        # the semantics is the class's (kvcache.RecurrentCache(semantics=...) picks the class)
        if isinstance(self, _Recurrent2026):
            own = "2026"
        elif isinstance(self, _Recurrent2025):
            own = "2025"
        else:
            raise TypeError(f"{type(self).__name__}: create a kvcache.RecurrentCache (or a RecurrentCache2025 / "
                            f"RecurrentCache2026)")
        (n_seq_max, n_layer, n_embd_k_gqa, n_embd_v_gqa, type_k, type_v, kv_size, n_embd_k_s, n_embd_v_s,
         buffers, semantics, n_rs_seq) = _signatures.bind(_signatures.recurrent, type(self), args, kwargs)
        cdef kvc_recurrent_params p
        cdef kvc_err err
        cdef Py_ssize_t il
        self._ready = False
        if kvc_lock_init(&self._lock, &self._imports) != 0:
            raise MemoryError("RecurrentCache: cannot allocate its lock")
        self._k = []
        self._v = []
        self._warnings = []
        # arguments converted to their C types here; their meaning (kv_size at least n_seq_max,
        # widths whole blocks of the type, ...) is kvc_recurrent_init's
        n_seq = int_c(n_seq_max, "n_seq_max", 0, UINT32_MAX)
        n_layer = int_c(n_layer, "n_layer", 0, 65536)
        kv_size = max(1, n_seq) if kv_size is None else int_c(kv_size, "kv_size", 0, UINT32_MAX)
        if semantics is not None and not isinstance(semantics, str):
            raise TypeError(f"semantics must be a str, not {type(semantics).__name__}")
        if semantics is not None and semantics != own:
            raise ValueError(f"semantics = {semantics!r}: a {type(self).__name__} is a cache of semantics '{own}' "
                             f"(kvcache.RecurrentCache(semantics=...) makes the cache of a semantics)")
        n_rs = int_c(n_rs_seq, "n_rs_seq", 0, UINT32_MAX)
        mode = _buffers_mode(buffers)
        tk = type_c(type_k, "type_k").id
        tv = type_c(type_v, "type_v").id
        self.type_k = kvc_type_get(tk).name.decode()
        self.type_v = kvc_type_get(tv).name.decode()
        # a row holds the layer's attention width and its state width
        k_parts = list(zip(widths_arg(n_embd_k_gqa, n_layer, "n_embd_k_gqa"),
                           widths_arg(n_embd_k_s, n_layer, "n_embd_k_s")))
        v_parts = list(zip(widths_arg(n_embd_v_gqa, n_layer, "n_embd_v_gqa"),
                           widths_arg(n_embd_v_s, n_layer, "n_embd_v_s")))
        for kv, parts in (("k", k_parts), ("v", v_parts)):
            for il, (a, b) in enumerate(parts):
                if a + b > INT32_MAX:
                    raise ValueError(f"n_embd_{kv}_gqa + n_embd_{kv}_s = {a} + {b} = {a + b} (layer {il}): expected "
                                     f"at most 2**31 - 1")
        ek = [a + b for a, b in k_parts]
        ev = [a + b for a, b in v_parts]
        wk = np.asarray(ek, dtype=np.uint32)
        wv = np.asarray(ev, dtype=np.uint32)
        cdef uint32_t[::1] wk_v = np.append(wk, np.uint32(0))     # one spare: never empty
        cdef uint32_t[::1] wv_v = np.append(wv, np.uint32(0))
        p.kv_size = <uint32_t>kv_size
        p.n_seq_max = <uint32_t>n_seq
        p.type_k = <int32_t>tk
        p.type_v = <int32_t>tv
        p.n_layer = <uint32_t>n_layer
        p.n_embd_k = &wk_v[0]
        p.n_embd_v = &wv_v[0]
        p.semantics = KVC_REC_2026 if own == "2026" else KVC_REC_2025
        p.n_rs_seq = <uint32_t>n_rs
        err.msg[0] = 0
        check_status(kvc_recurrent_init(&self.c, &p, &err), &err, "RecurrentCache")
        # every plane of every layer: the states and their snapshots
        cdef Py_ssize_t rows = <Py_ssize_t>kv_size * (1 + <Py_ssize_t>n_rs)
        self._ready = True
        self._buffers = mode
        pairs = _buffer_pairs(buffers, tuple(range(n_layer))) if mode == "borrowed" else None
        held = []                       # the borrowed buffers, pinned as long as the cache lives
        self._borrowed = (pairs, held)
        if mode == "none":
            return
        regions = []
        for il in range(n_layer):
            nk = rows * <Py_ssize_t>self.c.layers[il].k_row_bytes
            nv = rows * <Py_ssize_t>self.c.layers[il].v_row_bytes
            if mode == "owned":
                k = _aligned_zeros(nk)
                v = _aligned_zeros(nv)
            else:
                k, hk = _borrowed_bytes(pairs[il][0], nk, tk, f"buffers[{il}] K",
                                        f"{rows} rows x {self.c.layers[il].k_row_bytes} bytes")
                v, hv = _borrowed_bytes(pairs[il][1], nv, tv, f"buffers[{il}] V",
                                        f"{rows} rows x {self.c.layers[il].v_row_bytes} bytes")
                held += [hk, hv]
                regions += [(f"buffers[{il}] K", _data_address(k), nk), (f"buffers[{il}] V", _data_address(v), nv)]
            self._k.append(k)
            self._v.append(v)
        _check_disjoint(regions)
        cdef uint8_t[::1] kb
        cdef uint8_t[::1] vb
        for il in range(n_layer):
            kb = self._k[il]
            vb = self._v[il]
            # zero-width rows have no memory: NULL is a no-op for the C core
            kvc_recurrent_set_layer_buffers(&self.c, <uint32_t>il, &kb[0] if kb.shape[0] else NULL,
                                            &vb[0] if vb.shape[0] else NULL)

    def __dealloc__(self):
        _ckpt_pool_free(self)
        if self._ready:
            kvc_recurrent_free(&self.c)
            self._ready = False
        kvc_lock_free(&self._lock)

    # --- geometry -------------------------------------------------------------------------

    @property
    def size(self) -> int:
        """Number of cells."""
        return self.c.cells.size

    @property
    def head(self) -> int:
        """First cell of the last placed ubatch."""
        cdef uint32_t r
        lock(&self._lock, READ, "head")
        try:
            r = self.c.cells.head
        finally:
            unlock(&self._lock, READ)
        return r

    @property
    def n(self) -> int:
        """Number of cells the last placed ubatch spans."""
        cdef uint32_t r
        lock(&self._lock, READ, "n")
        try:
            r = self.c.cells.n
        finally:
            unlock(&self._lock, READ)
        return r

    @property
    def used(self) -> int:
        """The reference's count of used cells."""
        cdef uint32_t r
        lock(&self._lock, READ, "used")
        try:
            r = self.c.cells.used
        finally:
            unlock(&self._lock, READ)
        return r

    @property
    def n_seq_max(self) -> int:
        """Valid sequence ids are [0, n_seq_max)."""
        return self.c.n_seq_max

    @property
    def n_layer(self) -> int:
        """Number of layers."""
        return self.c.n_layer

    @property
    def semantics(self) -> str:
        """Which llama.cpp's recurrent memory this cache reproduces: '2025' or '2026'."""
        return "2026" if self.c.ops.semantics == KVC_REC_2026 else "2025"

    @property
    def n_rs_seq(self) -> int:
        """Rollback snapshots per state (0: none; always 0 for a RecurrentCache2025)."""
        return self.c.n_rs_seq

    @property
    def buffers(self) -> str:
        """How the K/V memory is held: 'owned', 'borrowed' or 'none' (metadata only)."""
        return self._buffers

    @property
    def can_shift(self) -> bool:
        """Recurrent states cannot be shifted: always False."""
        return False

    @property
    def n_embd_k(self) -> list:
        """K row width of each layer in elements (rolling-state part included)."""
        return [self.c.layers[i].n_embd_k for i in range(self.c.n_layer)]

    @property
    def n_embd_v(self) -> list:
        """V row width of each layer in elements (recurrent-state part included)."""
        return [self.c.layers[i].n_embd_v for i in range(self.c.n_layer)]

    @property
    def size_k_bytes(self) -> int:
        """Bytes of K memory over all layers (snapshot planes included)."""
        return (sum(self.c.layers[i].k_row_bytes for i in range(self.c.n_layer)) * self.c.cells.size
                * (1 + self.c.n_rs_seq))

    @property
    def size_v_bytes(self) -> int:
        """Bytes of V memory over all layers (snapshot planes included)."""
        return (sum(self.c.layers[i].v_row_bytes for i in range(self.c.n_layer)) * self.c.cells.size
                * (1 + self.c.n_rs_seq))

    @property
    def total_size(self) -> int:
        """Bytes of K and V memory."""
        return self.size_k_bytes + self.size_v_bytes

    @property
    def warnings(self) -> list:
        """Warnings of the last find_slot (also issued through ``warnings.warn``)."""
        lock(&self._lock, READ, "warnings")
        try:
            w = self._warnings
        finally:
            unlock(&self._lock, READ)
        return list(w)

    def __repr__(self):
        cdef uint32_t head, n, used
        lock(&self._lock, READ, "__repr__")
        try:
            head, n, used = self.c.cells.head, self.c.cells.n, self.c.cells.used
        finally:
            unlock(&self._lock, READ)
        extra = "" if self.c.ops.semantics == KVC_REC_2025 else f"semantics='2026', n_rs_seq={self.c.n_rs_seq}, "
        return (f"RecurrentCache(size={self.c.cells.size}, n_seq_max={self.c.n_seq_max}, "
                f"n_layer={self.c.n_layer}, type_k={self.type_k!r}, type_v={self.type_v!r}, {extra}"
                f"head={head}, n={n}, used={used})")

    # --- data -----------------------------------------------------------------------------

    def k(self, il, plane=0):
        """Layer il's K memory (rolling states) as a writable view, one row per cell: float32 /
        float16 elements for f32 / f16, uint16 bit patterns for bf16, raw bytes otherwise.
        plane: a snapshot plane (0: the states; p <= n_rs_seq: the states p tokens back)."""
        return _rec_layer_view(self, self._k, il, True, plane)

    def v(self, il, plane=0):
        """Layer il's V memory (recurrent states) as a writable view; see k()."""
        return _rec_layer_view(self, self._v, il, False, plane)

    def store(self, il, k_rows=None, v_rows=None, *, plane=0):
        """Write the states of the ubatch just placed: rows ``[head, head + len(rows))`` of layer
        il get ``k_rows`` / ``v_rows`` (shaped like ``k(il)`` / ``v(il)`` rows; either may be None).
        plane: the snapshot plane written (0: the states; p: the states p tokens before the last,
        which a ubatch of more than p tokens per sequence writes for rollbacks)."""
        if self._buffers == "none":
            raise RuntimeError("store: this cache holds no K/V memory (buffers='none')")
        cdef uint32_t pl = <uint32_t>_rec_plane(self, plane)
        kv = self.k(il)
        vv = self.v(il)
        # the rows as their memory describes them (see host_array), converted to the cache dtype
        ka = None if k_rows is None else _rec_rows(k_rows, "k_rows", kv.dtype)
        va = None if v_rows is None else _rec_rows(v_rows, "v_rows", vv.dtype)
        n_rows = None
        for name, a, ref in (("k_rows", ka, kv), ("v_rows", va, vv)):
            if a is None:
                continue
            if a.ndim != 2 or a.shape[1] != ref.shape[1]:
                raise ValueError(f"{name} must have shape (n_rows, {ref.shape[1]}), not {a.shape}")
            if n_rows is not None and a.shape[0] != n_rows:
                raise ValueError(f"k_rows has {n_rows} rows, v_rows {a.shape[0]}")
            n_rows = a.shape[0]
        if n_rows is None or n_rows == 0:
            return
        cdef const uint8_t[::1] kb
        cdef const uint8_t[::1] vb
        cdef const void *kp = NULL
        cdef const void *vp = NULL
        cdef uint32_t head
        cdef int r
        cdef uint64_t nr = <uint64_t>n_rows
        cdef uint32_t ilc = <uint32_t>int_c(il, "il", 0, UINT32_MAX)
        if ka is not None:
            kb = ka.reshape(-1).view(np.uint8)
            kp = &kb[0]
        if va is not None:
            vb = va.reshape(-1).view(np.uint8)
            vp = &vb[0]
        lock(&self._lock, CHANGE, "store")
        try:
            with nogil:
                # the placement is read and written under the lock, with no Python code between
                head = self.c.cells.head
                r = KVC_E_NOSPACE
                if head + nr <= self.c.cells.size:
                    r = kvc_recurrent_store_plane(&self.c, ilc, pl, <uint32_t>nr, kp, vp)
        finally:
            unlock(&self._lock, CHANGE)
        if r == KVC_E_NOSPACE:
            raise ValueError(f"{n_rows} rows from head {head} pass the last cell ({self.c.cells.size})")
        check_status(r, NULL, "store")

    # --- placement ------------------------------------------------------------------------

    def find_slot(self, ub) -> bool:
        """Place a ubatch (``UBatch(pos, seq_id, n_seq_tokens=k)``: groups of k tokens, one per
        sequence): group g's state ends up in cell ``head + g``. Returns the reference's answer.

        A state that does not continue at the position where it stopped raises a
        RuntimeWarning (the reference logs it). ValueError for ids outside [0, n_seq_max) or an
        empty ubatch; RuntimeError where the reference stops on an assertion: a group's first
        sequence has a record pointing at a cell that does not hold it (left by seq_rm(-1, ...)
        without clear(), or by a find_slot that lost the sequence's state, as the reference
        does: docs/server-loop.md). Errors change nothing."""
        cdef UBatch u = ubatch_c(ub)
        cdef kvc_err err
        cdef int r
        u.check(self.c.n_seq_max)
        if u.c.n_seqs == 0:
            raise ValueError("find_slot: the ubatch has no tokens")
        err.msg[0] = 0
        lock(&self._lock, RUNS_PYTHON | CHANGE, "find_slot")
        try:
            with nogil:
                r = kvc_recurrent_find_slot(&self.c, &u.c, &err)
            check_status(r, &err, "find_slot")
            found = ["find_slot: " + m for m in self.c.warn.decode("utf-8", "replace").split("\n") if m]
            self._warnings = found
        finally:
            unlock(&self._lock, RUNS_PYTHON | CHANGE)
        # issued once the operation is complete (a warning turned into an error interrupts nothing)
        for m in found:
            _warnings.warn(m, RuntimeWarning, stacklevel=2)
        return r == 1

    def prepare(self, ubatches) -> bool:
        """The dry run of placing several ubatches in turn (each against the state holding the
        ones before it), as llama.cpp's prepare: True when every one is placed. The cache is
        left exactly as it was. Every ubatch is checked (ValueError, nothing changed)."""
        cdef kvc_err err
        cdef list ubs = _items(ubatches)
        cdef Py_ssize_t n_ub = len(ubs), u
        cdef kvc_ubatch *arr
        cdef int r
        err.msg[0] = 0
        if n_ub == 0:
            raise ValueError("prepare needs at least one ubatch")
        for u in range(n_ub):
            if not isinstance(ubs[u], UBatch):
                raise TypeError(f"ubatches[{u}] must be a UBatch, not {type(ubs[u]).__name__}")
            (<UBatch>ubs[u]).check(self.c.n_seq_max)
        arr = <kvc_ubatch *>malloc(n_ub * sizeof(kvc_ubatch))
        if arr == NULL:
            raise MemoryError("prepare")
        try:
            for u in range(n_ub):
                arr[u] = (<UBatch>ubs[u]).c
            lock(&self._lock, CHANGE, "prepare")
            try:
                with nogil:
                    r = kvc_recurrent_prepare(&self.c, arr, <uint32_t>n_ub, &err)
            finally:
                unlock(&self._lock, CHANGE)
        finally:
            free(arr)
        if r < 0:
            raise_status(r, &err, "prepare")
        return r == 1

    def commit(self):
        """Accept the last placements (nothing to record for recurrent states)."""
        lock(&self._lock, CHANGE, "commit")
        try:
            kvc_recurrent_commit(&self.c)
        finally:
            unlock(&self._lock, CHANGE)

    def restore(self):
        """Undo uncommitted placements: a no-op, as in the reference (nothing is ever pending)."""
        lock(&self._lock, CHANGE, "restore")
        try:
            kvc_recurrent_restore(&self.c)
        finally:
            unlock(&self._lock, CHANGE)

    def set_full(self):
        """n = size, head = 0 (what a worst-case graph reservation does)."""
        lock(&self._lock, CHANGE, "set_full")
        try:
            kvc_recurrent_set_full(&self.c)
        finally:
            unlock(&self._lock, CHANGE)

    def clear(self):
        """Empty every cell, head = used = 0, zero all K/V memory (n is kept)."""
        lock(&self._lock, CHANGE, "clear")
        try:
            with nogil:
                kvc_recurrent_seq_ops.clear(&self.c)
        finally:
            unlock(&self._lock, CHANGE)

    def defrag_sched(self, thold):
        """Recurrent caches never defragment: a no-op."""

    def update(self):
        """Nothing to apply (no shift, no defrag): returns False."""
        return False

    # --- sequences ------------------------------------------------------------------------

    cdef int _seq(self, object seq_id, str name, bint allow_any) except -2:
        return seq_c(seq_id, self.c.n_seq_max, name, allow_any)

    def seq_rm(self, seq_id, p0=-1, p1=-1) -> bool:
        """Remove positions [p0, p1) of seq_id (p0 < 0: 0, p1 < 0: infinity). A recurrent state
        cannot be cut: False (and no change) when the range splits it. seq_id -1 (every
        sequence) accepts only an empty range or the whole one, and then empties every cell
        but keeps the sequences' state records (follow it with clear()).

        Semantics '2026': a range that takes the tail of the state from ``p0 > 0`` on is a
        rollback to position ``p0 - 1``, accepted (True) when no rollback of seq_id is pending,
        it goes back at most n_rs_seq positions, the state's last ubatch had more tokens than
        that (its snapshot exists) and no other sequence shares the state (rule C9: llama.cpp
        accepts a rollback past the snapshots and leaves an older state); the next s_copy then
        reads that snapshot plane."""
        cdef int32_t s = self._seq(seq_id, "seq_id", True)
        cdef int32_t a = pos_c(p0, "p0")
        cdef int32_t b = pos_c(p1, "p1")
        cdef bint r
        lock(&self._lock, CHANGE, "seq_rm")
        try:
            r = kvc_recurrent_seq_ops.seq_rm(&self.c, s, a, b)
        finally:
            unlock(&self._lock, CHANGE)
        return r

    def seq_cp(self, src, dst, p0=-1, p1=-1):
        """dst shares src's state from now on (dst's own state is dropped; the range is unused,
        a state is copied whole)."""
        cdef int32_t s = self._seq(src, "src", False)
        cdef int32_t d = self._seq(dst, "dst", False)
        cdef int32_t a = pos_c(p0, "p0")
        cdef int32_t b = pos_c(p1, "p1")
        lock(&self._lock, CHANGE, "seq_cp")
        try:
            kvc_recurrent_seq_ops.seq_cp(&self.c, s, d, a, b)
        finally:
            unlock(&self._lock, CHANGE)

    def seq_keep(self, seq_id):
        """Drop every sequence but seq_id."""
        cdef int32_t s = self._seq(seq_id, "seq_id", False)
        lock(&self._lock, CHANGE, "seq_keep")
        try:
            kvc_recurrent_seq_ops.seq_keep(&self.c, s)
        finally:
            unlock(&self._lock, CHANGE)

    def seq_add(self, seq_id, p0, p1, shift):
        """Add shift to the position of seq_id's state when it lies in [p0, p1)."""
        cdef int32_t s = self._seq(seq_id, "seq_id", False)
        cdef int32_t a = pos_c(p0, "p0")
        cdef int32_t b = pos_c(p1, "p1")
        cdef int32_t d = pos_c(shift, "shift")
        lock(&self._lock, CHANGE, "seq_add")
        try:
            kvc_recurrent_seq_ops.seq_add(&self.c, s, a, b, d)
        finally:
            unlock(&self._lock, CHANGE)

    def seq_div(self, seq_id, p0, p1, d):
        """Divide the position of seq_id's state by d (> 0) when it lies in [p0, p1)."""
        cdef int32_t s = self._seq(seq_id, "seq_id", False)
        cdef int32_t a = pos_c(p0, "p0")
        cdef int32_t b = pos_c(p1, "p1")
        cdef int32_t q = pos_c(d, "d")
        if q <= 0:
            raise ValueError(f"d = {d} must be positive")
        lock(&self._lock, CHANGE, "seq_div")
        try:
            kvc_recurrent_seq_ops.seq_div(&self.c, s, a, b, q)
        finally:
            unlock(&self._lock, CHANGE)

    def seq_pos_min(self, seq_id) -> int:
        """Smallest position over the cells holding seq_id, -1 when none."""
        cdef int32_t s = self._seq(seq_id, "seq_id", False), r
        lock(&self._lock, READ, "seq_pos_min")
        try:
            r = kvc_recurrent_seq_pos_min(&self.c, s)
        finally:
            unlock(&self._lock, READ)
        return r

    def seq_pos_max(self, seq_id) -> int:
        """Largest position over the cells holding seq_id, -1 when none."""
        cdef int32_t s = self._seq(seq_id, "seq_id", False), r
        lock(&self._lock, READ, "seq_pos_max")
        try:
            r = kvc_recurrent_seq_pos_max(&self.c, s)
        finally:
            unlock(&self._lock, READ)
        return r

    # --- graph inputs ---------------------------------------------------------------------

    def s_copy(self):
        """int32[n]: for cells head + i, the row whose state is copied in. Semantics '2025':
        a cell; updates the cells' sources in place as the reference does (each copy happens
        once). Semantics '2026': ``plane * size + src`` (the source find_slot staged; plane: a
        pending rollback's, consumed by this call)."""
        cdef int32_t[::1] o
        cdef int r = 0
        lock(&self._lock, RUNS_PYTHON | CHANGE, "s_copy")
        try:
            out = np.empty(self.c.cells.n, dtype=np.int32)
            if self.c.cells.n:
                o = out
                with nogil:
                    r = kvc_recurrent_s_copy(&self.c, self.c.cells.n, &o[0])
                check_status(r, NULL, f"s_copy: head {self.c.cells.head} + n {self.c.cells.n} passes the last cell")
        finally:
            unlock(&self._lock, RUNS_PYTHON | CHANGE)
        return out

    def cell_max(self) -> int:
        """Index + 1 of the last cell with a position and a sequence, or 0."""
        cdef uint32_t r
        lock(&self._lock, READ, "cell_max")
        try:
            with nogil:
                r = kvc_recurrent_cell_max(&self.c)
        finally:
            unlock(&self._lock, READ)
        return r

    def cells(self) -> dict:
        """A snapshot of the cell table: ``pos``, ``src``, ``tail`` (int32 arrays, -1 = none) and
        ``seq_id`` (per cell, its sequence ids ascending)."""
        cdef Py_ssize_t size = self.c.cells.size, nw = self.c.cells.seq_words, i, k
        pos = np.empty(size, dtype=np.int32)
        src = np.empty(size, dtype=np.int32)
        tail = np.empty(size, dtype=np.int32)
        planes = np.empty((nw, size), dtype=np.uint64)     # word w of every cell's set
        cdef int32_t[::1] vp = pos
        cdef int32_t[::1] vs = src
        cdef int32_t[::1] vt = tail
        cdef uint64_t[:, ::1] vw = planes
        lock(&self._lock, READ, "cells")
        try:
            with nogil:
                memcpy(&vp[0], self.c.cells.pos, size * sizeof(int32_t))
                memcpy(&vs[0], self.c.cells.src, size * sizeof(int32_t))
                memcpy(&vt[0], self.c.cells.tail, size * sizeof(int32_t))
                memcpy(&vw[0, 0], self.c.cells.seq, nw * size * sizeof(uint64_t))
        finally:
            unlock(&self._lock, READ)
        words = planes.T.tolist()
        seq = []
        for i in range(size):
            ids = []
            for k in range(nw):
                m = words[i][k]
                ids += [64 * k + b for b in range(64) if (m >> b) & 1]
            seq.append(ids)
        return {"pos": pos, "src": src, "tail": tail, "seq_id": seq}

    # --- state ----------------------------------------------------------------------------

    def state_size(self, seq_id=-1, *, layout=DEFAULT_LAYOUT, prefix=None) -> int:
        """Bytes state_write(seq_id, layout=layout, prefix=prefix) produces."""
        cdef state_codec k
        return cache_state_size(self._state_codec(&k), &k, seq_id, layout, prefix)

    def state_write(self, seq_id=-1, *, layout=DEFAULT_LAYOUT, prefix=None) -> bytes:
        """The state of seq_id (-1: the whole cache) in llama.cpp's layout ``layout`` (a name of
        kvcache.LAYOUTS). The recurrent memory state is the same in every layout; a sequence's
        state of a layout with the sequence-blob prefix starts with it (prefix=False: without)."""
        cdef state_codec k
        return cache_state_write(self._state_codec(&k), &k, seq_id, layout, prefix)

    def _seq_handoff(self, seq_id):
        """Sequence seq_id's state (without the sequence-blob prefix) split for a hand-off: the
        state without its rows (bytes), the rows' offsets in the state (a list of int), and an
        (N, 2) uint64 array of the rows' (address, length) in this cache's memory, in that order
        (address 0 without memory). Rows of 0 bytes are left out. kvcache.hybrid's hand-off."""
        cdef int32_t s = self._seq(seq_id, "seq_id", False)
        cdef uint32_t n = 2 * self.c.n_layer, k, cells
        cdef const uint8_t **rows = <const uint8_t **>PyMem_Malloc(max(n, 1) * sizeof(uint8_t *))
        cdef uint64_t *offs = <uint64_t *>PyMem_Malloc(max(n, 1) * sizeof(uint64_t))
        cdef uint64_t *lens = <uint64_t *>PyMem_Malloc(max(n, 1) * sizeof(uint64_t))
        cdef size_t total, written = 0, at = 0
        cdef uint64_t start = 0, end
        cdef uint8_t *p
        cdef int r = KVC_OK
        if rows == NULL or offs == NULL or lens == NULL:
            PyMem_Free(rows)
            PyMem_Free(offs)
            PyMem_Free(lens)
            raise MemoryError()
        lock(&self._lock, RUNS_PYTHON, "seq_export")
        try:
            total = kvc_recurrent_state_size_lay(&self.c, s, 0)
            cells = kvc_recurrent_seq_rows(&self.c, s, rows, offs, lens)
            keep = [k for k in range(n) if cells and lens[k]]
            rest = total - sum([lens[k] for k in keep])
            out = new_state_bytes(rest, &p)
            regions = np.zeros((len(keep), 2), dtype=np.uint64)
            offsets = []
            # the state around its rows: the pieces between them, back to back
            for j in keep + [None]:
                end = total if j is None else offs[<uint32_t>j]
                if end > start:
                    with nogil:
                        r = kvc_recurrent_state_write_range_lay(&self.c, s, 0, start, p + at, end - start, &written)
                    if r != KVC_OK:
                        break
                    at += written
                if j is not None:
                    k = <uint32_t>j
                    regions[len(offsets)] = (<uint64_t><size_t>rows[k], lens[k])
                    offsets.append(offs[k])
                    start = offs[k] + lens[k]
        finally:
            unlock(&self._lock, RUNS_PYTHON)
            PyMem_Free(rows)
            PyMem_Free(offs)
            PyMem_Free(lens)
        check_status(r, NULL, "seq_export")
        if at != rest:
            raise RuntimeError(f"seq_export wrote {at} bytes of the state's {rest} (internal error)")
        regions.flags.writeable = False
        return out, offsets, regions

    def _import_mark(self, bint begin):
        """Count an import begun (True) or ended (False) into a memory this cache is part of:
        while one is pending, changes are refused as during the cache's own imports."""
        lock(&self._lock, READ, "_import_mark")
        try:
            if begin:
                self._imports += 1
            elif self._imports:
                self._imports -= 1
        finally:
            unlock(&self._lock, READ)

    def state_write_into(self, buf, seq_id=-1, *, layout=DEFAULT_LAYOUT, prefix=None) -> int:
        """Write the state of seq_id (-1: the whole cache) into buf; returns the bytes written.

        buf: a writable C-contiguous buffer of at least state_size(seq_id) bytes, filled from C
        without an intermediate copy, or a binary file object, written in chunks of bounded
        size. The blob is the state of one moment: a change of the cache from the file's write()
        raises RuntimeError there. layout, prefix: as state_write."""
        cdef state_codec k
        return cache_state_write_into(self._state_codec(&k), &k, buf, seq_id, layout, prefix)

    def state_read(self, data, seq_id=-1, *, convert=False, exact=False, layout=None) -> int:
        """Restore one cache state from the front of data (bytes-like, not copied) into seq_id
        (-1: the whole cache); returns the bytes consumed (trailing bytes are not read, unless
        exact: then the state must end at the end of data). convert is accepted for the same
        interface as the attention caches; a recurrent state has no V layout to convert.
        layout: a name of kvcache.LAYOUTS or None (found: the memory state is the same in every
        layout, a sequence-blob prefix is taken when it is there). An empty sequence state
        removes the destination sequence in every layout, as llama.cpp's recurrent memory does.
        Raises StateError when the blob is malformed, truncated or does not fit, and then nothing
        has changed."""
        cdef state_codec k
        return cache_state_read(self._state_codec(&k), &k, data, seq_id, convert, exact, layout)

    cdef list _state_codec(self, state_codec *k):
        """k: this cache's state codec; returns the caches to lock."""
        state_codec_init(k, _recurrent_state_size, _recurrent_state_range, _recurrent_state_read, &self.c,
                         self.c.n_seq_max)
        k.ignore_convert = True
        return [self]

    # --- the prefix store's access to states (kvcache.store; csrc/kvc_checkpoint.h) -----------
    def _state_layout(self):
        """Per layer (R row bytes, S row bytes): a state's bytes in the checkpoint layout are
        every layer's R row then S row, in this order."""
        cdef uint32_t il
        return tuple((int(self.c.layers[il].k_row_bytes), int(self.c.layers[il].v_row_bytes))
                     for il in range(self.c.n_layer))

    def _store_state(self, seq_id):
        """(P, bytes): seq_id's state (the one its next step reads) in the checkpoint layout and
        the tokens it is the state after; (0, None) when it holds none."""
        cdef int32_t s = self._seq(seq_id, "seq_id", False)
        cdef uint8_t *p
        cdef uint32_t n
        if self._buffers == "none":
            raise ValueError("the cache holds no state memory (buffers='none')")
        out = new_state_bytes(kvc_ckpt_state_bytes(&self.c), &p)
        lock(&self._lock, READ, "save")
        try:
            n = kvc_ckpt_copy_seq(&self.c, s, p)
        finally:
            unlock(&self._lock, READ)
        return (int(n), out) if n else (0, None)

    def _store_restore(self, seq_id, n_tokens, state):
        """Sequence seq_id (holding no state) takes ``state`` (bytes of the checkpoint layout) as
        the state after n_tokens tokens, at position n_tokens - 1. ValueError (seq_id holds a
        state), StateError (no free cell): nothing changed."""
        cdef int32_t s = self._seq(seq_id, "seq_id", False)
        cdef uint32_t n = <uint32_t>int_c(n_tokens, "n_tokens", 1, INT32_MAX)
        cdef _HeldBuffer hb = state_data_view(state)
        cdef size_t ln
        cdef const uint8_t *p = state_data_ptr(hb, &ln)
        cdef kvc_err err
        cdef int r
        err.msg[0] = 0
        try:
            if ln != kvc_ckpt_state_bytes(&self.c):
                raise ValueError(f"state holds {ln} bytes, a state of this cache {kvc_ckpt_state_bytes(&self.c)}")
            if self._buffers == "none":
                raise ValueError("the cache holds no state memory (buffers='none')")
            lock(&self._lock, CHANGE, "load")
            try:
                with nogil:
                    r = kvc_ckpt_restore_state(&self.c, s, n, p, &err)
            finally:
                unlock(&self._lock, CHANGE)
        finally:
            hb.release()
        if r == KVC_E_NOSPACE:
            raise StateError(f"load: no free cell for sequence {s}'s state")
        check_status(r, &err, "load")

    # --- C level --------------------------------------------------------------------------

    cdef int lock_c(self) noexcept nogil:
        return lock_for_cimport(&self._lock)

    cdef int unlock_c(self) noexcept nogil:
        return unlock_for_cimport(&self._lock)

    cdef int find_slot_c(self, const kvc_ubatch *ub) noexcept nogil:
        return kvc_recurrent_find_slot(&self.c, ub, NULL)

    cdef bint seq_rm_c(self, int32_t seq_id, int32_t p0, int32_t p1) noexcept nogil:
        return kvc_recurrent_seq_ops.seq_rm(&self.c, seq_id, p0, p1)

    cdef int s_copy_c(self, int32_t *out) noexcept nogil:
        return kvc_recurrent_s_copy(&self.c, self.c.cells.n, out)

    cdef int s_mask_c(self, float *out) noexcept nogil:
        return kvc_recurrent_s_mask(&self.c, self.c.cells.n, out)

    cdef uint32_t head_c(self) noexcept nogil:
        return self.c.cells.head

    cdef uint32_t n_c(self) noexcept nogil:
        return self.c.cells.n

    cdef uint32_t used_c(self) noexcept nogil:
        return self.c.cells.used

    cdef uint32_t size_c(self) noexcept nogil:
        return self.c.cells.size

    cdef uint32_t n_seq_max_c(self) noexcept nogil:
        return self.c.n_seq_max


cdef size_t _recurrent_state_size(void *codec, int32_t seq_id, unsigned layout) noexcept nogil:
    return kvc_recurrent_state_size_lay(<const kvc_recurrent *>(<state_codec *>codec).cache, seq_id, layout)


cdef int _recurrent_state_range(const void *codec, int32_t seq_id, unsigned layout, uint64_t offset, uint8_t *out,
                                size_t cap, size_t *written) noexcept nogil:
    return kvc_recurrent_state_write_range_lay(<const kvc_recurrent *>(<const state_codec *>codec).cache, seq_id,
                                               layout, offset, out, cap, written)


cdef int _recurrent_state_read(void *codec, int32_t seq_id, const uint8_t *data, size_t n, unsigned flags,
                               unsigned layout, size_t *consumed, kvc_err *err) noexcept nogil:
    return kvc_recurrent_state_read_lay(<kvc_recurrent *>(<state_codec *>codec).cache, seq_id, data, n, flags,
                                        layout, consumed, err)


cdef class _CkptPool:
    """A checkpoint pool outside its cache, with what it holds (the caller's memory, the
    write-back sink): a new one not installed yet, or the one a cache let go of. It is freed
    with this object, which the caller drops after unlocking: the memory's and the sink's
    finalizers may call the cache."""
    cdef kvc_ckpt_pool *pool
    cdef object mem            # the caller's memory (a _HeldBuffer, released with it), or None
    cdef object sink           # the write-back sink, or None

    def __dealloc__(self):
        if self.pool != NULL:
            kvc_ckpt_free(self.pool)
            free(self.pool)


cdef _CkptPool _ckpt_swap(_Recurrent cache, _CkptPool p):
    """Install p's pool in the cache (the caller holds its lock; an empty p turns reuse off) and
    put the cache's in p; returns p. Nothing is allocated or let go of: no Python code runs in
    the middle of the caller's operation."""
    cdef kvc_ckpt_pool *pool = cache._ckpt
    cache._ckpt = p.pool
    p.pool = pool
    held = cache._ckpt_mem
    cache._ckpt_mem = p.mem
    p.mem = held
    held = cache._spill_sink
    cache._spill_sink = p.sink
    p.sink = held
    return p


cdef _CkptPool _ckpt_pool_free(_Recurrent cache):
    """Drop the cache's checkpoint pool: returns it (see _CkptPool)."""
    return _ckpt_swap(cache, _CkptPool.__new__(_CkptPool))
