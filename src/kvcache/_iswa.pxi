# _iswa: what the interleaved sliding-window cache (kvcache.iswa.ISWACache, a composition of two
# UnifiedCore objects) needs from C: its pending pruning ranges, and states made of one part per
# cache, read all or nothing.

from kvcache.includes.kvc_iswa cimport kvc_iswa_pending, kvc_iswa_pending_clear, kvc_iswa_pending_set
from cpython.bytes cimport PyBytes_FromStringAndSize, PyBytes_AS_STRING
from kvcache.includes.kvc_state cimport (kvc_unified_state_size, kvc_unified_state_write,
                                         kvc_unified_state_read_parts_ex)

cdef enum:
    _MAX_PARTS = 8   # KVC_STATE_MAX_PARTS (checked again in C)


cdef class SWAPending:
    """The pending SWA-pruning ranges of an iSWA cache: per sequence, the smallest and largest
    position of the batch last given to :meth:`set` (committing prunes the SWA cache with them)."""

    def __cinit__(self):
        kvc_iswa_pending_clear(&self.c)

    def set(self, batch, n_seq_max, record=True):
        """Replace the ranges by those of ``batch`` (a :class:`Batch` or a :class:`UBatch`).

        Every sequence id must lie in ``[0, n_seq_max)`` (ValueError, ranges unchanged). With
        ``record=False`` the ids are checked and the ranges cleared."""
        cdef kvc_err err
        cdef uint32_t n, nmax = <uint32_t>_int_arg(n_seq_max, "n_seq_max", 1, KVC_MAX_SEQ)
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
                raise ValueError("batch: a UBatch with one token per group (n_seq_tokens = 1) is expected")
            n = (<UBatch>batch).c.n_tokens
            pos = (<UBatch>batch).c.pos
            off = (<UBatch>batch).c.seq_off
            ids = (<UBatch>batch).c.seq_ids
        else:
            raise TypeError(f"batch must be a Batch or a UBatch, not {type(batch).__name__}")
        with nogil:
            rc = kvc_iswa_pending_set(&self.c, n, pos, off, ids, nmax, rec, &err)
        check_status(rc, &err, "sbatch_init")

    def clear(self):
        """Forget every range."""
        kvc_iswa_pending_clear(&self.c)

    def items(self):
        """``[[seq_id, pmin, pmax], ...]`` in ascending sequence order."""
        cdef uint64_t m = self.c.seqs
        cdef int s
        out = []
        for s in range(KVC_MAX_SEQ):
            if (m >> s) & 1:
                out.append([s, self.c.pmin[s], self.c.pmax[s]])
        return out

    def __len__(self):
        cdef uint64_t m = self.c.seqs
        cdef Py_ssize_t n = 0
        while m:
            m &= m - 1
            n += 1
        return n

    def __repr__(self):
        return f"SWAPending({self.items()})"


cdef tuple _caches_arg(object caches):
    """The caches of a multi-part state: a non-empty sequence of distinct UnifiedCore objects."""
    caches = tuple(caches)
    if not 1 <= len(caches) <= _MAX_PARTS:
        raise ValueError(f"caches: 1 to {_MAX_PARTS} caches expected, got {len(caches)}")
    for i, c in enumerate(caches):
        if not isinstance(c, UnifiedCore):
            raise TypeError(f"caches[{i}] must be a UnifiedCache, not {type(c).__name__}")
        for j in range(i):
            if caches[j] is c:
                raise ValueError(f"caches[{j}] and caches[{i}] are the same cache")
    return caches


def _state_size_parts(caches, seq_id=-1):
    """Bytes of the state of seq_id (-1: all) over several caches: the sum of their parts."""
    cdef UnifiedCore c
    cdef size_t total = 0
    for c in _caches_arg(caches):
        total += kvc_unified_state_size(&c.c, _seq_arg(seq_id, c.c.n_seq_max, "seq_id", True))
    return total


def _state_write_parts(caches, seq_id=-1):
    """The state of seq_id (-1: all) of several caches as one blob: their parts in order."""
    cdef tuple cs = _caches_arg(caches)
    cdef UnifiedCore c
    cdef int32_t s
    cdef size_t sizes[_MAX_PARTS]
    cdef size_t total = 0, off = 0, written
    cdef Py_ssize_t k, n = len(cs)
    cdef int r
    for k in range(n):
        c = cs[k]
        s = _seq_arg(seq_id, c.c.n_seq_max, "seq_id", True)
        sizes[k] = kvc_unified_state_size(&c.c, s)
        total += sizes[k]
    out = PyBytes_FromStringAndSize(NULL, <Py_ssize_t>total)
    cdef uint8_t *p = <uint8_t *>PyBytes_AS_STRING(out)
    for k in range(n):
        c = cs[k]
        written = 0
        with nogil:
            r = kvc_unified_state_write(&c.c, s, p + off, sizes[k], &written)
        if r < 0:
            raise_status(r, NULL, "state_write")
        if written != sizes[k]:
            raise RuntimeError(f"state_write wrote {written} bytes, expected {sizes[k]} (internal error)")
        off += written
    return out


def _state_read_parts(caches, data, seq_id=-1, *, convert=False, exact=False):
    """Read a blob of consecutive parts, part k into caches[k], for seq_id (-1: whole caches).

    All or nothing: on failure (StateError naming the part) every cache is exactly as it was.
    Returns the bytes consumed (bytes after the last part are not read, unless exact: then they
    are an error). convert: accept and convert parts whose V layout differs from their cache's."""
    cdef tuple cs = _caches_arg(caches)
    cdef kvc_unified *ptrs[_MAX_PARTS]
    cdef UnifiedCore c
    cdef Py_ssize_t k, n = len(cs)
    cdef int32_t s = 0
    cdef unsigned flags = state_read_flags(convert, exact)
    for k in range(n):
        c = cs[k]
        s = _seq_arg(seq_id, c.c.n_seq_max, "seq_id", True)
        ptrs[k] = &c.c
    cdef size_t nbytes = 0, consumed = 0
    keep = state_data_view(data)
    cdef const uint8_t *ptr = state_data_ptr(keep, &nbytes)
    cdef kvc_err err
    cdef int r
    err.msg[0] = 0
    with nogil:
        r = kvc_unified_state_read_parts_ex(ptrs, <uint32_t>n, s, ptr, nbytes, flags, &consumed, &err)
    if r < 0:
        raise_status(r, &err, "state_read")
    for k in range(n):
        c = cs[k]
        c._placed_n = 0
        c._defrag_pending = False
    return consumed
