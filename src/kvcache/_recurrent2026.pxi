# The recurrent memory of today's llama.cpp (semantics "2026", llama_memory_recurrent): the sources
# find_slot stages and the zero row rs_z, rollback snapshots, and prefix reuse through checkpoints
# of states (docs/prefix-reuse.md; csrc/kvc_checkpoint.h).


cdef class _Recurrent2026(_Recurrent):
    """Today's recurrent memory (kvcache.RecurrentCache2026 is the documented public class)."""

    __signature__ = _signatures.ClassSignature(_signatures.recurrent)   # semantics None: "2026"

    # --- today's graph inputs and rollback ---------------------------------------------------

    @property
    def rs_z(self) -> int:
        """The cell of the last placed ubatch whose row the graph zeroes (the source of every new
        state), -1 when none."""
        cdef int32_t r
        lock(&self._lock, READ, "rs_z")
        try:
            r = self.c.cells.rs_z
        finally:
            unlock(&self._lock, READ)
        return r

    def pending_rollback(self, seq_id) -> int:
        """The snapshot plane a pending rollback of seq_id makes the next s_copy read (the
        positions it went back), 0 when none."""
        cdef int32_t s = self._seq(seq_id, "seq_id", False)
        cdef uint32_t r
        lock(&self._lock, READ, "pending_rollback")
        try:
            r = self.c.cells.rs_idx[s]
        finally:
            unlock(&self._lock, READ)
        return r

    def rollback_ok(self, seq_id, n) -> bool:
        """Whether a rollback of seq_id's state by n positions would be accepted (what
        seq_rm(seq_id, seq_pos_max(seq_id) - n + 1, -1) answers); nothing changes."""
        cdef int32_t s = self._seq(seq_id, "seq_id", False)
        cdef int32_t r = pos_c(n, "n")
        cdef bint ok
        lock(&self._lock, READ, "rollback_ok")
        try:
            ok = kvc_recurrent_rollback_ok(&self.c, s, r)
        finally:
            unlock(&self._lock, READ)
        return ok

    # --- prefix reuse: checkpoints of states (docs/prefix-reuse.md; csrc/kvc_checkpoint.h) ------
    cdef kvc_ckpt_pool *_pool(self, str what) except NULL:
        if self._ckpt == NULL:
            raise reuse_off(what)
        return self._ckpt

    def enable_prefix_reuse(self, checkpoints=16, per_seq=0, memory=None):
        """Keep checkpoints of sequences' states for later requests. A state exists only at the
        position its sequence reached, so a request can resume only from a state copied when a
        sequence stood exactly there: :meth:`checkpoint` copies a sequence's state (during a
        prefill, at a chunk's end), :meth:`prefix_release` the final one, and
        :meth:`prefix_attach` starts a new sequence from the deepest checkpoint whose tokens
        begin the request.

        ``checkpoints``: the most states the pool holds (each ``prefix_stats["state_bytes"]``
        bytes: every layer's K row and V row of one cell); the least recently used goes first.
        ``per_seq``: the most checkpoints one running sequence keeps (its oldest goes first;
        0: no bound but ``checkpoints``). ``memory``: a writable C-contiguous buffer of at least
        ``checkpoints * state_bytes`` bytes for the states (not the cache's own memory), or None
        for memory the cache allocates; a cache with borrowed buffers needs it (the cache allocates no state memory
        of its own there), one with ``buffers='none'`` has no state to checkpoint (ValueError).
        Calling it again starts a new pool (the checkpoints held go)."""
        cdef _CkptPool p = self._pool_new(checkpoints, per_seq, memory)
        lock(&self._lock, CHANGE, "enable_prefix_reuse")
        try:
            old = _ckpt_swap(self, p)     # let go of after the unlock
        finally:
            unlock(&self._lock, CHANGE)

    cdef _CkptPool _pool_new(self, object checkpoints, object per_seq, object memory):
        """The pool enable_prefix_reuse(checkpoints, per_seq, memory) starts, every argument
        checked, not installed yet (the cache unchanged)."""
        cdef uint32_t cap = <uint32_t>int_c(checkpoints, "checkpoints", 1, UINT32_MAX)
        cdef uint32_t ps = <uint32_t>int_c(per_seq, "per_seq", 0, UINT32_MAX)
        cdef _HeldBuffer hb = None
        cdef uint8_t *mem = NULL
        cdef size_t mem_len = 0
        cdef size_t need
        cdef kvc_err err
        cdef int r
        err.msg[0] = 0
        if self._buffers == "borrowed" and memory is None:
            raise ValueError("enable_prefix_reuse: this cache borrows its buffers; pass memory= (a buffer of "
                             f"checkpoints x {kvc_ckpt_state_bytes(&self.c)} bytes) for the checkpoints' states")
        if memory is not None:
            hb = hold_buffer(memory, "memory", True)
            if not hb.c_contiguous():
                raise ValueError("memory must be C-contiguous")
            need = <size_t>cap * kvc_ckpt_state_bytes(&self.c)
            if <size_t>hb.view.len < need:
                raise ValueError(f"memory holds {hb.view.len} bytes; {cap} checkpoints of "
                                 f"{kvc_ckpt_state_bytes(&self.c)} bytes need {need}")
            # the pool's states must not be the cache's own (a checkpoint would overwrite states)
            _check_disjoint([("memory", <size_t>hb.view.buf, <size_t>hb.view.len)] +
                            _layer_regions(self.c.layers, self.c.n_layer,
                                           <size_t>self.c.cells.size * (1 + <size_t>self.c.n_rs_seq), "the cache's "))
            mem = <uint8_t *>hb.view.buf
            mem_len = <size_t>hb.view.len
        cdef _CkptPool p = _CkptPool.__new__(_CkptPool)
        if hb is not None:
            hb.keep_owner()     # the pool writes it for as long as it lives
        p.mem = hb
        p.pool = <kvc_ckpt_pool *>calloc(1, sizeof(kvc_ckpt_pool))
        if p.pool == NULL:
            raise MemoryError("enable_prefix_reuse")
        r = kvc_ckpt_init(p.pool, &self.c, cap, ps, mem, mem_len, &err)
        if r != KVC_OK:
            free(p.pool)
            p.pool = NULL
            raise_status(r, &err, "enable_prefix_reuse")
        return p

    def disable_prefix_reuse(self):
        """Turn prefix reuse off: every checkpoint goes."""
        lock(&self._lock, CHANGE, "disable_prefix_reuse")
        try:
            old = _ckpt_pool_free(self)     # let go of after the unlock
        finally:
            unlock(&self._lock, CHANGE)

    @property
    def prefix_reuse(self):
        """Whether prefix reuse is on (:meth:`enable_prefix_reuse`)."""
        return self._ckpt != NULL

    @property
    def prefix_stats(self):
        """The checkpoint pool now: ``{"checkpoints": held, "pinned": pinned, "cap": most held,
        "per_seq": most per running sequence (0: no bound), "state_bytes": bytes of one}``; None
        while reuse is off."""
        lock(&self._lock, RUNS_PYTHON, "prefix_stats")
        try:
            if self._ckpt == NULL:
                return None
            return {"checkpoints": int(self._ckpt.n_used), "pinned": int(kvc_ckpt_n_pinned(self._ckpt)),
                    "cap": int(self._ckpt.cap), "per_seq": int(self._ckpt.per_seq),
                    "state_bytes": int(self._ckpt.state_bytes)}
        finally:
            unlock(&self._lock, RUNS_PYTHON)

    def prefix_checkpoints(self):
        """The checkpoints held, shortest first: a list of ``(tokens, pins)``, tokens the chain
        the state is the state after (a list of ints). Empty while reuse is off."""
        cdef uint32_t k, slot
        out = []
        lock(&self._lock, RUNS_PYTHON, "prefix_checkpoints")
        try:
            if self._ckpt != NULL:
                for k in range(self._ckpt.n_used):
                    slot = self._ckpt.order[k]
                    out.append(([self._ckpt.tokens[slot][i] for i in range(self._ckpt.n_tok[slot])],
                                int(self._ckpt.pins[slot])))
        finally:
            unlock(&self._lock, RUNS_PYTHON)
        return out

    def checkpoint(self, seq_id, tokens, salt=None):
        """Copy sequence ``seq_id``'s state into the pool as the state after ``tokens[:P]``, P
        its position + 1 (the state of a prompt's first P tokens at positions 0 .. P - 1;
        ``tokens`` may go on: the rest is not used). Call it once the state is computed: after
        a prefill chunk's ubatch ends at a boundary, or at the end of a prompt. A pending
        rollback's state is the one copied. Returns P, or 0 when it is not kept (every slot it
        could take is pinned). ValueError when seq_id holds no state or tokens is shorter than
        P."""
        cdef prefix_req q
        t = prefix_args(&q, seq_id, self.c.n_seq_max, tokens, salt)
        cdef uint32_t k = 0
        cdef kvc_ckpt_pool *pool
        cdef kvc_err err
        cdef int r
        err.msg[0] = 0
        lock(&self._lock, CHANGE, "checkpoint")
        try:
            pool = self._pool("checkpoint")
            with nogil:
                r = kvc_ckpt_save(pool, &self.c, q.seq_id, q.salt, q.tokens, q.n, NULL, &k, &err)
        finally:
            unlock(&self._lock, CHANGE)
        self._spill_drain()
        check_status(r, &err, "checkpoint")
        return int(k)

    def prefix_match(self, tokens, salt=None):
        """The length of the deepest checkpoint under ``salt`` whose tokens begin ``tokens``, at
        most ``len(tokens) - 1`` (the last token is always computed): what
        :meth:`prefix_attach` would attach. 0 while reuse is off. The checkpoint counts as
        used."""
        cdef prefix_req q
        t = prefix_args(&q, NO_SEQ, 0, tokens, salt)
        cdef uint32_t r = 0
        lock(&self._lock, CHANGE, "prefix_match")
        try:
            with nogil:
                if self._ckpt != NULL:
                    r = kvc_ckpt_match(self._ckpt, q.salt, q.tokens, q.n)
        finally:
            unlock(&self._lock, CHANGE)
        return int(r)

    def prefix_attach(self, seq_id, tokens, salt=None):
        """Start sequence ``seq_id`` (which must hold no state) from the deepest checkpoint
        :meth:`prefix_match` finds: its state is copied into a cell of seq_id at position
        ``k - 1``, placed as :meth:`state_read` places a sequence's state. Returns k: compute
        ``tokens[k:]`` at positions ``k ..`` (0: nothing attached, compute everything)."""
        cdef prefix_req q
        t = prefix_args(&q, seq_id, self.c.n_seq_max, tokens, salt)
        cdef uint32_t k = 0
        cdef kvc_ckpt_pool *pool
        cdef kvc_err err
        cdef int r
        err.msg[0] = 0
        lock(&self._lock, CHANGE, "prefix_attach")
        try:
            pool = self._pool("prefix_attach")
            with nogil:
                r = kvc_ckpt_attach(pool, &self.c, q.seq_id, q.salt, q.tokens, q.n, &k, &err)
        finally:
            unlock(&self._lock, CHANGE)
        check_status(r, &err, "prefix_attach")
        return int(k)

    def prefix_release(self, seq_id, tokens, salt=None):
        """End sequence ``seq_id``, checkpointing its final state first (as :meth:`checkpoint`,
        when it holds one), then removing it (``seq_rm(seq_id)``). ``tokens``: the tokens of the
        request (prompt and output; those past the state's position are not used). Returns the
        length of the checkpoint kept (0: none)."""
        cdef prefix_req q
        t = prefix_args(&q, seq_id, self.c.n_seq_max, tokens, salt)
        cdef uint32_t k = 0
        cdef kvc_ckpt_pool *pool
        cdef kvc_err err
        cdef int r
        err.msg[0] = 0
        lock(&self._lock, CHANGE, "prefix_release")
        try:
            pool = self._pool("prefix_release")
            with nogil:
                r = kvc_ckpt_release(pool, &self.c, q.seq_id, q.salt, q.tokens, q.n, &k, &err)
        finally:
            unlock(&self._lock, CHANGE)
        self._spill_drain()
        check_status(r, &err, "prefix_release")
        return int(k)

    def prefix_pin(self, tokens, salt=None):
        """Keep the checkpoint of exactly ``tokens`` (ValueError when none is held) until
        :meth:`prefix_unpin`; returns the pin (an opaque int). Pins count."""
        cdef prefix_req q
        t = prefix_args(&q, NO_SEQ, 0, tokens, salt)
        cdef kvc_ckpt_pool *pool
        cdef kvc_ckpt_handle h
        cdef kvc_err err
        cdef int r
        err.msg[0] = 0
        lock(&self._lock, CHANGE, "prefix_pin")
        try:
            pool = self._pool("prefix_pin")
            r = kvc_ckpt_pin(pool, q.salt, q.tokens, q.n, &h, &err)
        finally:
            unlock(&self._lock, CHANGE)
        check_status(r, &err, "prefix_pin")
        return pin_of(h.gen, h.slot)

    def prefix_unpin(self, pin):
        """Let go of a pin :meth:`prefix_pin` returned (ValueError for anything else)."""
        cdef kvc_ckpt_handle h
        pin_arg(pin, &h.slot, &h.gen)
        cdef kvc_ckpt_pool *pool
        cdef kvc_err err
        cdef int r
        err.msg[0] = 0
        lock(&self._lock, CHANGE, "prefix_unpin")
        try:
            pool = self._pool("prefix_unpin")
            r = kvc_ckpt_unpin(pool, h, &err)
        finally:
            unlock(&self._lock, CHANGE)
        check_status(r, &err, "prefix_unpin")

    def prefix_evict(self, n_checkpoints):
        """Drop up to ``n_checkpoints`` unpinned checkpoints now, least recently used first;
        returns how many went."""
        cdef uint32_t n = <uint32_t>int_c(n_checkpoints, "n_checkpoints", 0, UINT32_MAX), r
        cdef kvc_ckpt_pool *pool
        lock(&self._lock, CHANGE, "prefix_evict")
        try:
            pool = self._pool("prefix_evict")
            r = kvc_ckpt_evict(pool, n)
        finally:
            unlock(&self._lock, CHANGE)
        self._spill_drain()
        return int(r)

    # --- write-back at eviction (kvcache.store.PrefixStore.write_back; csrc/kvc_checkpoint.h) --
    def _spill_set(self, sink, chunk_tokens=1):
        """Write-back at eviction: with a callable sink, every checkpoint the pool evicts whose
        length is a multiple of chunk_tokens is recorded (its state copied) before its slot is
        reused, and after the operation (checkpoint, prefix_release, prefix_evict; a hybrid
        cache's own releases too) ``sink(cache, records)`` is called with a list of ``(salt hash,
        tokens, state)`` (the chain as int32, the state as bytes of the checkpoint layout),
        exceptions it raises ignored; sink None: off. A new pool (enable_prefix_reuse) or
        disable_prefix_reuse turns it off."""
        cdef uint32_t m = <uint32_t>int_c(chunk_tokens, "chunk_tokens", 1, UINT32_MAX)
        cdef kvc_ckpt_pool *pool
        cdef kvc_err err
        cdef int r
        err.msg[0] = 0
        sink = spill_sink_arg(sink)
        lock(&self._lock, CHANGE, "write_back")
        try:
            pool = self._pool("write_back")
            r = kvc_ckpt_spill_set(pool, sink is not None, m, &err)
        finally:
            unlock(&self._lock, CHANGE)
        check_status(r, &err, "write_back")
        self._spill_sink = sink

    cdef int _spill_drain(self) except -1:
        # the checkpoints the operation just evicted to the sink, if one is set (after every
        # operation that evicts); the records are built apart (no memoryview set up without a sink)
        if self._spill_sink is None:
            return 0
        return self._spill_deliver()

    cdef int _spill_deliver(self) except -1:
        # the pool is read under the lock: another thread may have dropped it since the operation
        cdef kvc_ckpt_pool *pool
        cdef kvc_ckpt_spill *sp
        cdef uint32_t k, j, n
        cdef int32_t[::1] tv
        cdef uint8_t *p
        out = []
        lock(&self._lock, RUNS_PYTHON, "write_back")
        try:
            pool = self._ckpt
            if pool == NULL or pool.spill == NULL or pool.spill.n == 0:
                return 0
            sp = pool.spill
            sink = self._spill_sink
            for k in range(sp.n):
                n = sp.n_tok[k]
                toks = np.empty(n, dtype=np.int32)
                tv = toks
                for j in range(n):
                    tv[j] = sp.tokens[k][j]
                state = new_state_bytes(pool.state_bytes, &p)
                memcpy(p, kvc_ckpt_spill_state(pool, k), pool.state_bytes)
                out.append((int(sp.salt[k]), toks, state))
            kvc_ckpt_spill_clear(pool)
        finally:
            unlock(&self._lock, RUNS_PYTHON)
        return spill_deliver(sink, self, out)

    @property
    def _spill_lost(self):
        """Evicted checkpoints write-back at eviction could not record (no memory, a full list)."""
        lock(&self._lock, READ, "_spill_lost")
        try:
            return 0 if self._ckpt == NULL or self._ckpt.spill == NULL else int(self._ckpt.spill.n_lost)
        finally:
            unlock(&self._lock, READ)

    # --- the prefix store's access to checkpoints (kvcache.store) -------------------------------
    def _store_checkpoint(self, tokens, salt=None):
        """The checkpoint of exactly ``tokens`` under ``salt`` as bytes of the checkpoint layout,
        or None (none held, or reuse off). Not a use of it."""
        cdef prefix_req q
        t = prefix_args(&q, NO_SEQ, 0, tokens, salt)
        cdef uint8_t *p
        cdef bint found = False
        out = new_state_bytes(kvc_ckpt_state_bytes(&self.c), &p)
        lock(&self._lock, READ, "save")
        try:
            if self._ckpt != NULL and q.n:
                found = kvc_ckpt_copy_out(self._ckpt, q.salt, q.tokens, q.n, p)
        finally:
            unlock(&self._lock, READ)
        return out if found else None

    def _prefix_check(self):
        """Raise RuntimeError unless the checkpoint pool's records agree (for tests)."""
        cdef kvc_err err
        cdef int r = KVC_OK
        err.msg[0] = 0
        lock(&self._lock, READ, "_prefix_check")
        try:
            if self._ckpt != NULL:
                r = kvc_ckpt_check(self._ckpt, &err)
        finally:
            unlock(&self._lock, READ)
        if r != KVC_OK:
            raise RuntimeError(err.msg.decode())
