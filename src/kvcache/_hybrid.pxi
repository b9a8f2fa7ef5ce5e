# _hybrid: the hybrid memory of models mixing attention and recurrent layers (kvcache.HybridCache):
# a UnifiedCache of semantics "2026" (with a sliding window, an ISWACache2026) for the attention
# layers and a RecurrentCache of semantics "2026" for the recurrent ones, driven together by the
# rules of csrc/kvc_hybrid.h.

from kvcache.includes.kvc_hybrid cimport (kvc_hybrid, kvc_hybrid_init, kvc_hybrid_init_iswa, kvc_hybrid_find_slot,
                                          kvc_hybrid_clear,
                                          kvc_hybrid_seq_rm, kvc_hybrid_seq_cp, kvc_hybrid_seq_keep,
                                          kvc_hybrid_seq_add, kvc_hybrid_seq_div, kvc_hybrid_seq_pos_min,
                                          kvc_hybrid_seq_pos_max, kvc_hybrid_attn_layer, kvc_hybrid_recr_layer)
from kvcache.includes.kvc_hybrid_state cimport (KVC_HYBRID_BOTH, KVC_HYBRID_PARTIAL_ONLY, kvc_hybrid_state_init,
                                                kvc_hybrid_state_size, kvc_hybrid_state_write_range,
                                                kvc_hybrid_state_read)


cdef tuple _hybrid_buffers(object buffers, tuple recr_layers):
    """buffers for both parts: a mode name for both, or (attention part's, recurrent part's) with
    the recurrent part's {model layer: (R, S)} renumbered to its own layers."""
    if buffers is None or isinstance(buffers, str):
        return buffers, buffers
    if not isinstance(buffers, tuple) or len(buffers) != 2:
        raise TypeError(f"buffers must be 'owned', None, 'none' or a pair (attention buffers, recurrent "
                        f"buffers), not {type(buffers).__name__}")
    attn, recr = buffers
    if isinstance(recr, dict):
        index = {il: k for k, il in enumerate(recr_layers)}
        for il in recr:
            if il not in index:
                raise ValueError(f"buffers[1]: layer {il} is not a recurrent layer ({list(recr_layers)})")
        recr = {index[il]: kv for il, kv in recr.items()}
    return attn, recr


