# The unified KV cache: UnifiedCore (the cimport interface) and _Unified, what the caches of both
# semantics share (construction, the sequence operations, K/V memory, masks, inspection, state);
# _unified2025.pxi and _unified2026.pxi hold what only one semantics has.

cdef class UnifiedCore:
    """The unified KV cache as other extensions cimport it (_core.pxd): C-level methods only.
    Every instance is a _Unified2025 or _Unified2026 (kvcache.UnifiedCache2025 / UnifiedCache2026),
    which implement them."""

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
    """What the unified caches of both semantics share (see kvcache.UnifiedCache for the
    documented public class); every instance is a _Unified2025 or a _Unified2026."""
    cdef kvc_unified c             # the C cache: cells, head/n, recovery, defrag plan, layer table
    cdef bint _ready               # c is initialised (kvc_unified_free is due)
    cdef uint32_t _n_layer_model   # model layer count given to the constructor
    cdef list _k_mem               # per kept layer: K memory as uint8 (owned, aligned; borrowed: None until
                                   # a view is made); empty without memory
    cdef list _v_mem               # per kept layer: V memory likewise
    cdef list _k_view              # per kept layer: K as the cache dtype, (size, n_embd_k) or (size, row_bytes)
    cdef list _v_view              # per kept layer: V likewise, (n_embd_v, size) when v_trans
    cdef str _buffers              # buffer mode: "owned", "borrowed" or "none" (metadata only)
    cdef object _borrowed          # borrowed mode: (the caller's (K, V) objects, their _HeldBuffers) per kept layer
    cdef tuple _n_embd_head_k      # K head size per model layer, or None (needed by the RoPE K-shift)
    cdef object _rope              # the model's RopeParams, or None (update() rotates K with them)
    cdef kvc_lock _lock            # held by every Python method (see "locking" in _common.pxi)

    # kvcache.UnifiedCache's (semantics: "2025" unless given); each semantics' class has its own
    __signature__ = _signatures.ClassSignature(_signatures.unified, semantics="2025")

    def __cinit__(self, *args, **kwargs):
        # the semantics is the class's (kvcache.UnifiedCache(semantics=...) picks the class)
        if isinstance(self, _Unified2026):
            own = "2026"
        elif isinstance(self, _Unified2025):
            own = "2025"
        else:
            raise TypeError(f"{type(self).__name__}: create a kvcache.UnifiedCache (or a UnifiedCache2025 / "
                            f"UnifiedCache2026)")
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
        if kvc_lock_init(&self._lock, &self.c.imports) != 0:
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
        if semantics is not None and not isinstance(semantics, str):
            raise TypeError(f"semantics must be a str, not {type(semantics).__name__}")
        if semantics is not None and semantics != own:
            raise ValueError(f"semantics = {semantics!r}: a {type(self).__name__} is a cache of semantics '{own}' "
                             f"(kvcache.UnifiedCache(semantics=...) makes the cache of a semantics)")
        if not isinstance(kv_unified, (bool, np.bool_, int, np.integer)):
            raise TypeError(f"kv_unified must be a bool, not {type(kv_unified).__name__}")
        cell_ext_ = bool_arg(cell_ext, "cell_ext")
        if cell_ext_ and own != "2026":
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
        p.semantics = KVC_SEM_2026 if own == "2026" else KVC_SEM_2025
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
        elif self.c.v_trans:
            view = _typed_view(mem, dt, self._v_trans_shape(lay.n_embd_v))
        else:
            view = _typed_view(mem, dt, (rows, lay.n_embd_v))
        views[i] = view
        return view

    # --- what each semantics does its own way (_Unified2025 / _Unified2026 override them) -----
    cdef tuple _v_trans_shape(self, Py_ssize_t n_embd_v):
        """The shape of a transposed V view."""
        raise NotImplementedError

    cdef uint32_t _n_kv(self, uint32_t s) noexcept nogil:
        """The cells the attention spans in stream s (the KQ mask's columns)."""
        return 0

    cdef object _slot_cells(self):
        # the cells of the current placement in token order, a new int32 array (empty when no
        # placement is current): slot_indices' and slot_info's; the caller holds the lock as
        # RUNS_PYTHON (the array's allocation may run finalizers: none may place meanwhile)
        cdef uint32_t n = kvc_unified_slot_n(&self.c)
        cdef int32_t[::1] o
        cells = np.empty(n, dtype=np.int32)
        if n:
            o = cells
            kvc_unified_slot_cells(&self.c, &o[0])
        return cells

    cdef int _place(self, const kvc_ubatch *ub, kvc_err *err) noexcept nogil:
        """Place a (checked) ubatch for good: 1 placed, 0 no room (nothing placed), < 0 error."""
        return KVC_E_INTERNAL

    # every UnifiedCache has these, each semantics' class its own (with its own docstring);
    # no instance is of this class alone
    def find_slot(self, ub):
        """Place the ubatch's tokens in the cells: True when placed, False when there is no room
        (UnifiedCache2025.find_slot: contiguous, undone by restore; UnifiedCache2026.find_slot:
        scattered and final)."""
        raise NotImplementedError("find_slot")

    def place_seqs(self, pos, n_tokens=1, n_seqs=1):
        """Place positions ``pos .. pos + n_tokens - 1`` of the sequences ``0 .. n_seqs - 1``
        in one call (see UnifiedCache2025.place_seqs / UnifiedCache2026.place_seqs)."""
        raise NotImplementedError("place_seqs")

    def slot_info(self):
        """Where the last successful find_slot put each token, per token group: a list of
        ``(stream, int32 cells)`` (see UnifiedCache2025.slot_info / UnifiedCache2026.slot_info)."""
        raise NotImplementedError("slot_info")

    def kq_mask(self, ub, causal=True, alibi=False, out=None, dtype="f32", pad=None, reuse=False):
        """The KQ mask of ub against the cache, in each semantics' layout (see
        UnifiedCache2025.kq_mask / UnifiedCache2026.kq_mask)."""
        raise NotImplementedError("kq_mask")

    def attention_indices(self, ub, causal=True, positions=False, out=None):
        """The cells each query token group of ub attends to, as the CSR arrays of paged
        attention (FlashInfer's page table with pages of one cell, or a gather per group for
        torch's scaled_dot_product_attention): an AttentionIndices. Exactly the cells kq_mask
        shows each token (the same causal, sliding-window and 2-D rules), found through each
        sequence's cells, so a step costs what its sequences hold, not the whole cache.

        ub must be the ubatch the last find_slot placed (ValueError otherwise: a sequence
        operation since forgets the placement). causal: as kq_mask's; every group of several
        tokens is then causal by index order (the rows ordered by position), and a run of
        tokens whose mask that rule does not reproduce (holes or repeats in its positions,
        tokens out of order, a sliding window, 2-D positions) comes as one group per token.
        positions=True adds each row's position (kv_pos, for ALiBi). out: an AttentionIndices
        of arrays to fill (AttentionIndices.buffers), reused step after step; the result's
        arrays are views of it (ValueError naming the array that is too small or of the wrong
        dtype)."""
        return _attention_indices(self, ub, causal, positions, out)

    def update(self, rope=None, n_max_nodes=65536):
        """Apply what is pending before the next decode: the K-shift (and UnifiedCache2025's
        scheduled defrag, UnifiedCache2026's stream copies); see each class's update."""
        raise NotImplementedError("update")

    def __dealloc__(self):
        if self._ready:
            kvc_unified_free(&self.c)
            self._ready = False
        kvc_lock_free(&self._lock)

    def __repr__(self):
        cdef uint32_t head, n, used
        lock(&self._lock, READ, "__repr__")
        try:
            head, n, used = self.c.head, self.c.n, self.c.cells.used
        finally:
            unlock(&self._lock, READ)
        return (f"{type(self).__name__}(kv_size={self.c.cells.size}, n_layer={self._n_layer_model}, "
                f"layers={list(self.layers)}, type_k={self.type_k!r}, type_v={self.type_v!r}, "
                f"v_trans={bool(self.c.v_trans)}, n_seq_max={self.c.n_seq_max}, head={head}, "
                f"n={n}, used={used})")

    # --- C-level operations (declared in _core.pxd) ---------------------------------------
    cdef int lock_c(self) noexcept nogil:
        return lock_for_cimport(&self._lock)

    cdef int unlock_c(self) noexcept nogil:
        return unlock_for_cimport(&self._lock)

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
        lock(&self._lock, READ, "head")
        try:
            r = self.c.head
        finally:
            unlock(&self._lock, READ)
        return r

    @property
    def n(self):
        """Number of cells the attention looks at (the KQ mask's columns): the largest of
        n_kv_per_stream."""
        cdef uint32_t r, s
        lock(&self._lock, READ, "n")
        try:
            r = self.c.n
            for s in range(self.c.n_stream):
                r = max(r, self._n_kv(s))
        finally:
            unlock(&self._lock, READ)
        return r

    @property
    def used(self):
        """Number of non-empty cells (of every stream)."""
        cdef uint32_t r = 0, s
        lock(&self._lock, READ, "used")
        try:
            for s in range(self.c.n_stream):
                r += kvc_unified_stream_cells_c(&self.c, s).used
        finally:
            unlock(&self._lock, READ)
        return r

    # --- streams (semantics '2026'; one stream otherwise) ---------------------------------
    @property
    def semantics(self):
        """'2025' (llama.cpp as of mid-2025: contiguous placement, commit/restore, defrag) or '2026'
        (today's llama.cpp: streams, scattered placement, stream copies)."""
        return "2026" if self.c.ops.semantics == KVC_SEM_2026 else "2025"

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
        lock(&self._lock, RUNS_PYTHON, "_per_stream")
        try:
            for s in range(self.c.n_stream):
                t = kvc_unified_stream_cells_c(&self.c, s)
                if what == 0:
                    out.append(kvc_unified_stream_head_c(&self.c, s))
                elif what == 1:
                    out.append(t.used)
                elif what == 2:
                    out.append(t.used_max_p1)
                else:
                    out.append(self._n_kv(s))
        finally:
            unlock(&self._lock, RUNS_PYTHON)
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
        return _kept_layers(&self.c)

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

    def slot_indices(self, out=None):
        """The cell of each token the last successful find_slot placed, in token order: an int32
        array (empty when no placement is current). Index K/V memory kept
        elsewhere with it, e.g. ``k_dev[il].index_copy_(0, idx, k_rows)``. With several
        streams the cells are those of each token's stream (``slot_info()`` has the streams;
        the K/V row of a cell c of stream s is ``s * size + c``).

        out: a writable 1-D int32 or int64 buffer (numpy, buffer protocol or a CPU tensor: int64
        is what torch's index ops take) of at least that length; its first slot_n elements are
        written and returned as for kq_mask (out itself when that is all of it)."""
        cdef _HeldBuffer ob = None
        cdef uint32_t n, t, head
        cdef int64_t *p64
        if out is not None:
            ob = hold_buffer(out, "out", True)
            if ob.dtype not in (np.dtype(np.int32), np.dtype(np.int64)) or ob.view.ndim != 1 or not _rows_ok(ob):
                raise ValueError(f"out must be a writable contiguous 1-D int32 or int64 array, got {ob.describe()}")
        lock(&self._lock, RUNS_PYTHON, "slot_indices")
        try:
            if ob is None:
                return self._slot_cells()
            n = kvc_unified_slot_n(&self.c)
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
            unlock(&self._lock, RUNS_PYTHON)
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
        lock(&self._lock, RUNS_PYTHON, "seq_cells")
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
            unlock(&self._lock, RUNS_PYTHON)
        if r < 0:
            raise_status(r, NULL, "seq_cells")
        return cells, pos

    @property
    def has_shift(self):
        """True when positions were shifted since the last reset_shift (a K-shift is due), in
        any stream."""
        cdef bint r
        lock(&self._lock, READ, "has_shift")
        try:
            r = kvc_unified_any_shift(&self.c)
        finally:
            unlock(&self._lock, READ)
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
        lock(&self._lock, CHANGE, "n_threads")
        try:
            r = kvc_unified_set_n_threads(&self.c, n, &err)
        finally:
            unlock(&self._lock, CHANGE)
        check_status(r, &err, "n_threads")

    @property
    def fragmentation(self):
        """The fragmentation defrag_sched measures: max(0, 1 - (used + n_pad) / n) (0 while n is
        0), in llama.cpp's float32 arithmetic. defrag_sched takes it as 0 below n = 2048."""
        cdef float r
        lock(&self._lock, READ, "fragmentation")
        try:
            r = kvc_unified_fragmentation(&self.c)
        finally:
            unlock(&self._lock, READ)
        return r

    # --- slots and sequences -------------------------------------------------------------
    cdef object _place_seqs(self, object pos, object n_tokens, object n_seqs):
        """place_seqs of either semantics: the ubatch of equal rows, placed by _place; the cell of
        the first token when the cells are consecutive in token order, -1 when not, None when
        there is no room."""
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
            lock(&self._lock, CHANGE, "place_seqs")
            try:
                with nogil:
                    r = self._place(&ub, &err)
                    if r == 1:
                        first = kvc_unified_slot_cell(&self.c, 0)
                        for t in range(1, <uint32_t>n):
                            if kvc_unified_slot_cell(&self.c, t) != first + t:
                                first = UINT32_MAX
                                break
            finally:
                unlock(&self._lock, CHANGE)
        finally:
            if mem != small:
                PyMem_Free(mem)
        if r < 0:
            raise_status(r, &err, "place_seqs")
        if r == 0:
            return None
        return -1 if first == UINT32_MAX else first

    def clear(self):
        """Empty every cell, reset shifts, head = 0 and zero the K/V memory (n is kept)."""
        lock(&self._lock, CHANGE, "clear")
        try:
            with nogil:
                self.clear_c()
        finally:
            unlock(&self._lock, CHANGE)

    def seq_rm(self, seq_id, p0=-1, p1=-1):
        """Remove seq_id (-1: every sequence) from the cells with p0 <= pos < p1.

        p0 < 0 means 0, p1 < 0 means no upper bound. Returns True."""
        cdef int32_t s = seq_c(seq_id, self.c.n_seq_max, "seq_id", True)
        cdef int32_t a = pos_c(p0, "p0"), b = pos_c(p1, "p1")
        cdef bint r
        lock(&self._lock, CHANGE, "seq_rm")
        try:
            r = self.seq_rm_c(s, a, b)
        finally:
            unlock(&self._lock, CHANGE)
        return r

    def seq_cp(self, src, dst, p0=-1, p1=-1):
        """Add dst to every cell of src with p0 <= pos < p1."""
        cdef int32_t s = seq_c(src, self.c.n_seq_max, "src", False)
        cdef int32_t d = seq_c(dst, self.c.n_seq_max, "dst", False)
        cdef int32_t a = pos_c(p0, "p0"), b = pos_c(p1, "p1")
        cdef kvc_err err
        cdef int r
        err.msg[0] = 0
        lock(&self._lock, CHANGE, "seq_cp")
        try:
            r = kvc_unified_seq_cp_check(&self.c, s, d, a, b, &err)
            if r == KVC_OK:
                self.seq_cp_c(s, d, a, b)
        finally:
            unlock(&self._lock, CHANGE)
        check_status(r, &err, "seq_cp")

    def seq_keep(self, seq_id):
        """Keep only seq_id: cells without it are emptied, cells with it hold only it."""
        cdef int32_t s = seq_c(seq_id, self.c.n_seq_max, "seq_id", False)
        lock(&self._lock, CHANGE, "seq_keep")
        try:
            self.seq_keep_c(s)
        finally:
            unlock(&self._lock, CHANGE)

    def seq_add(self, seq_id, p0, p1, shift):
        """Add shift to the positions of seq_id in [p0, p1); cells pushed below 0 are emptied."""
        cdef int32_t s = seq_c(seq_id, self.c.n_seq_max, "seq_id", False)
        cdef int32_t a = pos_c(p0, "p0"), b = pos_c(p1, "p1")
        cdef int32_t d = pos_c(shift, "shift")
        lock(&self._lock, CHANGE, "seq_add")
        try:
            self.seq_add_c(s, a, b, d)
        finally:
            unlock(&self._lock, CHANGE)

    def seq_div(self, seq_id, p0, p1, d):
        """Integer-divide the positions of seq_id in [p0, p1) by d (> 0)."""
        cdef int32_t s = seq_c(seq_id, self.c.n_seq_max, "seq_id", False)
        cdef int32_t a = pos_c(p0, "p0"), b = pos_c(p1, "p1")
        cdef int32_t dd = divisor_c(d)
        lock(&self._lock, CHANGE, "seq_div")
        try:
            self.seq_div_c(s, a, b, dd)
        finally:
            unlock(&self._lock, CHANGE)

    def seq_pos_min(self, seq_id):
        """Smallest position of seq_id, -1 when it holds no cell."""
        cdef int32_t s = seq_c(seq_id, self.c.n_seq_max, "seq_id", False), r
        lock(&self._lock, READ, "seq_pos_min")
        try:
            r = kvc_unified_seq_pos_min(&self.c, s)
        finally:
            unlock(&self._lock, READ)
        return r

    def seq_pos_max(self, seq_id):
        """Largest position of seq_id, -1 when it holds no cell."""
        cdef int32_t s = seq_c(seq_id, self.c.n_seq_max, "seq_id", False), r
        lock(&self._lock, READ, "seq_pos_max")
        try:
            r = kvc_unified_seq_pos_max(&self.c, s)
        finally:
            unlock(&self._lock, READ)
        return r

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
        lock(&self._lock, CHANGE, "store")
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
            unlock(&self._lock, CHANGE)
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
    def pos_bucket(self, ub, n_buckets):
        """T5 relative position buckets of ub against the cache: int32 [n_tokens, n]."""
        cdef UBatch u = ubatch_c(ub)
        cdef uint32_t nb = <uint32_t>int_c(n_buckets, "n_buckets", 2, 0x7FFFFFFF)
        cdef int32_t[::1] o
        u.check(self.c.n_seq_max, kvc_unified_has_ext(&self.c))
        if self.c.n_stream != 1:
            raise ValueError("pos_bucket: position buckets need a cache of one stream")
        lock(&self._lock, RUNS_PYTHON, "pos_bucket")
        try:
            out = np.empty((u.c.n_tokens, self._n_kv(0)), dtype=np.int32)
            if out.size == 0:
                return out
            o = out.reshape(-1)
            with nogil:
                kvc_unified_pos_bucket(&self.c, &u.c, nb, &o[0])
        finally:
            unlock(&self._lock, RUNS_PYTHON)
        return out

    def k_shift(self):
        """The per-cell K-shift input: int32 [size] (0 for empty cells); with several streams
        [n_stream * size], stream-major."""
        out = np.empty(self.c.cells.size * self.c.n_stream, dtype=np.int32)
        cdef int32_t[::1] o = out
        lock(&self._lock, READ, "k_shift")
        try:
            with nogil:
                self.k_shift_c(&o[0])
        finally:
            unlock(&self._lock, READ)
        return out

    def reset_shift(self):
        """Zero every cell's shift and clear has_shift (after the K-shift was applied)."""
        lock(&self._lock, CHANGE, "reset_shift")
        try:
            self.reset_shift_c()
        finally:
            unlock(&self._lock, CHANGE)

    # --- update --------------------------------------------------------------------------
    def _check_update(self, rope, n_max_nodes):
        """Raise what update(rope, n_max_nodes) would raise before changing anything."""
        int_c(n_max_nodes, "n_max_nodes", INT32_MIN, INT32_MAX)
        if rope is not None and not isinstance(rope, RopeParams):
            raise TypeError(f"rope must be a RopeParams or None, not {type(rope).__name__}")
        if rope is not None and self._buffers == "none":
            raise ValueError("update: a metadata-only cache holds no K to rotate; call update() "
                             "without rope and apply the plan's k_shift with your own kernels")
        if rope is not None:
            _check_rope(rope, self._n_embd_head_k, _kept_layers(&self.c), "rope")

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
        cdef Py_ssize_t n = t.size, nw = t.seq_words, i, w
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
        lock(&self._lock, READ, "_stream_cells")
        try:
            with nogil:
                memcpy(&vp[0], t.pos, n * sizeof(int32_t))
                memcpy(&vs[0], t.shift, n * sizeof(int32_t))
                for w in range(nw):
                    for i in range(n):
                        vq[w, i] = kvc_cells_seq_word(t, <uint32_t>i, <uint32_t>w)
                if pe != NULL:
                    memcpy(pe, t.ext, n * sizeof(kvc_cell_ext))
        finally:
            unlock(&self._lock, READ)
        return Cells(pos, shift, np.ascontiguousarray(planes.T), None if ext is None else ext[:n])

    # --- state ---------------------------------------------------------------------------
    def state_size(self, seq_id=-1, *, layout=DEFAULT_LAYOUT, prefix=None):
        """Bytes state_write(seq_id, layout=layout, prefix=prefix) produces."""
        cdef state_codec k
        return cache_state_size(self._state_codec(&k), &k, seq_id, layout, prefix)

    def state_write(self, seq_id=-1, *, layout=DEFAULT_LAYOUT, prefix=None):
        """The state of seq_id (-1: the whole cache) as bytes, in llama.cpp's layout ``layout``
        (a name of kvcache.LAYOUTS; "2026": today's llama.cpp, "2025": llama-cpp-python 0.3.10).
        A sequence's state in a layout with the sequence-blob prefix is what
        ``llama_state_seq_get_data`` returns (the magic, the seq id, the memory state);
        prefix=False gives the memory state alone (what a sequence file holds)."""
        cdef state_codec k
        return cache_state_write(self._state_codec(&k), &k, seq_id, layout, prefix)

    def state_write_into(self, buf, seq_id=-1, *, layout=DEFAULT_LAYOUT, prefix=None):
        """Write the state of seq_id (-1: the whole cache) into buf; returns the bytes written.

        buf: a writable C-contiguous buffer of at least state_size(seq_id) bytes (bytearray,
        numpy array, mmap, memoryview...), filled from C without an intermediate copy; or a
        binary file object, written in chunks of bounded size. The blob is the state of one
        moment: a change of the cache from the file's write() raises RuntimeError there.
        layout, prefix: as state_write."""
        cdef state_codec k
        return cache_state_write_into(self._state_codec(&k), &k, buf, seq_id, layout, prefix)

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
        cdef state_codec k
        return cache_state_read(self._state_codec(&k), &k, data, seq_id, convert, exact, layout)

    cdef list _state_codec(self, state_codec *k):
        """k: this cache's state codec (a blob of one part); returns the caches to lock."""
        state_codec_parts(k, (self,))
        k.check_read_layout = True
        return [self]
