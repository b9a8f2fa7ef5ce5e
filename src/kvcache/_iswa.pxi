# _iswa: what the interleaved sliding-window cache (kvcache.iswa.ISWACache, a composition of two
# UnifiedCore objects) needs from C: its pending pruning ranges, and states made of one part per
# cache, read all or nothing.

from kvcache.includes.kvc_iswa cimport kvc_iswa_pending, kvc_iswa_pending_clear, kvc_iswa_pending_set
from kvcache.includes.kvc_state cimport (kvc_unified_state_size_lay, kvc_unified_state_write_range_lay,
                                         kvc_unified_state_read_parts_lay, KVC_STATE_MAX_PARTS)
from kvcache.includes.kvc_unified cimport kvc_unified_mark, kvc_unified_mark_take, kvc_unified_rewind


cdef class SWAPending:
    """The pending SWA-pruning ranges of an iSWA cache: per sequence, the smallest and largest
    position of the batch last given to :meth:`set` (committing prunes the SWA cache with them)."""
    cdef kvc_iswa_pending c        # per sequence: the smallest and largest position of the last batch
    cdef kvc_pylock _lock          # held by every method

    def __cinit__(self):
        if kvc_pylock_init(&self._lock) != 0:
            raise MemoryError("SWAPending: cannot allocate its lock")
        kvc_iswa_pending_clear(&self.c)

    def __dealloc__(self):
        kvc_pylock_free(&self._lock)

    def set(self, batch, n_seq_max, record=True):
        """Replace the ranges by those of ``batch`` (a :class:`Batch` or a :class:`UBatch`).

        Every sequence id must lie in ``[0, n_seq_max)`` (ValueError, ranges unchanged). With
        ``record=False`` the ids are checked and the ranges cleared."""
        cdef kvc_err err
        cdef uint32_t n, nmax = <uint32_t>int_c(n_seq_max, "n_seq_max", 1, KVC_MAX_SEQ)
        cdef const int32_t *pos
        cdef const uint32_t *off
        cdef const int32_t *ids
        cdef bint rec = bool(record)
        cdef int rc
        err.msg[0] = 0
        if isinstance(batch, Batch):
            n = (<Batch>batch).c.n_tokens
            pos = (<Batch>batch).c.pos
            off = (<Batch>batch).c.seq_off
            ids = (<Batch>batch).c.seq_ids
        elif isinstance(batch, UBatch):
            if (<UBatch>batch).c.n_seq_tokens != 1:
                raise ValueError(f"batch: expected a UBatch of one token per group (n_seq_tokens = 1, as "
                                 f"UBatch(pos, seq_id) builds and a simple split gives), found n_seq_tokens = "
                                 f"{(<UBatch>batch).c.n_seq_tokens}")
            n = (<UBatch>batch).c.n_tokens
            pos = (<UBatch>batch).c.pos
            off = (<UBatch>batch).c.seq_off
            ids = (<UBatch>batch).c.seq_ids
        else:
            raise TypeError(f"batch must be a Batch or a UBatch, not {type(batch).__name__}")
        if isinstance(batch, Batch):
            kvc_pylock_acquire(&(<Batch>batch)._lock)     # its arrays stay put while splits run
        lock_change(&self._lock, "SWAPending.set")
        with nogil:
            rc = kvc_iswa_pending_set(&self.c, n, pos, off, ids, nmax, rec, &err)
            kvc_pylock_release(&self._lock)
        if isinstance(batch, Batch):
            kvc_pylock_release(&(<Batch>batch)._lock)
        check_status(rc, &err, "sbatch_init")

    def clear(self):
        """Forget every range."""
        lock_change(&self._lock, "SWAPending.clear")
        kvc_iswa_pending_clear(&self.c)
        kvc_pylock_release(&self._lock)

    def items(self):
        """``[[seq_id, pmin, pmax], ...]`` in ascending sequence order."""
        cdef kvc_iswa_pending c
        cdef int s
        kvc_pylock_acquire(&self._lock)
        c = self.c
        kvc_pylock_release(&self._lock)
        out = []
        for s in range(KVC_MAX_SEQ):
            if (c.seqs.w[s >> 6] >> (s & 63)) & 1:
                out.append([s, c.pmin[s], c.pmax[s]])
        return out

    def __len__(self):
        return len(self.items())

    def __repr__(self):
        return f"SWAPending({self.items()})"


