# Handing one sequence of a unified cache to another process (csrc/kvc_handoff.h): the export
# (header + the regions of its K/V rows) and the transactional import on the receiving side.

cimport cython
from kvcache.includes.kvc_handoff cimport (kvc_run, kvc_handoff_export, kvc_handoff_export_make,
                                           kvc_handoff_export_free, kvc_handoff_n_regions,
                                           kvc_handoff_regions, kvc_handoff_gather, kvc_handoff_scatter,
                                           kvc_handoff_import, kvc_handoff_import_begin,
                                           kvc_handoff_import_begin_empty, kvc_handoff_import_begin_parts,
                                           kvc_handoff_import_check, kvc_handoff_import_commit,
                                           kvc_handoff_import_abort)


cdef object _regions_array(const kvc_unified *c, uint32_t stream, const kvc_run *runs, uint32_t n_runs):
    """The regions of the K/V of the runs' cells of a stream as a read-only (N, 2) uint64 array
    of (address, length)."""
    cdef uint64_t n = kvc_handoff_n_regions(c, n_runs)
    out = np.empty((n, 2), dtype=np.uint64)
    cdef uint64_t[:, ::1] v = out
    if n:
        with nogil:
            kvc_handoff_regions(c, stream, runs, n_runs, &v[0, 0])
    out.flags.writeable = False
    return out


cdef object _cells_array(const kvc_run *runs, uint32_t n_runs):
    """The runs' cell indices, in order, as a read-only int32 array."""
    parts = [np.arange(runs[r].first, runs[r].first + runs[r].n, dtype=np.int32) for r in range(n_runs)]
    out = np.concatenate(parts) if parts else np.empty(0, dtype=np.int32)
    out.flags.writeable = False
    return out


_MADE_BY_EXPORT = "SeqExport is made by UnifiedCache.seq_export"


@cython.final
cdef class SeqExport:
    """One sequence of a UnifiedCache, ready for a transfer (``UnifiedCache.seq_export``).

    ``header``: bytes naming the sequence's cells and positions and the cache's geometry (layout:
    docs/disaggregated.md). ``regions``: (N, 2) uint64 array of (address, length) of its K/V bytes
    inside the cache's buffers, in the order of a state's data section (transposed V: one region
    per row element and run of cells); empty without K/V memory. ``cells``: the source cells
    (in the sequence's stream, for a cache of several streams).
    The addresses stay valid while the cache is alive and unchanged."""
    cdef kvc_handoff_export e
    cdef readonly object cache
    cdef readonly int seq_id
    cdef readonly bytes header
    cdef readonly object regions
    cdef readonly object cells

    def __init__(self):
        raise TypeError(_MADE_BY_EXPORT)

    def __dealloc__(self):
        kvc_handoff_export_free(&self.e)

    @property
    def n_bytes(self):
        """Bytes of K/V the regions hold (the sum of their lengths)."""
        return self.e.data_bytes

    @property
    def n_cells(self):
        """Cells of the sequence."""
        return self.e.cell_count

    def gather(self, out=None):
        """Copy the regions' bytes, in order, into out (a writable C-contiguous buffer of n_bytes
        bytes) or a new uint8 array; returns it."""
        if self.cache is None:      # an object of SeqExport.__new__: no cache, no sequence
            raise TypeError(_MADE_BY_EXPORT)
        cdef _Unified c = <_Unified>self.cache
        if out is None:
            out = np.empty(self.e.data_bytes, dtype=np.uint8)
        target = state_target(out)
        if not isinstance(target, _HeldBuffer):
            raise TypeError(f"out must be a writable buffer, not {type(out).__name__}")
        cdef _HeldBuffer hb = <_HeldBuffer>target
        try:
            if <uint64_t>hb.view.len != self.e.data_bytes:
                raise ValueError(f"out holds {hb.view.len} bytes, the sequence's K/V {self.e.data_bytes}")
            lock(&c._lock, READ, "gather")
            try:
                with nogil:
                    if self.e.data_bytes:
                        kvc_handoff_gather(&c.c, self.e.stream, self.e.runs, self.e.n_runs, <uint8_t *>hb.view.buf)
            finally:
                unlock(&c._lock, READ)
        finally:
            hb.release()
        return out

    def __repr__(self):
        n_regions = 0 if self.regions is None else len(self.regions)
        return (f"SeqExport(seq_id={self.seq_id}, cells={self.e.cell_count}, regions={n_regions}, "
                f"n_bytes={self.e.data_bytes}, header={len(self.header or b"")} bytes)")