cdef class _Hybrid:
    """The hybrid memory (kvcache.HybridCache is the documented public class)."""
    cdef kvc_hybrid c              # the pair in C: both parts' structs
    cdef object _attn              # the attention layers' cache (a UnifiedCache2026 or an ISWACache2026)
    cdef _Unified _cells           # the attention cache that answers for both (the unified one, the pair's base)
    cdef _ISWA _iswa               # the iSWA pair of a sliding window, else None
    cdef _Recurrent2026 _recr      # the recurrent layers' memory (a RecurrentCache2026)
    cdef list _order               # every cache of both parts, in the global lock order (ascending address)
    cdef uint32_t _n_seq_max
    cdef uint32_t _n_layer         # the model's layers
    cdef readonly _Hold _hold      # both parts' locks, in the global order
    cdef readonly _Hold _op        # the same, held as one operation (a change from this thread refused)

    __signature__ = _signatures.ClassSignature(_signatures.hybrid)

    def __cinit__(self, *args, **kwargs):
        (kv_size, n_layer, recurrent_layers, n_embd_k_gqa, n_embd_v_gqa, n_embd_r, n_embd_s, n_seq_max, type_k,
         type_v, v_trans, n_rs_seq, attn_layers, kv_unified, n_embd_head_k, rope, buffers, n_swa, swa_type,
         swa_layers, n_batch, swa_full) = _signatures.bind(_signatures.hybrid, type(self), args, kwargs)
        cdef kvc_err err
        cdef int r
        err.msg[0] = 0
        from kvcache.unified import UnifiedCache      # the public classes of the parts (a layer above)
        from kvcache.recurrent import RecurrentCache
        from kvcache.iswa import ISWACache2026
        n_layer = int_arg(n_layer, "n_layer", 1, 65536)
        recr = layers_arg(recurrent_layers, n_layer, "recurrent_layers", any_order=True)
        if not recr:
            raise ValueError("recurrent_layers: a hybrid memory needs at least one recurrent layer")
        recr_set = frozenset(recr)
        if attn_layers is None:
            attn = tuple(il for il in range(n_layer) if il not in recr_set)
        else:
            attn = layers_arg(attn_layers, n_layer, "attn_layers", any_order=True)
        if not attn:
            raise ValueError("attn_layers: a hybrid memory needs at least one attention layer")
        n_seq_max = n_seq_max_arg(n_seq_max)
        n_swa = int_arg(n_swa, "n_swa", 0, 2**31 - 1)
        if n_swa:
            # llama_memory_hybrid_iswa: the attention layers in an iSWA pair (by default all of them
            # windowed, as LFM2's loader marks them)
            swa = attn if swa_layers is None else layers_arg(swa_layers, n_layer, "swa_layers", any_order=True)
            if not frozenset(attn).issuperset(swa):
                raise ValueError(f"swa_layers: layers {sorted(set(swa) - set(attn))} are not attention layers")
        elif swa_layers is not None:
            raise ValueError("swa_layers: given without a sliding window (n_swa = 0)")
        r_widths = widths_arg(n_embd_r, n_layer, "n_embd_r")
        s_widths = widths_arg(n_embd_s, n_layer, "n_embd_s")
        buf_attn, buf_recr = _hybrid_buffers(buffers, recr)
        # llama.cpp: the attention part has no padding, the recurrent part a cell per sequence, f32
        if n_swa:
            self._iswa = ISWACache2026(kv_size, n_layer, n_embd_k_gqa, n_embd_v_gqa, list(swa), n_swa,
                                       swa_type=swa_type, n_batch=n_batch, swa_full=swa_full, type_k=type_k,
                                       type_v=type_v, v_trans=v_trans, n_seq_max=n_seq_max, n_pad=1,
                                       buffers=buf_attn, n_embd_head_k=n_embd_head_k, rope=rope,
                                       kv_unified=kv_unified, layers=list(attn))
            self._attn = self._iswa
            self._cells = self._iswa._base
        else:
            self._attn = UnifiedCache(kv_size, n_layer, n_embd_k_gqa, n_embd_v_gqa, type_k=type_k, type_v=type_v,
                                      v_trans=v_trans, n_seq_max=n_seq_max, n_pad=1, layers=list(attn),
                                      buffers=buf_attn, n_embd_head_k=n_embd_head_k, rope=rope, semantics="2026",
                                      kv_unified=kv_unified)
            self._cells = self._attn
        self._recr = RecurrentCache(n_seq_max, len(recr), [r_widths[il] for il in recr],
                                    [s_widths[il] for il in recr], type_k="f32", type_v="f32",
                                    kv_size=max(1, n_seq_max), buffers=buf_recr, semantics="2026",
                                    n_rs_seq=n_rs_seq)
        if self._iswa is not None:
            r = kvc_hybrid_init_iswa(&self.c, &self._iswa.c, &self._recr.c, &err)
            parts = (self._iswa._base, self._iswa._swa, self._recr)
        else:
            r = kvc_hybrid_init(&self.c, &self._cells.c, &self._recr.c, &err)
            parts = (self._cells, self._recr)
        check_status(r, &err, "HybridCache")
        _hybrid_state_init(self, n_layer, recr)
        self._order = _lock_order(parts)
        self._n_layer = <uint32_t>n_layer
        self._n_seq_max = <uint32_t>n_seq_max
        self._hold = _Hold(*parts)
        self._op = _Hold(*parts, busy=True)

    # lock() of every part's cache, in _lock_order's order (see "locking" in _common.pxi)
    cdef int _lock_parts(self, int how, str what) except -1:
        return lock_all(self._order, how, what)

    cdef int _unlock_parts(self, int how) except -1:
        return unlock_all(self._order, how)

    # --- the parts and the geometry (read-only) ----------------------------------------------
    @property
    def attn(self):
        """The attention layers' cache: a UnifiedCache2026 without padding, or, with a sliding
        window, an ISWACache2026 (llama_memory_hybrid_iswa's attention part)."""
        return self._attn

    @property
    def recr(self):
        """The recurrent layers' memory (a RecurrentCache of semantics '2026', a cell per sequence)."""
        return self._recr

    @property
    def n_layer(self):
        """Number of model layers."""
        return self._n_layer

    @property
    def attn_layers(self):
        """Model layers of the attention part, ascending."""
        return _kept_layers(self.c.attn) if self._iswa is None else self._iswa._layers()

    @property
    def recurrent_layers(self):
        """Model layers of the recurrent part, ascending (a layer may be in both, or in neither)."""
        return _layer_ils(self.c.recr.layers, self.c.recr.n_layer)

    @property
    def n_seq_max(self):
        """Valid sequence ids are [0, n_seq_max)."""
        return self._n_seq_max

    @property
    def n_rs_seq(self):
        """Rollback snapshots per recurrent state (0: no rollback)."""
        return self._recr.n_rs_seq

    @property
    def n_swa(self):
        """The attention part's sliding window (0: none, the attention part a UnifiedCache2026)."""
        return 0 if self._iswa is None else self._iswa.n_swa

    @property
    def swa_layers(self):
        """Model layers of the attention part that use the sliding window, ascending (() without one)."""
        return () if self._iswa is None else self._iswa.swa_layers

    @property
    def semantics(self):
        """Always '2026': the hybrid memory is today's llama.cpp's."""
        return "2026"

    @property
    def has_shift(self):
        """The attention part has a K-shift pending (update() applies it; recurrent states have
        nothing to shift)."""
        return self._attn.has_shift

    @property
    def total_size(self):
        """Bytes of both parts' memory."""
        return self._attn.total_size + self._recr.total_size

    def __repr__(self):
        window = "" if self._iswa is None else f", n_swa={self._iswa.n_swa}, swa_layers={list(self.swa_layers)}"
        return (f"HybridCache(n_layer={self._n_layer}, attn_layers={list(self.attn_layers)}, "
                f"recurrent_layers={list(self.recurrent_layers)}, kv_size={self._cells.size}, "
                f"n_seq_max={self.n_seq_max}, n_rs_seq={self._recr.n_rs_seq}{window})")

    cdef uint32_t _recr_index(self, object il) except? 0xFFFFFFFF:
        """The recurrent part's index of model layer il (ValueError when il is not a recurrent layer)."""
        cdef int64_t k = kvc_hybrid_recr_layer(&self.c, _layer_key(il))
        if k < 0:
            raise ValueError(f"il = {il!r} is not a recurrent layer ({list(self.recurrent_layers)})")
        return <uint32_t>k

    # --- placement -------------------------------------------------------------------------
    def find_slot(self, ub):
        """Place a ubatch in both parts, the recurrent part first: True when both placed it;
        False when either had no room or failed llama.cpp's sanity check, and then neither
        changed. ValueError for a ubatch a part refuses (nothing changed)."""
        cdef UBatch u = ubatch_c(ub)
        cdef kvc_err err
        cdef int r
        err.msg[0] = 0
        u.check(self._n_seq_max)
        self._lock_parts(CHANGE, "find_slot")
        try:
            with nogil:
                r = kvc_hybrid_find_slot(&self.c, &u.c, &err)
        finally:
            self._unlock_parts(CHANGE)
        self._spill_flush()
        if r < 0:
            raise_status(r, &err, "find_slot")
        return r == 1

    cdef int _spill_flush(self) except -1:
        # the attention part's evicted prompts and the recurrent part's evicted checkpoints to their
        # write-back sinks (kvcache.store)
        spill_flush(self._cells)
        if self._iswa is not None:
            spill_flush(self._iswa._swa)
        self._recr._spill_drain()
        return 0

    def prepare(self, ubatches):
        """The dry run of placing several ubatches in turn, the recurrent part first (as
        llama.cpp's hybrid memory prepares): the attention part's slot_infos (see
        UnifiedCache.prepare; an iSWA pair's: ISWACache2026.prepare), or None when either part
        cannot take them. Both parts are left exactly as they were, prefix indexes and
        checkpoints included (a ubatch that fits only by evicting evicts nothing here). One
        operation of both parts: no change of either comes between their dry runs."""
        ubs = _items(ubatches)
        # one operation of both parts: every ubatch checked and the arrays made first (the
        # attention part's checks are the recurrent part's: no cell extension, the same
        # n_seq_max), then the dry runs under all the locks, with no Python code in between
        cdef _DryRun attn = _dry_run(self._cells, ubs)
        cdef _DryRun swa = _dry_run(self._iswa._swa, ubs) if self._iswa is not None else None
        cdef kvc_err err
        cdef int r
        err.msg[0] = 0
        self._lock_parts(CHANGE, "prepare")
        try:
            with nogil:
                r = kvc_recurrent_prepare(self.c.recr, attn.arr, attn.n_ub, &err)
                if r == 1:
                    if self.c.iswa != NULL:
                        _pair_dry_run(self.c.iswa, attn, swa)
                    else:
                        attn.run(self.c.attn)
        finally:
            self._unlock_parts(CHANGE)
        if r < 0:
            raise_status(r, &err, "prepare")
        if r == 0:
            return None
        return attn.result() if swa is None else _pair_result(attn, swa)

    def slot_info(self):
        """Where the last find_slot put each token in the attention part (UnifiedCache.slot_info;
        an iSWA pair's: the pair (base, SWA))."""
        return self._attn.slot_info()

    def clear(self):
        """Empty both parts (their memory zeroed)."""
        self._lock_parts(CHANGE, "clear")
        try:
            with nogil:
                kvc_hybrid_clear(&self.c)
        finally:
            self._unlock_parts(CHANGE)

    # --- sequences -------------------------------------------------------------------------
    def seq_rm(self, seq_id, p0=-1, p1=-1):
        """Remove positions [p0, p1) of seq_id (-1: every sequence) from both parts, the
        recurrent part first: False, and nothing changed in either, when it refuses (a cut inside
        a recurrent state, or a rollback it cannot make exactly: RecurrentCache.seq_rm)."""
        cdef int32_t s = seq_c(seq_id, self._n_seq_max, "seq_id", True)
        cdef int32_t a = pos_c(p0, "p0"), b = pos_c(p1, "p1")
        cdef bint r
        self._lock_parts(CHANGE, "seq_rm")
        try:
            r = kvc_hybrid_seq_rm(&self.c, s, a, b)
        finally:
            self._unlock_parts(CHANGE)
        return r

    def seq_cp(self, src, dst, p0=-1, p1=-1):
        """Copy src to dst in both parts (ValueError, nothing changed, when the attention part
        refuses it: across streams only whole sequences)."""
        cdef int32_t s = seq_c(src, self._n_seq_max, "src", False)
        cdef int32_t d = seq_c(dst, self._n_seq_max, "dst", False)
        cdef int32_t a = pos_c(p0, "p0"), b = pos_c(p1, "p1")
        cdef kvc_err err
        cdef int r
        err.msg[0] = 0
        self._lock_parts(CHANGE, "seq_cp")
        try:
            r = kvc_hybrid_seq_cp(&self.c, s, d, a, b, &err)
        finally:
            self._unlock_parts(CHANGE)
        check_status(r, &err, "seq_cp")

    def seq_keep(self, seq_id):
        """Keep only seq_id, in both parts."""
        cdef int32_t s = seq_c(seq_id, self._n_seq_max, "seq_id", False)
        self._lock_parts(CHANGE, "seq_keep")
        try:
            kvc_hybrid_seq_keep(&self.c, s)
        finally:
            self._unlock_parts(CHANGE)

    def seq_add(self, seq_id, p0, p1, shift):
        """Shift the positions of seq_id in [p0, p1), in both parts."""
        cdef int32_t s = seq_c(seq_id, self._n_seq_max, "seq_id", False)
        cdef int32_t a = pos_c(p0, "p0"), b = pos_c(p1, "p1")
        cdef int32_t d = pos_c(shift, "shift")
        self._lock_parts(CHANGE, "seq_add")
        try:
            kvc_hybrid_seq_add(&self.c, s, a, b, d)
        finally:
            self._unlock_parts(CHANGE)

    def seq_div(self, seq_id, p0, p1, d):
        """Integer-divide the positions of seq_id in [p0, p1) by d (> 0), in both parts."""
        cdef int32_t s = seq_c(seq_id, self._n_seq_max, "seq_id", False)
        cdef int32_t a = pos_c(p0, "p0"), b = pos_c(p1, "p1")
        cdef int32_t dd = divisor_c(d)
        self._lock_parts(CHANGE, "seq_div")
        try:
            kvc_hybrid_seq_div(&self.c, s, a, b, dd)
        finally:
            self._unlock_parts(CHANGE)

    def seq_pos_min(self, seq_id):
        """The larger of the parts' smallest positions of seq_id (-1: none)."""
        cdef int32_t s = seq_c(seq_id, self._n_seq_max, "seq_id", False), r
        self._lock_parts(READ, "seq_pos_min")
        try:
            r = kvc_hybrid_seq_pos_min(&self.c, s)
        finally:
            self._unlock_parts(READ)
        return r

    def seq_pos_max(self, seq_id):
        """The smaller of the parts' largest positions of seq_id (-1: none)."""
        cdef int32_t s = seq_c(seq_id, self._n_seq_max, "seq_id", False), r
        self._lock_parts(READ, "seq_pos_max")
        try:
            r = kvc_hybrid_seq_pos_max(&self.c, s)
        finally:
            self._unlock_parts(READ)
        return r

    def rollback_ok(self, seq_id, n):
        """Whether seq_rm(seq_id, seq_pos_max(seq_id) - n + 1, -1) would roll seq_id back by n
        positions (RecurrentCache2026.rollback_ok); nothing changes."""
        return self._recr.rollback_ok(seq_id, n)

    # --- graph inputs and memory -----------------------------------------------------------
    def kq_mask(self, ub, causal=True, alibi=False, out=None, dtype="f32", pad=None, reuse=False):
        """The KQ mask of the attention layers (UnifiedCache2026.kq_mask of the attention part).
        With a sliding window the pair ``(base_mask, swa_mask)`` (ISWACache.kq_mask; ``reuse``
        is the unified cache's only)."""
        if self._iswa is not None:
            if reuse:
                raise ValueError("reuse: the masks of a hybrid memory with a sliding window are made afresh")
            return self._iswa.kq_mask(ub, causal=causal, alibi=alibi, out=out, dtype=dtype, pad=pad)
        return self._attn.kq_mask(ub, causal=causal, alibi=alibi, out=out, dtype=dtype, pad=pad, reuse=reuse)

    def attention_indices(self, ub, causal=True, positions=False, out=None):
        """The attention indices of the attention layers (UnifiedCache.attention_indices of the
        attention part): the cells each query token group of ub attends to, exactly those kq_mask
        shows. With a sliding window the pair ``(base, swa)`` (ISWACache.attention_indices)."""
        return self._attn.attention_indices(ub, causal=causal, positions=positions, out=out)

    def s_copy(self):
        """The recurrent layers' state sources (RecurrentCache.s_copy: rows plane * size + cell)."""
        return self._recr.s_copy()

    @property
    def rs_z(self):
        """The recurrent row the graph zeroes for new states (RecurrentCache2026.rs_z)."""
        return self._recr.rs_z

    def store(self, il, k_rows=None, v_rows=None):
        """Write the K / V rows of the placed tokens for attention layer il (UnifiedCache.store;
        with a sliding window, into the pair's cache holding il)."""
        cdef int64_t index
        if kvc_hybrid_attn_layer(&self.c, _layer_key(il), &index) == NULL:
            raise ValueError(f"il = {il!r} is not an attention layer ({list(self.attn_layers)})")
        self._attn.store(il, k_rows, v_rows)

    def store_state(self, il, r_rows=None, s_rows=None, *, plane=0):
        """Write the recurrent states of the placed sequences for recurrent layer il
        (RecurrentCache.store: rows [head, head + len(rows)); plane: a rollback snapshot's)."""
        self._recr.store(self._recr_index(il), r_rows, s_rows, plane=plane)

    def r(self, il, plane=0):
        """Recurrent layer il's R rows (RecurrentCache.k of the recurrent part)."""
        return self._recr.k(self._recr_index(il), plane)

    def s(self, il, plane=0):
        """Recurrent layer il's S rows (RecurrentCache.v of the recurrent part)."""
        return self._recr.v(self._recr_index(il), plane)

    def update(self, rope=None, n_max_nodes=65536):
        """The attention part's update (stream copies, then the K-shift): recurrent states have
        nothing to shift."""
        return self._attn.update(rope, n_max_nodes)

    # --- prefix reuse: the attention part's index and the recurrent part's checkpoints ----------
    # (docs/prefix-reuse.md, "Recurrent and hybrid models"; csrc/kvc_hybrid_prefix.h)
    def enable_prefix_reuse(self, cap=0, checkpoints=16, per_seq=0, memory=None):
        """Keep finished requests for later ones in both parts: the attention part's prefix
        index (``cap``: cells, UnifiedCache2026.enable_prefix_reuse) and the recurrent part's
        checkpoints (``checkpoints``, ``per_seq``, ``memory``: RecurrentCache2026.enable_prefix_reuse).
        A hit of length P needs the attention K/V of [0, P) and a checkpoint of the state at
        exactly P. With a sliding window the attention part is an iSWA pair
        (ISWACache2026.enable_prefix_reuse): both of its caches serve the hit, a SWA cache smaller
        than the base cache (``swa_full=False``) only where it still holds the window before P."""
        # one operation of both parts: every argument checked and the recurrent part's new pool
        # made before either changes; then, under all the locks, the attention part's enable (the
        # one step that may fail, changing nothing) and the pool installed, with no Python code
        # in between (a callback or finalizer would see one part switched and not the other)
        cdef uint32_t ccap = <uint32_t>int_c(cap, "cap", 0, UINT32_MAX)
        cdef kvc_err err
        cdef int r
        err.msg[0] = 0
        if memory is not None:
            # the recurrent part refuses memory of its own states; the attention part's K/V neither
            self._memory_apart(memory)
        cdef _CkptPool p = self._recr._pool_new(checkpoints, per_seq, memory)
        self._lock_parts(CHANGE | RUNS_PYTHON, "enable_prefix_reuse")
        try:
            if self._iswa is not None:
                r = (<_ISWA2026>self._iswa)._reuse_enable(ccap, &err)
            else:
                r = (<_Unified2026>self._cells)._reuse_enable(ccap, &err)
            if r == KVC_OK:
                _ckpt_swap(self._recr, p)     # p holds the old pool now, let go of after the unlock
        finally:
            self._unlock_parts(CHANGE | RUNS_PYTHON)
        check_status(r, &err, "enable_prefix_reuse")

    cdef int _memory_apart(self, object memory) except -1:
        """ValueError when the checkpoints' memory overlaps the attention part's K/V."""
        cdef _HeldBuffer hb = hold_buffer(memory, "memory", True)
        cdef _Unified c
        try:
            regions = [("memory", <size_t>hb.view.buf, <size_t>hb.view.len)]
            for c in ((self._iswa._base, self._iswa._swa) if self._iswa is not None else (self._cells,)):
                regions += _layer_regions(c.c.layers, c.c.n_layer, <size_t>c.c.cells.size * c.c.n_stream,
                                          "the attention part's ")
            _check_disjoint(regions)
        finally:
            hb.release()
        return 0

    def disable_prefix_reuse(self):
        """Turn prefix reuse off in both parts (held cells become free, checkpoints go)."""
        cdef _CkptPool none = _CkptPool.__new__(_CkptPool)
        # one operation of both parts, with no Python code between them (see enable_prefix_reuse)
        self._lock_parts(CHANGE | RUNS_PYTHON, "disable_prefix_reuse")
        try:
            old = _ckpt_swap(self._recr, none)     # the pool and the sinks, let go of after the unlock
            if self._iswa is not None:
                sinks = (<_ISWA2026>self._iswa)._reuse_off()
            else:
                sinks = (<_Unified2026>self._cells)._reuse_off()
        finally:
            self._unlock_parts(CHANGE | RUNS_PYTHON)

    @property
    def prefix_reuse(self):
        """Whether prefix reuse is on (:meth:`enable_prefix_reuse`)."""
        return self._attn.prefix_reuse and self._recr.prefix_reuse

    @property
    def prefix_stats(self):
        """``{"attn": the attention part's prefix_stats, "recr": the recurrent part's}``; None
        while reuse is off."""
        # both read at one moment: a change from code their reads run (a finalizer) is refused
        with self._op:
            if not self.prefix_reuse:
                return None
            return {"attn": self._attn.prefix_stats, "recr": self._recr.prefix_stats}

    def checkpoint(self, seq_id, tokens, salt=None):
        """Checkpoint seq_id's recurrent state as the state after ``tokens[:P]`` (P: its
        position + 1), during a prefill once a ubatch ending at a chunk boundary is computed:
        RecurrentCache2026.checkpoint. Returns P (0: not kept)."""
        return self._recr.checkpoint(seq_id, tokens, salt)

    cdef kvc_ckpt_pool *_pool(self, str what) except NULL:
        if not self._attn.prefix_reuse:
            raise reuse_off(what)
        return self._recr._pool(what)

    def prefix_match(self, tokens, salt=None):
        """The hit a request of ``tokens`` gets: the deepest checkpoint whose tokens begin it
        and whose whole prefix the attention index also holds, at most ``len(tokens) - 1``
        (0 while reuse is off). Both parts' prefixes count as used."""
        cdef prefix_req q
        t = prefix_args(&q, NO_SEQ, 0, tokens, salt)
        cdef uint32_t r = 0
        if not self.prefix_reuse:
            return 0
        cdef kvc_ckpt_pool *pool
        self._lock_parts(CHANGE, "prefix_match")
        try:
            if self.prefix_reuse:   # again under the locks: another thread may have dropped the pool
                pool = self._pool("prefix_match")
                with nogil:
                    r = kvc_hybrid_prefix_match(&self.c, pool, q.salt, q.tokens, q.n)
        finally:
            self._unlock_parts(CHANGE)
        return int(r)

    def prefix_attach(self, seq_id, tokens, salt=None):
        """Start sequence ``seq_id`` (empty in both parts) from the hit :meth:`prefix_match`
        finds: the checkpoint's state at position ``k - 1`` in the recurrent part, the cells of
        positions ``0 .. k - 1`` in the attention part (exactly those: never past the
        checkpoint). Returns k: compute ``tokens[k:]`` at positions ``k ..``."""
        cdef prefix_req q
        t = prefix_args(&q, seq_id, self._n_seq_max, tokens, salt)
        cdef uint32_t k = 0
        cdef kvc_ckpt_pool *pool
        cdef kvc_err err
        cdef int r
        err.msg[0] = 0
        self._lock_parts(CHANGE, "prefix_attach")
        try:
            pool = self._pool("prefix_attach")   # under the locks: another thread may drop the pool
            with nogil:
                r = kvc_hybrid_prefix_attach(&self.c, pool, q.seq_id, q.salt, q.tokens, q.n, &k, &err)
        finally:
            self._unlock_parts(CHANGE)
        check_status(r, &err, "prefix_attach")
        return int(k)

    def prefix_release(self, seq_id, tokens=None, salt=None):
        """End sequence ``seq_id`` in both parts: its attention cells go to the index
        (UnifiedCache2026.prefix_release, ``tokens`` as there), and its final recurrent state is
        checkpointed (as :meth:`checkpoint`) as the state after ``tokens`` (ValueError when they
        are fewer than the state's), or without them after the tokens its attention cells
        recorded (nothing when those do not cover every position of the state). Returns the hit
        a later request beginning with these tokens gets from what both parts hold now."""
        cdef prefix_req q
        t = prefix_args(&q, seq_id, self._n_seq_max, tokens, salt, True)
        cdef uint32_t hit = 0
        cdef kvc_retained res
        cdef kvc_ckpt_pool *pool
        cdef kvc_err err
        cdef int r
        err.msg[0] = 0
        self._lock_parts(CHANGE, "prefix_release")
        try:
            pool = self._pool("prefix_release")   # under the locks: another thread may drop the pool
            with nogil:
                r = kvc_hybrid_prefix_release(&self.c, pool, q.seq_id, q.salt, q.tokens, q.n, &hit, &res, &err)
        finally:
            self._unlock_parts(CHANGE)
        self._spill_flush()
        check_status(r, &err, "prefix_release")
        return int(hit)

    def prefix_pin(self, tokens, salt=None):
        """Keep the prefix ``tokens`` in both parts (the attention cells and the checkpoint of
        exactly these tokens; ValueError, nothing pinned, unless both are held) until
        :meth:`prefix_unpin`; returns the pin."""
        cdef prefix_req q
        t = prefix_args(&q, NO_SEQ, 0, tokens, salt)
        cdef kvc_ckpt_handle rh
        cdef kvc_prefix_handle ah[2]
        cdef kvc_ckpt_pool *pool
        cdef kvc_err err
        cdef int r
        err.msg[0] = 0
        self._lock_parts(CHANGE, "prefix_pin")
        try:
            pool = self._pool("prefix_pin")   # under the locks: another thread may drop the pool
            r = kvc_hybrid_prefix_pin(&self.c, pool, q.salt, q.tokens, q.n, &rh, ah, &err)
        finally:
            self._unlock_parts(CHANGE)
        check_status(r, &err, "prefix_pin")
        return (pins_of(ah, self._n_attn()), pin_of(rh.gen, rh.slot))

    def prefix_unpin(self, pin):
        """Let go of a pin :meth:`prefix_pin` returned (both halves checked before either is let go)."""
        cdef kvc_ckpt_handle rh
        cdef kvc_prefix_handle ah[2]
        cdef kvc_ckpt_pool *pool
        cdef kvc_err err
        cdef int r
        err.msg[0] = 0
        attn, recr = pin_pair(pin)
        pins_arg(attn, ah, self._n_attn())     # each half read once
        pin_arg(recr, &rh.slot, &rh.gen)
        self._lock_parts(CHANGE, "prefix_unpin")
        try:
            pool = self._pool("prefix_unpin")
            r = kvc_hybrid_prefix_unpin(&self.c, pool, rh, ah, &err)
        finally:
            self._unlock_parts(CHANGE)
        check_status(r, &err, "prefix_unpin")

    cdef uint32_t _n_attn(self) noexcept:
        # the attention part's caches: an iSWA pair's two, or the unified cache
        return 1 if self._iswa is None else 2

    def prefix_evict(self, n_cells=0, n_checkpoints=0):
        """Evict up to ``n_cells`` attention cells and ``n_checkpoints`` checkpoints now (least
        recently used first); returns ``(cells, checkpoints)`` evicted."""
        # both counts read before either part evicts
        cdef uint32_t nc = <uint32_t>int_c(n_cells, "n_cells", 0, UINT32_MAX)
        cdef uint32_t nk = <uint32_t>int_c(n_checkpoints, "n_checkpoints", 0, UINT32_MAX)
        cdef uint32_t cells, ckpts
        cdef kvc_ckpt_pool *pool
        self._lock_parts(CHANGE, "prefix_evict")
        try:
            pool = self._pool("prefix_evict")
            kvc_hybrid_prefix_evict(&self.c, pool, nc, nk, &cells, &ckpts)
        finally:
            self._unlock_parts(CHANGE)
        self._spill_flush()     # the write-back sinks once both parts have evicted
        return (int(cells), int(ckpts))

    def _prefix_check(self):
        """Raise RuntimeError unless both parts' reuse records agree (for tests)."""
        for c in ((self._iswa._base, self._iswa._swa) if self._iswa is not None else (self._attn,)):
            c._prefix_check()
        self._recr._prefix_check()

    # --- state (csrc/kvc_hybrid_state.h) ----------------------------------------------------
    def state_size(self, seq_id=-1, *, layout=DEFAULT_LAYOUT, prefix=None, partial_only=False):
        """Bytes state_write(seq_id, layout=layout, prefix=prefix, partial_only=partial_only) produces."""
        cdef state_codec k
        return cache_state_size(self._state_codec(&k), &k, seq_id, layout, prefix, partial_only)

    def state_write(self, seq_id=-1, *, layout=DEFAULT_LAYOUT, prefix=None, partial_only=False):
        """The state of seq_id (-1: the whole memory) as llama.cpp's hybrid memory writes it: the
        attention part (a unified cache's state), then the recurrent part (its layer count is
        the model's, its records the recurrent layers'), nothing between them. A sequence's state
        starts with the sequence-blob prefix (``llama_state_seq_get_data``; prefix=False: the
        memory state alone, what a sequence file holds). partial_only: the recurrent part alone
        (``LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY``; a sequence's state only). layout: "2026" only,
        the one llama.cpp layout of a hybrid memory's state (ValueError for another)."""
        cdef state_codec k
        return cache_state_write(self._state_codec(&k), &k, seq_id, layout, prefix, partial_only)

    def state_write_into(self, buf, seq_id=-1, *, layout=DEFAULT_LAYOUT, prefix=None, partial_only=False):
        """Write the state of seq_id (-1: the whole memory) into buf; returns the bytes written.
        buf: a writable C-contiguous buffer of at least state_size(...) bytes (filled from C) or
        a binary file object (written in chunks of bounded size; a change of either part from
        its write() raises RuntimeError there). layout, prefix, partial_only: as state_write."""
        cdef state_codec k
        return cache_state_write_into(self._state_codec(&k), &k, buf, seq_id, layout, prefix, partial_only)

    def state_read(self, data, seq_id=-1, *, convert=False, exact=False, layout=None, partial_only=False):
        """Restore a state written by state_write (or llama.cpp) into seq_id (-1: the whole memory);
        returns the bytes consumed (bytes after it are not read, unless exact: then they are an
        error). A sequence's state may come with or without the sequence-blob prefix.
        convert: accept an attention part whose V layout differs from the cache's and convert it.
        partial_only: data holds the recurrent part alone; the attention part is left as it is.
        layout: None or "2026" (ValueError for another).

        All or nothing: both parts are checked (and a sequence's cells given room) before either
        changes, so on failure (StateError naming the part and the byte) both are exactly as
        they were. llama.cpp instead clears the sequence, or the whole memory, when a read fails."""
        cdef state_codec k
        return cache_state_read(self._state_codec(&k), &k, data, seq_id, convert, exact, layout, partial_only)

    cdef list _state_codec(self, state_codec *k):
        """k: the codec of the memory's state (both parts in C); returns the caches to lock."""
        state_codec_init(k, _hybrid_state_size, _hybrid_state_range, _hybrid_state_read, &self.c, self._n_seq_max)
        k.today_only = True
        return self._order