cdef tuple _caches_arg(object caches):
    """The caches of a multi-part state: a non-empty sequence of distinct UnifiedCore objects."""
    caches = tuple(caches)
    if not 1 <= len(caches) <= KVC_STATE_MAX_PARTS:
        raise ValueError(f"caches: 1 to {KVC_STATE_MAX_PARTS} caches expected, got {len(caches)}")
    for i, c in enumerate(caches):
        if not isinstance(c, _Unified):
            raise TypeError(f"caches[{i}] must be a UnifiedCache, not {type(c).__name__}")
        for j in range(i):
            if caches[j] is c:
                raise ValueError(f"caches[{j}] and caches[{i}] are the same cache")
    return caches


# --- several caches at once: locked in ascending address order, all or nothing -------------

cdef list _lock_order(tuple caches):
    """The order in which several caches are locked: by address, the same everywhere, so that
    two threads locking overlapping sets cannot wait for each other."""
    return sorted(caches, key=id)


cdef kvc_pylock *_lock_of(object obj) except NULL:
    """The lock of a cache, Batch or SWAPending."""
    if isinstance(obj, _Unified):
        return &(<_Unified>obj)._lock
    if isinstance(obj, _Recurrent):
        return &(<_Recurrent>obj)._lock
    if isinstance(obj, Batch):
        return &(<Batch>obj)._lock
    if isinstance(obj, SWAPending):
        return &(<SWAPending>obj)._lock
    raise TypeError(f"{type(obj).__name__} has no kvcache lock")


cdef void _lock_all(list order):
    for c in order:
        kvc_pylock_acquire(_lock_of(c))


cdef void _unlock_all(list order):
    for c in reversed(order):
        kvc_pylock_release(_lock_of(c))


cdef int _begin_all(list order, bint change, str what) except -1:
    """op_begin on every cache of order, or on none (RuntimeError) when one is mid-operation."""
    cdef Py_ssize_t k
    for k in range(len(order)):
        try:
            op_begin(_lock_of(order[k]), change, what)
        except RuntimeError:
            _end_all(order[:k])
            raise
    return 0


cdef void _end_all(list order):
    for c in reversed(order):
        op_end(_lock_of(c))


cdef class _Hold:
    """``with _Hold(a, b, ...):`` holds the locks of those caches (a composite cache's parts)
    for the block, so that an operation on all of them is atomic for other threads. The
    locks are reentrant: the caches' own methods can be called inside. With ``busy=True`` the
    block is one operation of the caches: a change of either from a callback the block runs
    (a file's write(), an exporter's hooks) is refused, reads are not.

    Only the thread that entered it can exit it, once per entry (RuntimeError otherwise)."""
    cdef list _order
    cdef bint _busy
    cdef Py_ssize_t _depth     # entries not exited yet (read and written by the holder only)

    def __cinit__(self, *caches, busy=False):
        if not caches:
            raise ValueError("_Hold: no cache given")
        for i, c in enumerate(caches):
            if not isinstance(c, (_Unified, _Recurrent)):
                raise TypeError(f"caches[{i}] must be a kvcache cache, not {type(c).__name__}")
            if any(c is d for d in caches[:i]):
                raise ValueError(f"caches[{i}] is given twice")
        self._order = _lock_order(tuple(caches))
        self._busy = bool_arg(busy, "busy")

    def __enter__(self):
        if self._busy:
            _begin_all(self._order, False, "_Hold")
        else:
            _lock_all(self._order)
        self._depth += 1
        return self

    def __exit__(self, *exc):
        for c in self._order:
            if not kvc_pylock_mine(_lock_of(c)):
                raise RuntimeError("_Hold.__exit__: this thread does not hold the caches' locks")
        if self._depth == 0:
            raise RuntimeError("_Hold.__exit__: this hold was not entered")
        self._depth -= 1
        if self._busy:
            _end_all(self._order)
        else:
            _unlock_all(self._order)
        return False


