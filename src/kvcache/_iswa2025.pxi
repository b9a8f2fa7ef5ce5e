# The iSWA cache of llama.cpp as of mid-2025 (semantics "2025"): sbatch_init records each sequence's
# positions, find_slot is undone by restore or kept by commit, which prunes the SWA cache with the
# ranges the split recorded; set_full; defragmentation.


cdef class _ISWA2025(_ISWA):
    """The iSWA cache of llama.cpp as of mid-2025 (kvcache.ISWACache2025 is the documented class):
    find_slot is undone by restore or kept by commit, which prunes the SWA cache with the
    ranges the batch's split recorded."""

    def sbatch_init(self, batch_or_pos, seq_id=None):
        """Record, per sequence, the smallest and largest position of a whole batch: commit()
        prunes the SWA cache with these ranges. Nothing is recorded with ``swa_full``.

        ``batch_or_pos``: a :class:`Batch` (then ``seq_id`` is not given), or the positions of
        the batch with ``seq_id`` one id or id list per token. Returns :attr:`pending`."""
        cdef kvc_err err
        cdef int rc
        cdef kvc_iswa_pending p
        cdef Batch b
        cdef UBatch u
        err.msg[0] = 0
        if isinstance(batch_or_pos, Batch):
            if seq_id is not None:
                raise TypeError("sbatch_init: seq_id must not be given with a Batch")
            b = <Batch>batch_or_pos
            lock(&b._lock, READ, "sbatch_init")     # its arrays stay put while the ranges are taken
            try:
                self._lock_parts(READ, "sbatch_init")
                try:
                    with nogil:
                        rc = kvc_iswa_sbatch_init(&self.c, b.c.n_tokens, b.c.pos, b.c.seq_off, b.c.seq_ids, &err)
                        p = self.c.pending
                finally:
                    self._unlock_parts(READ)
            finally:
                unlock(&b._lock, READ)
        else:
            if seq_id is None:
                raise TypeError("sbatch_init: seq_id is required with positions")
            u = UBatch(batch_or_pos, seq_id)
            self._lock_parts(READ, "sbatch_init")
            try:
                with nogil:
                    rc = kvc_iswa_sbatch_init(&self.c, u.c.n_tokens, u.c.pos, u.c.seq_off, u.c.seq_ids, &err)
                    p = self.c.pending
            finally:
                self._unlock_parts(READ)
        check_status(rc, &err, "sbatch_init")
        return _pending_items(&p)

    def ubatches(self, batch, n_ubatch, embd_pooled=False):
        """Record the batch's pruning ranges (sbatch_init), then iterate over its ubatches of at
        most ``n_ubatch`` tokens, split in batch order as llama.cpp does for this cache (the
        Batch must be built with ``simple_split=True``; ``embd_pooled`` changes nothing)."""
        if not isinstance(batch, Batch):
            raise TypeError(f"batch must be a Batch, not {type(batch).__name__}")
        if not batch.simple_split:
            raise ValueError("this cache splits batches in order: build the Batch with simple_split=True")
        it = batch.ubatches(n_ubatch, "simple")
        self.sbatch_init(batch)
        return it

    def commit(self):
        """Keep what find_slot placed in both caches, then slide the window: every sequence of
        the last sbatch_init loses the SWA cells no position of that batch can see. Warns
        (:class:`SWAWarning`) when a sequence's window was only partly in the SWA cache."""
        cdef kvc_iswa_pending partial
        cdef uint32_t n
        self._lock_parts(CHANGE, "commit")
        try:
            with nogil:
                n = kvc_iswa_commit(&self.c, &partial)
        finally:
            self._unlock_parts(CHANGE)
        if n:
            # warned once every sequence is pruned (a warning turned into an error stops nothing)
            n_swa = self._swa.c.n_swa
            for s, pmin, _ in _pending_items(&partial):
                warnings.warn(f"partial SWA cache for sequence {s}: fewer than min(n_swa = {n_swa}, "
                              f"pmin = {pmin}) cells before position {pmin} are in the cache; information "
                              f"may have been lost", SWAWarning, stacklevel=2)

    def restore(self):
        """Undo the find_slot calls of both caches since the last commit (data is kept)."""
        self._lock_parts(CHANGE, "restore")
        try:
            kvc_iswa_restore(&self.c)
        finally:
            self._unlock_parts(CHANGE)

    def set_full(self):
        """n = size and head = 0 in both caches (worst-case graph reservation)."""
        self._lock_parts(CHANGE, "set_full")
        try:
            kvc_iswa_set_full(&self.c)
        finally:
            self._unlock_parts(CHANGE)

    def defrag_sched(self, thold):
        """Schedule a defrag in each cache whose fragmentation exceeds thold."""
        if not isinstance(thold, (int, float, np.integer, np.floating)) or _is_bool(thold):
            raise TypeError(f"thold must be a number, not {type(thold).__name__}")
        cdef float t = <float>float(thold)     # read once, before the locks: both caches get the same
        self._lock_parts(CHANGE, "defrag_sched")
        try:
            kvc_unified_defrag_sched(self.c.base, t)
            kvc_unified_defrag_sched(self.c.swa, t)
        finally:
            self._unlock_parts(CHANGE)

    def update(self, rope=None, n_max_nodes=65536):
        """Apply the pending K-shift and scheduled defrag of both caches (UnifiedCache.update).

        A K-shift needs :attr:`can_shift`: with a pending shift and caches of different sizes
        this raises RuntimeError and changes nothing. Returns the two caches' UpdatePlans; its
        truth is what llama.cpp's iSWA update returns, the AND of the two. Arguments, rotations
        and their memory are checked for both caches before either changes."""
        # read once, before the locks: no code of the argument runs between the check below and
        # the update
        n_max_nodes = int_c(n_max_nodes, "n_max_nodes", INT32_MIN, INT32_MAX)
        with self._hold:
            if kvc_iswa_shift_refused(&self.c):
                raise RuntimeError(f"update: a K-shift is pending but this cache cannot shift (SWA cache of "
                                   f"{self._swa.size} cells, base cache of {self._base.size}: build it with "
                                   f"swa_full=True to allow position shifts)")
            base, swa = _update_parts((self._base, self._swa), rope, n_max_nodes)
        return ISWAUpdatePlan(base, swa)