def _seq_export(_Unified cache not None, seq_id):
    """UnifiedCache.seq_export (see there)."""
    cdef int32_t s = seq_c(seq_id, cache.c.n_seq_max, "seq_id", False)
    cdef SeqExport x = SeqExport.__new__(SeqExport)
    cdef kvc_err err
    cdef int r
    _settle(cache, "seq_export")
    lock(&cache._lock, READ, "_seq_export")
    try:
        with nogil:
            r = kvc_handoff_export_make(&cache.c, s, &x.e, &err)
        check_status(r, &err, "seq_export")
        x.cache = cache
        x.seq_id = s
        x.header = PyBytes_FromStringAndSize(<const char *>x.e.header, <Py_ssize_t>x.e.header_len)
        x.regions = _regions_array(&cache.c, x.e.stream, x.e.runs, x.e.n_runs)
        x.cells = _cells_array(x.e.runs, x.e.n_runs)
    finally:
        unlock(&cache._lock, READ)
    return x


def _seq_export_parts(caches, seq_id):
    """seq_export of every cache of a composite (an iSWA pair), all of one moment: their locks
    are held as one operation over the exports (a change from another thread waits, one from
    this thread's finalizers is refused). Returns the SeqExports, in the order given."""
    cdef tuple cs = _caches_arg(caches)
    cdef _Unified c = cs[0]
    seq_id = seq_c(seq_id, c.c.n_seq_max, "seq_id", False)     # read once, before the locks
    order = _lock_order(cs)
    lock_all(order, RUNS_PYTHON, "seq_export")
    try:
        for c in cs:
            with nogil:
                kvc_unified_defrag_settle(&c.c)     # (what _seq_export's _settle would do)
        return [_seq_export(c, seq_id) for c in cs]
    finally:
        unlock_all(order, RUNS_PYTHON)


@cython.final
@cython.no_gc_clear
cdef class SeqImport:
    """A sequence being received into a UnifiedCache (``UnifiedCache.seq_import_begin``).

    ``regions``: (N, 2) uint64 array of (address, length) of the reserved cells' K/V bytes, in
    the order of the exporter's regions (the same bytes, split where either side's cells are
    not adjacent: pair them with ``kvcache.handoff.pair_regions``); ``cells``: the reserved
    cells. Write the transfer into the regions (or ``scatter`` a buffer), then ``commit()``;
    ``abort()``, an exception in a ``with`` block or the garbage collector before commit put
    every byte back. Until then the cache refuses changes (RuntimeError)."""
    cdef kvc_handoff_import imp
    cdef _Unified _cache
    cdef readonly object regions
    cdef readonly object cells
    cdef readonly int seq_id

    def __init__(self):
        raise TypeError("SeqImport is made by UnifiedCache.seq_import_begin")

    def __dealloc__(self):
        if self.imp.active:
            self._finish(False)

    cdef int _finish(self, bint commit) except -1:
        cdef kvc_err err
        cdef int r = 0
        lock(&self._cache._lock, READ, "_finish")
        try:
            # a commit changes the cells: refused from a callback of an operation on the cache
            # (an abort puts back bytes of cells no operation reads)
            if commit:
                self._require_active("commit")   # again: another thread may have ended it meanwhile
                if self._cache._lock.busy:
                    raise_busy("commit")
            with nogil:
                if commit:
                    r = kvc_handoff_import_commit(&self.imp, &err)
                else:
                    kvc_handoff_import_abort(&self.imp)
        finally:
            unlock(&self._cache._lock, READ)
        check_status(r, &err, "commit")
        return 0

    @property
    def active(self):
        """True until commit() or abort()."""
        return bool(self.imp.active)

    @property
    def n_bytes(self):
        """Bytes of K/V the regions hold."""
        return self.imp.data_bytes

    @property
    def n_cells(self):
        """Cells of the sequence."""
        return self.imp.cell_count

    cdef int _require_active(self, str what) except -1:
        if not self.imp.active:
            raise RuntimeError(f"{what}: the import is no longer active (committed or aborted)")
        return 0

    def scatter(self, data):
        """Copy data (any C-contiguous buffer of n_bytes bytes, read-only ones included: the
        exporter's gather(), a Ray object) into the regions, in order."""
        self._require_active("scatter")
        cdef _HeldBuffer hb = state_data_view(data)
        try:
            lock(&self._cache._lock, READ, "scatter")
            try:
                # again under the lock: another thread may have ended the import meanwhile
                self._require_active("scatter")
                if <uint64_t>hb.view.len != self.imp.data_bytes:
                    raise ValueError(f"data holds {hb.view.len} bytes, the sequence's K/V {self.imp.data_bytes}")
                with nogil:
                    if self.imp.data_bytes:
                        kvc_handoff_scatter(&self._cache.c, self.imp.stream, self.imp.runs, self.imp.n_runs,
                                            <const uint8_t *>hb.view.buf)
            finally:
                unlock(&self._cache._lock, READ)
        finally:
            hb.release()

    def check(self):
        """Raise StateError when the cache changed since the import began (commit would refuse
        it); RuntimeError when the import is no longer active, or when called from a callback of
        an operation on the cache (commit is refused there too). Lets an import of several parts
        check them all before committing any."""
        self._require_active("check")
        cdef kvc_err err
        cdef int r
        lock(&self._cache._lock, READ, "check")
        try:
            self._require_active("check")   # again: another thread may have ended it meanwhile
            if self._cache._lock.busy:      # commit would be refused (see _finish)
                raise_busy("check")
            r = kvc_handoff_import_check(&self.imp, &err)
        finally:
            unlock(&self._cache._lock, READ)
        check_status(r, &err, "check")

    def commit(self):
        """Make the sequence visible exactly as state_read would have. StateError (nothing
        changed, still active) when the cache changed since the import began."""
        self._require_active("commit")
        self._finish(True)

    def abort(self):
        """Put back every byte the regions held: the cache is as it was before the import."""
        if self.imp.active:
            self._finish(False)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        self.abort()
        return False

    def __repr__(self):
        state = "active" if self.imp.active else "finished"
        n_regions = 0 if self.regions is None else len(self.regions)
        return (f"SeqImport(seq_id={self.seq_id}, cells={self.imp.cell_count}, regions={n_regions}, "
                f"n_bytes={self.imp.data_bytes}, {state})")