def _find_slot_parts(caches, ub):
    """find_slot of ub in each cache in turn (all are tried, as llama.cpp does); returns the
    list of their answers. Semantics '2025': when one raises (MemoryError), the find_slot calls
    that succeeded before it are undone exactly, so every cache is as it was. Semantics '2026'
    (every cache of it): all or nothing, as today's llama.cpp prepares every cache before it
    applies any: the ubatch is placed in every cache when each finds room, else in none."""
    cdef UBatch u = ubatch_c(ub)
    cdef tuple cs = _caches_arg(caches)
    cdef _Unified c
    cdef kvc_unified_mark marks[KVC_STATE_MAX_PARTS]
    cdef kvc_unified *ptrs[KVC_STATE_MAX_PARTS]
    cdef int room[KVC_STATE_MAX_PARTS]
    cdef kvc_err err
    cdef Py_ssize_t k, j, n = len(cs)
    cdef int r
    err.msg[0] = 0
    for c in cs:
        u.check(c.c.n_seq_max, kvc_unified_has_ext(&c.c))
    sems = {(<_Unified>c).c.semantics for c in cs}
    if len(sems) != 1:
        raise ValueError("find_slot: the caches have different semantics")
    order = _lock_order(cs)
    _begin_all(order, True, "find_slot")
    if KVC_SEM_2026 in sems:
        try:
            for k in range(n):
                c = cs[k]
                ptrs[k] = &c.c
            with nogil:
                r = kvc_unified_find_slot_2026_parts(ptrs, <uint32_t>n, &u.c, room, &err)
            if r < 0:
                raise_status(r, &err, "find_slot")
            return [room[k] == 1 for k in range(n)]
        finally:
            _end_all(order)
    try:
        for k in range(n):
            c = cs[k]
            kvc_unified_mark_take(&c.c, &marks[k])
        found = []
        for k in range(n):
            c = cs[k]
            with nogil:
                r = c.find_slot_c(&u.c)
            if r < 0:
                for j in range(k - 1, -1, -1):
                    c = cs[j]
                    if kvc_unified_rewind(&c.c, &marks[j]) != KVC_OK:
                        raise RuntimeError("find_slot: cannot undo the first part (internal error)")
                raise_status(r, NULL, "find_slot")
            found.append(r == 1)
        return found
    finally:
        _end_all(order)


def _update_parts(caches, rope=None, n_max_nodes=65536):
    """update(rope, n_max_nodes) of several caches, all or nothing: arguments, rotations and
    their memory are checked for every cache before the first one changes. Returns their
    UpdatePlans."""
    cdef tuple cs = _caches_arg(caches)
    cdef _Unified c
    cdef int32_t nmax = <int32_t>int_c(n_max_nodes, "n_max_nodes", INT32_MIN, INT32_MAX)
    for c in cs:
        c._check_update(rope, n_max_nodes)
    order = _lock_order(cs)
    _begin_all(order, True, "update")
    try:
        return _update_caches(cs, rope, nmax)
    finally:
        _end_all(order)


def _state_size_parts(caches, seq_id=-1, layout=DEFAULT_LAYOUT, prefix=None):
    """Bytes of the state of seq_id (-1: all) over several caches: the sum of their parts (the
    sequence-blob prefix, when the layout has one, once in front of the first)."""
    cdef tuple cs = _caches_arg(caches)
    cdef _Unified c
    cdef size_t total = 0
    cdef int32_t s = -1
    cdef Py_ssize_t k
    for c in cs:
        s = seq_c(seq_id, c.c.n_seq_max, "seq_id", True)
    cdef unsigned bits = write_layout_bits(layout, prefix, s)
    for c in cs:
        _check_state_layout(c, bits, "state_size")
    order = _lock_order(cs)
    _lock_all(order)
    for k in range(len(cs)):
        c = cs[k]
        total += kvc_unified_state_size_lay(&c.c, s, bits if k == 0 else bits & ~(<unsigned>KVC_LAYOUT_PREFIX))
    _unlock_all(order)
    return total