cdef size_t _hybrid_state_size(void *codec, int32_t seq_id, unsigned layout) noexcept nogil:
    cdef const state_codec *k = <const state_codec *>codec
    return kvc_hybrid_state_size(<const kvc_hybrid *>k.cache, seq_id, layout, k.hybrid_parts)


cdef int _hybrid_state_range(const void *codec, int32_t seq_id, unsigned layout, uint64_t offset, uint8_t *out,
                             size_t cap, size_t *written) noexcept nogil:
    cdef const state_codec *k = <const state_codec *>codec
    return kvc_hybrid_state_write_range(<kvc_hybrid *>k.cache, seq_id, layout, k.hybrid_parts, offset, out, cap,
                                        written)


cdef int _hybrid_state_read(void *codec, int32_t seq_id, const uint8_t *data, size_t n, unsigned flags,
                            unsigned layout, size_t *consumed, kvc_err *err) noexcept nogil:
    cdef const state_codec *k = <const state_codec *>codec
    return kvc_hybrid_state_read(<kvc_hybrid *>k.cache, seq_id, data, n, flags, layout, k.hybrid_parts, consumed,
                                 err)


cdef int _hybrid_state_init(_Hybrid self, object n_layer, tuple recr) except -1:
    """Number the recurrent part's layers as the model's: its states say the model's layer count."""
    cdef kvc_err err
    cdef uint32_t[::1] il = np.asarray(recr, dtype=np.uint32)
    err.msg[0] = 0
    check_status(kvc_hybrid_state_init(&self.c, <uint32_t>n_layer, &il[0], &err), &err, "HybridCache")
    return 0


cdef str _hybrid_layout(object layout, str what):
    """The one layout of a hybrid memory's state: today's (llama.cpp wrote no other for it)."""
    _layout_row(layout)     # TypeError / ValueError for what is no layout at all
    if layout != "2026":
        raise ValueError(f"{what}: layout {layout!r}: a hybrid memory's state exists in today's llama.cpp's layout "
                         f"only, '2026' (llama-cpp-python 0.3.36)")
    return layout


cdef unsigned _hybrid_parts(object partial_only, int32_t seq_id) except? 0xffffffff:
    if not bool_c(partial_only, "partial_only"):
        return KVC_HYBRID_BOTH
    if seq_id < 0:
        raise ValueError("partial_only: llama.cpp's LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY applies to a sequence's "
                         "state (seq_id >= 0), not to the whole memory's")
    return KVC_HYBRID_PARTIAL_ONLY
