# _parts: operations over several caches at once, all or nothing, for the composite caches (the
# iSWA pair, the hybrid memory) and the multi-part states: the caches' locks taken in one global
# order (_Hold holds them for a block), updates and states of one part per cache.

from kvcache.includes.kvc_state cimport KVC_STATE_MAX_PARTS


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


cdef kvc_lock *_lock_of(object obj) except NULL:
    """The lock of a cache or Batch."""
    if isinstance(obj, _Unified):
        return &(<_Unified>obj)._lock
    if isinstance(obj, _Recurrent):
        return &(<_Recurrent>obj)._lock
    if isinstance(obj, Batch):
        return &(<Batch>obj)._lock
    raise TypeError(f"{type(obj).__name__} has no kvcache lock")


cdef int lock_all(list order, int how, str what) except -1:
    """lock() of every cache of order (_lock_order's), or of none when one refuses (RuntimeError).
    Release with unlock_all(order, how)."""
    cdef Py_ssize_t k
    for k in range(len(order)):
        try:
            lock(_lock_of(order[k]), how, what)
        except BaseException:
            unlock_all(order[:k], how)
            raise
    return 0


cdef int unlock_all(list order, int how) except -1:
    for c in reversed(order):
        unlock(_lock_of(c), how)
    return 0


cdef class _Hold:
    """``with _Hold(a, b, ...):`` holds the locks of those caches (a composite cache's parts)
    for the block, so that an operation on all of them is atomic for other threads. The
    locks are reentrant: the caches' own methods can be called inside. With ``busy=True`` the
    block is one operation of the caches: a change of either from a callback the block runs
    (a file's write(), an exporter's hooks) is refused, reads are not.

    Only the thread that entered it can exit it, once per entry (RuntimeError otherwise)."""
    cdef list _order
    cdef int _how              # READ, or RUNS_PYTHON with busy=True
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
        self._how = RUNS_PYTHON if bool_arg(busy, "busy") else READ

    def __enter__(self):
        lock_all(self._order, self._how, "_Hold")
        self._depth += 1
        return self

    def __exit__(self, *exc):
        for c in self._order:
            if not lock_mine(_lock_of(c)):
                raise RuntimeError("_Hold.__exit__: this thread does not hold the caches' locks")
        if self._depth == 0:
            raise RuntimeError("_Hold.__exit__: this hold was not entered")
        self._depth -= 1
        unlock_all(self._order, self._how)
        return False


def _update_parts(caches, rope=None, n_max_nodes=65536):
    """update(rope, n_max_nodes) of several caches, all or nothing: arguments, rotations and
    their memory are checked for every cache before the first one changes. Returns their
    UpdatePlans."""
    cdef tuple cs = _caches_arg(caches)
    cdef _Unified c
    cdef int32_t nmax = <int32_t>int_c(n_max_nodes, "n_max_nodes", INT32_MIN, INT32_MAX)
    for c in cs:
        c._check_update(rope, nmax)
    order = _lock_order(cs)
    lock_all(order, RUNS_PYTHON | CHANGE, "update")
    try:
        return _update_caches(cs, rope, nmax)
    finally:
        unlock_all(order, RUNS_PYTHON | CHANGE)


def _state_size_parts(caches, seq_id=-1, layout=DEFAULT_LAYOUT, prefix=None):
    """Bytes of the state of seq_id (-1: all) over several caches: the sum of their parts (the
    sequence-blob prefix, when the layout has one, once in front of the first)."""
    cdef state_codec k
    return cache_state_size(_parts_codec(&k, caches), &k, seq_id, layout, prefix)


def _state_write_parts(caches, seq_id=-1, layout=DEFAULT_LAYOUT, prefix=None):
    """The state of seq_id (-1: all) of several caches as one blob: their parts in order (the
    sequence-blob prefix, when the layout has one, once in front of the first)."""
    cdef state_codec k
    return cache_state_write(_parts_codec(&k, caches), &k, seq_id, layout, prefix)


def _state_read_parts(caches, data, seq_id=-1, *, convert=False, exact=False, layout=None):
    """Read a blob of consecutive parts, part k into caches[k], for seq_id (-1: whole caches).

    All or nothing: on failure (StateError naming the part) every cache is exactly as it was.
    Returns the bytes consumed (bytes after the last part are not read, unless exact: then they
    are an error). convert: accept and convert parts whose V layout differs from their cache's.
    layout: a name of LAYOUTS, or None to find it from the bytes (kvc_unified_state_read_parts_lay)."""
    cdef state_codec k
    return cache_state_read(_parts_codec(&k, caches), &k, data, seq_id, convert, exact, layout)


cdef list _parts_codec(state_codec *k, object caches):
    """k: the codec of the blob of several caches' parts (_caches_arg); returns their lock order."""
    cdef tuple cs = _caches_arg(caches)
    state_codec_parts(k, cs)
    return _lock_order(cs)


def _lock_state(obj):
    """The lock of a cache or Batch as seen from this thread (for tests):
    ``{"mine": held by this thread, "waiting": threads blocked on it, "busy": operations of the
    holder in progress (meaningful when mine)}``."""
    cdef kvc_lock *l = _lock_of(obj)
    mine = lock_mine(l)
    return {"mine": mine, "waiting": kvc_lock_waiting(l), "busy": l.busy if mine else 0}