def _state_write_parts(caches, seq_id=-1, layout=DEFAULT_LAYOUT, prefix=None):
    """The state of seq_id (-1: all) of several caches as one blob: their parts in order (the
    sequence-blob prefix, when the layout has one, once in front of the first)."""
    cdef tuple cs = _caches_arg(caches)
    cdef _Unified c
    cdef int32_t s = -1
    cdef unsigned bits, part_bits
    cdef size_t sizes[KVC_STATE_MAX_PARTS]
    cdef size_t total = 0, off = 0, written
    cdef Py_ssize_t k, n = len(cs)
    cdef int r
    cdef uint8_t *p
    for k in range(n):
        c = cs[k]
        s = seq_c(seq_id, c.c.n_seq_max, "seq_id", True)
    bits = write_layout_bits(layout, prefix, s)
    for k in range(n):
        _check_state_layout(cs[k], bits, "state_write")
    order = _lock_order(cs)
    _begin_all(order, False, "state_write")
    try:
        for k in range(n):
            c = cs[k]
            sizes[k] = kvc_unified_state_size_lay(&c.c, s, bits if k == 0 else bits & ~(<unsigned>KVC_LAYOUT_PREFIX))
            total += sizes[k]
        out = new_state_bytes(total, &p)
        for k in range(n):
            c = cs[k]
            written = 0
            part_bits = bits if k == 0 else bits & ~(<unsigned>KVC_LAYOUT_PREFIX)
            with nogil:
                r = kvc_unified_state_write_range_lay(&c.c, s, part_bits | KVC_LAYOUT_FRESH_OUT, 0, p + off, sizes[k],
                                                      &written)
            if r < 0:
                raise_status(r, NULL, "state_write")
            if written != sizes[k]:
                raise RuntimeError(f"state_write wrote {written} bytes, expected {sizes[k]} (internal error)")
            off += written
    finally:
        _end_all(order)
    return out


def _state_read_parts(caches, data, seq_id=-1, *, convert=False, exact=False, layout=None):
    """Read a blob of consecutive parts, part k into caches[k], for seq_id (-1: whole caches).

    All or nothing: on failure (StateError naming the part) every cache is exactly as it was.
    Returns the bytes consumed (bytes after the last part are not read, unless exact: then they
    are an error). convert: accept and convert parts whose V layout differs from their cache's.
    layout: a name of LAYOUTS, or None to find it from the bytes (kvc_unified_state_read_parts_lay)."""
    cdef tuple cs = _caches_arg(caches)
    cdef kvc_unified *ptrs[KVC_STATE_MAX_PARTS]
    cdef _Unified c
    cdef Py_ssize_t k, n = len(cs)
    cdef int32_t s = 0
    cdef unsigned flags = state_read_flags(convert, exact)
    cdef unsigned bits = read_layout_bits(layout)
    for k in range(n):
        c = cs[k]
        s = seq_c(seq_id, c.c.n_seq_max, "seq_id", True)
        ptrs[k] = &c.c
    cdef size_t nbytes = 0, consumed = 0
    cdef _HeldBuffer keep = state_data_view(data)
    cdef const uint8_t *ptr = state_data_ptr(keep, &nbytes)
    cdef kvc_err err
    cdef int r
    err.msg[0] = 0
    order = _lock_order(cs)
    try:
        _begin_all(order, True, "state_read")
    except RuntimeError:
        keep.release()
        raise
    try:
        with nogil:
            r = kvc_unified_state_read_parts_lay(ptrs, <uint32_t>n, s, ptr, nbytes, flags, bits, &consumed, NULL,
                                                 &err)
    finally:
        _end_all(order)
        keep.release()
    if r < 0:
        raise_status(r, &err, "state_read")
    return consumed


def _lock_state(obj):
    """The lock of a cache, Batch or SWAPending as seen from this thread (for tests):
    ``{"mine": held by this thread, "waiting": threads blocked on it, "busy": operations of the
    holder in progress (meaningful when mine)}``."""
    cdef kvc_pylock *l = _lock_of(obj)
    mine = kvc_pylock_mine(l)
    return {"mine": mine, "waiting": kvc_pylock_waiting(l), "busy": l.busy if mine else 0}