def _seq_import_begin(_Unified cache not None, header, seq_id=None, bint into_empty=False):
    """UnifiedCache.seq_import_begin (see there). into_empty: when seq_id holds no cell, keep no
    copy of the reserved (free) cells' bytes for abort (kvc_handoff_import_begin_empty: the prefix
    store's loads)."""
    cdef int32_t s = -1 if seq_id is None else seq_c(seq_id, cache.c.n_seq_max, "seq_id", False)
    cdef _HeldBuffer hb = state_data_view(header)
    cdef SeqImport x = SeqImport.__new__(SeqImport)
    cdef kvc_err err
    cdef size_t n
    cdef const uint8_t *p = state_data_ptr(hb, &n)
    cdef int r
    try:
        lock(&cache._lock, CHANGE, "seq_import_begin")
        try:
            with nogil:
                if into_empty:
                    r = kvc_handoff_import_begin_empty(&cache.c, s, p, n, &x.imp, &err)
                else:
                    r = kvc_handoff_import_begin(&cache.c, s, p, n, &x.imp, &err)
        finally:
            unlock(&cache._lock, CHANGE)
    finally:
        hb.release()
    # what the reservation evicted goes to the write-back sink now, while the freed cells still
    # hold its K/V: the import writes its own rows into them next
    spill_flush(cache)
    check_status(r, &err, "seq_import_begin")
    return _import_begun(cache, x)


cdef SeqImport _import_begun(_Unified cache, SeqImport x):
    """x, whose import into cache began, with what it shows of its reserved cells."""
    x._cache = cache
    x.seq_id = x.imp.seq_id
    x.regions = _regions_array(&cache.c, x.imp.stream, x.imp.runs, x.imp.n_runs)
    x.cells = _cells_array(x.imp.runs, x.imp.n_runs)
    return x


def _seq_import_begin_parts(caches, headers, seq_id=None):
    """seq_import_begin of every cache of a composite (an iSWA pair) with its part of the header,
    all or none, as one operation over the caches: every part's header is checked first, and no
    cache's prefix index evicts unless every cache has room or can make it
    (kvc_handoff_import_begin_parts). Returns the SeqImports, in the order given."""
    cdef tuple cs = _caches_arg(caches)
    cdef Py_ssize_t n = len(cs), k
    headers = list(headers)
    if len(headers) != n:
        raise ValueError(f"headers: {n} parts expected, got {len(headers)}")
    cdef _Unified c = cs[0]
    cdef int32_t s = -1 if seq_id is None else seq_c(seq_id, c.c.n_seq_max, "seq_id", False)
    cdef kvc_unified *cp[KVC_STATE_MAX_PARTS]
    cdef const uint8_t *hp[KVC_STATE_MAX_PARTS]
    cdef size_t lens[KVC_STATE_MAX_PARTS]
    cdef kvc_handoff_import *ip[KVC_STATE_MAX_PARTS]
    cdef _HeldBuffer hb
    cdef SeqImport x
    cdef kvc_err err
    cdef int r
    held = []
    xs = []
    try:
        for k in range(n):
            hb = state_data_view(headers[k])
            held.append(hb)
            hp[k] = state_data_ptr(hb, &lens[k])
            x = SeqImport.__new__(SeqImport)
            xs.append(x)
            ip[k] = &x.imp
            c = cs[k]
            cp[k] = &c.c
        order = _lock_order(cs)
        lock_all(order, CHANGE, "seq_import_begin")
        try:
            with nogil:
                r = kvc_handoff_import_begin_parts(cp, <uint32_t>n, s, hp, lens, ip, &err)
        finally:
            unlock_all(order, CHANGE)
    finally:
        for hb in held:
            hb.release()
    # (as _seq_import_begin's: what the reservations evicted, to the write-back sinks now)
    for c in cs:
        spill_flush(c)
    check_status(r, &err, "seq_import_begin")
    return [_import_begun(cs[k], xs[k]) for k in range(n)]
