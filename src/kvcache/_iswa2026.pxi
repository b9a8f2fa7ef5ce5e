# The iSWA cache of today's llama.cpp (semantics "2026"): find_slot places a ubatch in both caches
# for good or in neither (prepare() is the dry run), and prefix reuse over the pair
# (docs/prefix-reuse.md).


cdef void _pair_dry_run(kvc_iswa *c, _DryRun base, _DryRun swa) noexcept nogil:
    # an iSWA pair's prepare, the caller holding both caches' locks: the SWA cache's dry run only
    # when the base cache's fits
    base.run(c.base)
    if base.r == 1:
        swa.run(c.swa)


cdef object _pair_result(_DryRun base, _DryRun swa):
    """_pair_dry_run's answer: (base_slot_infos, swa_slot_infos), or None."""
    got = base.result()
    if got is None:
        return None
    got_swa = swa.result()
    return None if got_swa is None else (got, got_swa)


cdef class _ISWA2026(_ISWA):
    """Today's llama.cpp iSWA cache (kvcache.ISWACache2026 is the documented class): find_slot
    places a ubatch in both caches for good, or in neither; prepare is its dry run."""

    def ubatches(self, batch, n_ubatch, embd_pooled=False):
        """Iterate over the ubatches of at most ``n_ubatch`` tokens of a batch: the splits of
        UnifiedCache.ubatches (in order, equal splits with several streams); nothing is
        recorded (no ranges to prune)."""
        return self._base.ubatches(batch, n_ubatch, embd_pooled)

    def prepare(self, ubatches):
        """The dry run of placing several ubatches in turn in both caches (see
        UnifiedCache.prepare): ``(base_slot_infos, swa_slot_infos)``, or None when one does not
        fit in either cache. Both caches are left exactly as they were, their prefix indexes
        included (as UnifiedCache2026.prepare's: a ubatch that fits only by evicting is placed
        where the real placement would put it, and nothing is evicted). One operation of both:
        no change of either comes between the two dry runs."""
        ubs = _items(ubatches)
        cdef _DryRun base = _dry_run(self._base, ubs), swa = _dry_run(self._swa, ubs)
        self._lock_parts(CHANGE, "prepare")
        try:
            with nogil:
                _pair_dry_run(&self.c, base, swa)
        finally:
            self._unlock_parts(CHANGE)
        return _pair_result(base, swa)

    # --- prefix reuse (docs/prefix-reuse.md): both caches, a prefix as far as both hold it -----
    def enable_prefix_reuse(self, cap=0):
        """Prefix reuse in both caches (see UnifiedCache2026.enable_prefix_reuse). With
        ``swa_full=True`` both keep every prefix and ``cap`` bounds each cache's index. With a
        smaller SWA cache, which overwrites the cells that slid out of their sequence's window,
        the SWA cache's index remembers each prompt beyond the cells it still has, and a hit of
        length P needs the base cache's cells of positions 0 .. P-1 and the SWA cache's cells
        of the window before P (in practice: a prompt that continues one that ended, or
        was published, where it ended); with ``cell_ext`` the tokens it remembers without cells
        keep their positions and extensions, and the window is that of the request's position
        of token P. ``cap`` bounds the base cache's index (the SWA cache's own size bounds its)."""
        cdef uint32_t ccap = <uint32_t>int_c(cap, "cap", 0, UINT32_MAX)
        cdef kvc_err err
        cdef int r
        err.msg[0] = 0
        self._lock_parts(CHANGE, "enable_prefix_reuse")
        try:
            r = self._reuse_enable(ccap, &err)
        finally:
            self._unlock_parts(CHANGE)
        check_status(r, &err, "enable_prefix_reuse")

    cdef int _reuse_enable(self, uint32_t cap, kvc_err *err) noexcept nogil:
        # both indexes on, or neither changed (the caller holds both locks)
        cdef kvc_unified *parts[2]
        parts[0], parts[1] = self.c.base, self.c.swa
        if self.c.swa_full:
            return kvc_retain_enable_parts(parts, 2, cap, err)
        return kvc_retain_enable_window_pair(self.c.base, self.c.swa, cap, err)

    def disable_prefix_reuse(self):
        """Turn prefix reuse off in both caches (their indexes forget every prefix)."""
        # one operation of both: no Python code runs between the two, nor changes either
        self._lock_parts(CHANGE | RUNS_PYTHON, "disable_prefix_reuse")
        try:
            sinks = self._reuse_off()     # let go of after the unlock
        finally:
            self._unlock_parts(CHANGE | RUNS_PYTHON)

    cdef tuple _reuse_off(self):
        """Both indexes off (the caller holds both locks); returns the write-back sinks they let
        go of, for the caller to drop after unlocking (_Unified2026._reuse_off)."""
        base = (<_Unified2026>self._base)._reuse_off()
        swa = (<_Unified2026>self._swa)._reuse_off()
        return base, swa

    @property
    def prefix_reuse(self):
        """Whether prefix reuse is on."""
        return self._base.prefix_reuse

    @property
    def prefix_stats(self):
        """``{"base": ..., "swa": ...}``: each cache's UnifiedCache2026.prefix_stats; None while
        reuse is off."""
        # both read at one moment: a change from code their reads run (a finalizer) is refused
        with self._op:
            if not self._base.prefix_reuse:
                return None
            return {"base": self._base.prefix_stats, "swa": self._swa.prefix_stats}

    def prefix_match(self, tokens, salt=None, *, pos=None, pos_x=None, pos_y=None):
        """How many leading tokens of a new request both caches hold under ``salt`` (at most
        ``len(tokens) - 1``). ``pos``, ``pos_x``, ``pos_y``: with ``cell_ext``, the positions and
        2-D positions the request places its tokens at, as UnifiedCache2026.prefix_match's."""
        cdef prefix_req q
        t = prefix_args(&q, NO_SEQ, 0, tokens, salt)
        cdef uint32_t r
        cdef _PrefixXY xy = prefix_xy(pos, pos_x, pos_y, q.n, kvc_unified_has_ext(self.c.base))
        cdef kvc_unified *parts[2]
        parts[0], parts[1] = self.c.base, self.c.swa
        self._lock_parts(CHANGE, "prefix_match")
        try:
            with nogil:
                r = kvc_retain_match_parts_xy(parts, 2, q.salt, q.tokens, xy.p, xy.x, xy.y, q.n)
        finally:
            self._unlock_parts(CHANGE)
        return int(r)

    def prefix_attach(self, seq_id, tokens, salt=None, *, pos=None, pos_x=None, pos_y=None):
        """Start sequence ``seq_id`` (empty in both caches) from the longest prefix of
        ``tokens`` both caches hold, in both (UnifiedCache2026.prefix_attach; ``pos``,
        ``pos_x``, ``pos_y`` as there); returns its length k. Nothing changes in either cache on failure."""
        cdef prefix_req q
        t = prefix_args(&q, seq_id, self.c.base.n_seq_max, tokens, salt)
        cdef uint32_t k = 0
        cdef _PrefixXY xy = prefix_xy(pos, pos_x, pos_y, q.n, kvc_unified_has_ext(self.c.base))
        cdef kvc_unified *parts[2]
        cdef kvc_err err
        cdef int r
        err.msg[0] = 0
        parts[0], parts[1] = self.c.base, self.c.swa
        self._lock_parts(CHANGE, "prefix_attach")
        try:
            self._reuse_on("prefix_attach")
            with nogil:
                r = kvc_retain_attach_parts_xy(parts, 2, q.seq_id, q.salt, q.tokens, xy.p, xy.x, xy.y, q.n, &k, &err)
        finally:
            self._unlock_parts(CHANGE)
        check_status(r, &err, "prefix_attach")
        return int(k)

    def prefix_release(self, seq_id, tokens=None, salt=None):
        """End sequence ``seq_id`` in both caches, keeping its cells (UnifiedCache2026.
        prefix_release); returns how many leading tokens both caches now hold for it."""
        return self._keep(seq_id, tokens, salt, True, "prefix_release")

    def prefix_publish(self, seq_id, tokens=None, salt=None):
        """Hand what sequence ``seq_id`` holds so far to both caches' indexes while it goes on
        (UnifiedCache2026.prefix_publish); returns how many leading tokens both hold for it."""
        return self._keep(seq_id, tokens, salt, False, "prefix_publish")

    cdef object _keep(self, seq_id, tokens, salt, bint end, str what):
        cdef prefix_req q
        t = prefix_args(&q, seq_id, self.c.base.n_seq_max, tokens, salt, True)
        cdef kvc_retained res
        cdef kvc_unified *parts[2]
        cdef kvc_err err
        cdef int r
        err.msg[0] = 0
        parts[0], parts[1] = self.c.base, self.c.swa
        self._lock_parts(CHANGE, what)
        try:
            self._reuse_on(what)
            with nogil:
                if end:
                    r = kvc_retain_release_parts(parts, 2, q.seq_id, q.salt, q.tokens, q.n, &res, &err)
                else:
                    r = kvc_retain_publish_parts(parts, 2, q.seq_id, q.salt, q.tokens, q.n, &res, &err)
        finally:
            self._unlock_parts(CHANGE)
        spill_flush(self._base)
        spill_flush(self._swa)
        check_status(r, &err, what)
        return int(res.n_kept)

    cdef int _reuse_on(self, str what) except -1:
        # under both caches' locks: another thread's disable_prefix_reuse frees the indexes
        if self.c.base.reuse == NULL:
            raise reuse_off(what)
        return 0

    def prefix_evict(self, n_cells):
        """Evict up to ``n_cells`` cells from each cache's index; returns how many went in all."""
        cdef uint32_t n = <uint32_t>int_c(n_cells, "n_cells", 0, UINT32_MAX), went   # both caches get the same
        cdef kvc_unified *parts[2]
        parts[0], parts[1] = self.c.base, self.c.swa
        self._lock_parts(CHANGE, "prefix_evict")
        try:
            self._reuse_on("prefix_evict")
            went = kvc_retain_evict_parts(parts, 2, n)
        finally:
            self._unlock_parts(CHANGE)
        spill_flush(self._base)     # the write-back sinks once both caches have evicted
        spill_flush(self._swa)
        return int(went)

    def prefix_pin(self, tokens, salt=None, *, pos=None, pos_x=None, pos_y=None):
        """Pin the prefix in both caches (see UnifiedCache2026.prefix_pin; ``pos``, ``pos_x``,
        ``pos_y`` as there); returns the pin. Nothing is pinned when either cache refuses."""
        cdef prefix_req q
        t = prefix_args(&q, NO_SEQ, 0, tokens, salt)
        cdef _PrefixXY xy = prefix_xy(pos, pos_x, pos_y, q.n, kvc_unified_has_ext(self.c.base))
        cdef kvc_prefix_handle h[2]
        cdef kvc_unified *parts[2]
        cdef kvc_err err
        cdef int r
        err.msg[0] = 0
        parts[0], parts[1] = self.c.base, self.c.swa
        self._lock_parts(CHANGE, "prefix_pin")
        try:
            self._reuse_on("prefix_pin")
            r = kvc_retain_pin_parts_xy(parts, 2, q.salt, q.tokens, xy.p, xy.x, xy.y, q.n, h, &err)
        finally:
            self._unlock_parts(CHANGE)
        check_status(r, &err, "prefix_pin")
        return pins_of(h, 2)

    def prefix_unpin(self, pin):
        """Let go of a pin prefix_pin returned (both halves checked before either is let go)."""
        cdef kvc_prefix_handle h[2]
        cdef kvc_unified *parts[2]
        cdef kvc_err err
        cdef int r
        err.msg[0] = 0
        pins_arg(pin, h, 2)
        parts[0], parts[1] = self.c.base, self.c.swa
        self._lock_parts(CHANGE, "prefix_unpin")
        try:
            self._reuse_on("prefix_unpin")
            r = kvc_retain_unpin_parts(parts, 2, h, &err)
        finally:
            self._unlock_parts(CHANGE)
        check_status(r, &err, "prefix_unpin")

    def update(self, rope=None, n_max_nodes=65536):
        """Each cache's StreamUpdate (UnifiedCache.update: its stream copies, then its shifts),
        whatever can_shift says: today's llama.cpp shifts each cache's own cells (a position
        the SWA cache has dropped is not needed; can_shift is only what
        ``llama_memory_can_shift`` reports). Arguments are checked for both caches before
        either changes, and the two are updated as one operation, all or nothing (the rotations
        and their memory are made ready for both before either changes). Returns an
        ISWAUpdatePlan of the two, true when both are."""
        n_max_nodes = int_c(n_max_nodes, "n_max_nodes", INT32_MIN, INT32_MAX)   # read once, for both
        return ISWAUpdatePlan(*_update_parts((self._base, self._swa), rope, n_max_nodes))
