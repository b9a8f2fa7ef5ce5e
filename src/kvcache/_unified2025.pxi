# The unified cache of llama.cpp as of mid-2025 (semantics "2025"): a ubatch in contiguous cells,
# undone by restore until commit; set_full; the SWA pruning of an iSWA cache; defragmentation.


cdef class _Unified2025(_Unified):
    """The mid-2025 unified cache (kvcache.UnifiedCache2025 is the documented public class)."""

    __signature__ = _signatures.ClassSignature(_signatures.unified)   # semantics None: "2025"

    cdef tuple _v_trans_shape(self, Py_ssize_t n_embd_v):
        return (n_embd_v, <Py_ssize_t>self.c.cells.size)

    cdef uint32_t _n_kv(self, uint32_t s) noexcept nogil:
        return self.c.n

    cdef int _place(self, const kvc_ubatch *ub, kvc_err *err) noexcept nogil:
        cdef int r = kvc_unified_find_slot(&self.c, ub)
        if r == 1:
            kvc_unified_commit(&self.c)
        return r

    # --- placement -----------------------------------------------------------------------
    def find_slot(self, ub):
        """Place the ubatch's tokens in contiguous empty cells starting at head.

        Returns True when placed (head is where, ``slot`` the cells), False when there is no
        room; head may move either way, as in llama.cpp. Undo with restore(), keep with commit()."""
        cdef UBatch u = ubatch_c(ub)
        cdef int r = 0
        u.check(self.c.n_seq_max, kvc_unified_has_ext(&self.c))
        lock(&self._lock, CHANGE | REFUSED_AS_BUSY, "find_slot")
        try:
            with nogil:
                r = self.find_slot_c(&u.c)
        finally:
            unlock(&self._lock, CHANGE)
        if r < 0:
            raise_status(r, NULL, "find_slot")
        return r == 1

    def place_seqs(self, pos, n_tokens=1, n_seqs=1):
        """Place, for good, positions ``pos .. pos + n_tokens - 1`` of each of the sequences
        ``0 .. n_seqs - 1`` (a batch of equal rows: row s is sequence s), in one call and
        without a UBatch: the ubatch whose token ``j * n_seqs + s`` is sequence s at position
        ``pos + j`` (one token per group), found a slot for and committed.

        Returns the cell of the first token (the cells are consecutive in token order: ``slot``
        is then ``(cell, n_tokens * n_seqs)``), None when there is no room (nothing placed; as
        after a failed find_slot, ``head`` may have moved). Commits the find_slot calls before
        it too."""
        return self._place_seqs(pos, n_tokens, n_seqs)

    def commit(self):
        """Forget the recovery information of the find_slot calls since the last commit."""
        lock(&self._lock, CHANGE, "commit")
        try:
            kvc_unified_commit(&self.c)
        finally:
            unlock(&self._lock, CHANGE)

    def restore(self):
        """Undo the cell changes of the find_slot calls since the last commit (data is kept):
        the cells are exactly as before those calls (head stays where the search left it, as
        in llama.cpp)."""
        lock(&self._lock, CHANGE, "restore")
        try:
            self.restore_c()
        finally:
            unlock(&self._lock, CHANGE)

    def set_full(self):
        """n = size and head = 0, as when reserving the worst-case graph."""
        lock(&self._lock, CHANGE, "set_full")
        try:
            self.set_full_c()
        finally:
            unlock(&self._lock, CHANGE)

    @property
    def slot(self):
        """(head, n_tokens): the cells [head, head + n_tokens) the last successful find_slot
        put its ubatch in, where that ubatch's K/V rows go; None when no placement is current
        (after restore, a sequence operation, clear, set_full, defrag or a state read)."""
        cdef uint32_t head, placed
        lock(&self._lock, READ, "slot")
        try:
            placed = kvc_unified_slot_n(&self.c)
            head = kvc_unified_slot_cell(&self.c, 0) if placed else 0
        finally:
            unlock(&self._lock, READ)
        if placed == 0:
            return None
        return (head, placed)

    def slot_info(self):
        """Where the last successful find_slot put its tokens: ``[(0, cells)]``, one group in
        stream 0 with the int32 cells of ``slot`` (the form of a cache of semantics '2026',
        whose placements have a group per sequence); ``[]`` when no placement is current."""
        lock(&self._lock, RUNS_PYTHON, "slot_info")
        try:
            cells = self._slot_cells()
        finally:
            unlock(&self._lock, RUNS_PYTHON)
        return [(0, cells)] if len(cells) else []

    def prune_swa(self, seq_id, pmin, pmax):
        """Slide the window of seq_id after a batch that gave it positions pmin..pmax (what an
        iSWA cache does on commit): seq_id leaves every cell that no position up to pmax can see.

        Returns True when fewer than min(n_swa, pmin) cells of seq_id were visible from pmin,
        i.e. the cache holds only part of the window (information may have been lost). Needs a
        cache with a sliding window (ValueError otherwise)."""
        cdef int32_t s = seq_c(seq_id, self.c.n_seq_max, "seq_id", False)
        cdef int32_t a = pos_c(pmin, "pmin"), b = pos_c(pmax, "pmax")
        cdef int r
        if self.c.swa_type == KVC_SWA_NONE:
            raise ValueError("prune_swa: the cache has no sliding window (swa_type 'none')")
        lock(&self._lock, CHANGE, "prune_swa")
        try:
            with nogil:
                r = kvc_unified_prune_swa(&self.c, s, a, b)
        finally:
            unlock(&self._lock, CHANGE)
        if r < 0:
            raise_status(r, NULL, "prune_swa")
        return r == 1

    # --- graph inputs --------------------------------------------------------------------
    def kq_mask(self, ub, causal=True, alibi=False, out=None, dtype="f32", pad=None, reuse=False):
        """The KQ mask of ub against the cache: [rows, n], rows = pad(n_tokens, 64) (pad None or
        True, llama.cpp's layout: the padding rows see nothing) or n_tokens (pad=False).

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
        mdt, npdt = _mask_dtype(dtype)
        u.check(self.c.n_seq_max, kvc_unified_has_ext(&self.c))
        if c_reuse and out is None:
            raise ValueError("kq_mask: reuse=True needs out (the buffer of the previous mask)")
        if out is not None:
            # taken before the lock: an exporter's hooks see the cache as any other call would
            ob = hold_buffer(out, "out", True)
            if (ob.dtype is not npdt and ob.dtype != npdt) or ob.view.ndim != 2 or not _rows_ok(ob):
                raise ValueError(f"out must be a writable 2-D {npdt} array with contiguous rows of at "
                                 f"least (rows, n) (rows = {'pad(n_tokens, 64)' if c_pad else 'n_tokens'}), "
                                 f"got {ob.describe()}")
        lock(&self._lock, RUNS_PYTHON, "kq_mask")
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
            unlock(&self._lock, RUNS_PYTHON)
            if ob is not None:
                ob.release()
        if r < 0:
            raise_status(r, NULL, "kq_mask")
        return res

    # --- defragmentation and update ------------------------------------------------------
    @property
    def do_defrag(self):
        """True when defrag_sched asked for a defragmentation (cleared by defrag_move/update)."""
        cdef bint r
        lock(&self._lock, READ, "do_defrag")
        try:
            r = self.c.do_defrag
        finally:
            unlock(&self._lock, READ)
        return r

    def defrag_sched(self, thold):
        """Request a defrag (do_defrag) when fragmentation exceeds thold (only for n >= 2048)."""
        if not isinstance(thold, (int, float, np.integer, np.floating)) or isinstance(thold, bool):
            raise TypeError(f"thold must be a number, not {type(thold).__name__}")
        cdef float t = <float>float(thold)
        lock(&self._lock, CHANGE, "defrag_sched")
        try:
            kvc_unified_defrag_sched(&self.c, t)
        finally:
            unlock(&self._lock, CHANGE)

    def defrag_prepare(self, n_max_nodes):
        """Plan a defrag and move the cell metadata; the K/V moves are in defrag_ids.

        n_max_nodes bounds the moves as llama.cpp's graph budget does. True when
        something moves."""
        cdef int32_t nmax = <int32_t>int_c(n_max_nodes, "n_max_nodes", INT32_MIN, INT32_MAX)
        cdef int r
        lock(&self._lock, CHANGE, "defrag_prepare")
        try:
            with nogil:
                r = kvc_unified_defrag_prepare(&self.c, nmax)
        finally:
            unlock(&self._lock, CHANGE)
        if r < 0:
            raise_status(r, NULL, "defrag_prepare")
        return r == 1

    @property
    def defrag_ids(self):
        """The last plan (a copy): cell i moves to ids[i]; ids[i] == i or len(ids): stays."""
        cdef uint32_t[::1] o
        lock(&self._lock, RUNS_PYTHON, "defrag_ids")
        try:
            out = np.empty(self.c.n_defrag_ids, dtype=np.uint32)
            o = out
            if self.c.n_defrag_ids:
                memcpy(&o[0], self.c.defrag_ids, self.c.n_defrag_ids * sizeof(uint32_t))
        finally:
            unlock(&self._lock, RUNS_PYTHON)
        return out

    def defrag_runs(self):
        """The last plan as runs: uint32 [n_runs, 3] of (src, dst, count), cells
        [src, src + count) moving to [dst, dst + count). No run reads cells another run writes,
        so they can be applied in any order; defrag_move applies them to the K/V rows (and a
        metadata-only cache's owner to its own memory)."""
        lock(&self._lock, RUNS_PYTHON, "defrag_runs")
        try:
            return _defrag_runs(self)
        finally:
            unlock(&self._lock, RUNS_PYTHON)

    def defrag_move(self):
        """Move the K/V rows as the last defrag_prepare planned (once) and clear do_defrag.

        Until then the plan is pending: the next operation that reads or writes K/V data or
        changes the cells (find_slot, store, k/v, sequence operations, clear, state writes and
        reads, update, another defrag_prepare) moves the rows first. A metadata-only cache moves
        nothing: read defrag_runs() right after defrag_prepare and move your rows; any such
        operation drops the plan (defrag_runs() is then empty)."""
        lock(&self._lock, CHANGE, "defrag_move")
        try:
            with nogil:
                kvc_unified_defrag_move(&self.c)
        finally:
            unlock(&self._lock, CHANGE)

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
        lock(&self._lock, RUNS_PYTHON | CHANGE, "update")
        try:
            return _update_caches((self,), rope, nmax)[0]
        finally:
            unlock(&self._lock, RUNS_PYTHON | CHANGE)
