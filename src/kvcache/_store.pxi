# The checksum of the prefix store's chunk files (csrc/kvc_store.h, kvcache.store).

from kvcache.includes.kvc_common cimport kvc_copy, kvc_stream_fence, KVC_STREAM_BYTES
from kvcache.includes.kvc_handoff cimport kvc_handoff_checksum
from kvcache.includes.kvc_store cimport (kvc_store_sum, kvc_store_sum_init, kvc_store_sum_update, kvc_store_sum_copy,
                                         kvc_store_sum_digest, kvc_store_read)
from cpython.exc cimport PyErr_SetFromErrno
from libc cimport errno as c_errno


@cython.final
cdef class ChunkSum:
    """The running checksum of a prefix store's chunk file (``kvcache.store``): a position-dependent
    sum of the bytes as 64-bit words that runs at memory speed, finished by a 64-bit mix.

    ``update(data)`` adds a buffer's bytes (updates may split the bytes anywhere);
    ``copy_to(address, data)`` also copies them to memory the caller owns; ``read_from(fd,
    regions, step)`` reads them from a file into memory the caller owns; ``digest()`` gives the
    checksum as an int (more updates may follow); ``n_bytes`` counts."""
    cdef kvc_store_sum s

    def __cinit__(self):
        kvc_store_sum_init(&self.s)

    def update(self, data):
        """Add the bytes of data (any C-contiguous buffer)."""
        cdef _HeldBuffer hb = state_data_view(data)
        cdef size_t n
        cdef const uint8_t *p = state_data_ptr(hb, &n)
        try:
            with nogil:
                kvc_store_sum_update(&self.s, p, n)
        finally:
            hb.release()

    def copy_to(self, uint64_t address, data, bint stream=False):
        """Copy the bytes of data to address (writable memory of at least that many bytes, not
        overlapping data: a region of a cache's import) and add them, in one pass; stream:
        write with non-temporal stores (for copies larger than the caches)."""
        cdef _HeldBuffer hb = state_data_view(data)
        cdef size_t n
        cdef const uint8_t *p = state_data_ptr(hb, &n)
        try:
            if n and address == 0:
                raise ValueError("address must not be 0")
            with nogil:
                kvc_store_sum_copy(&self.s, <uint8_t *><uintptr_t>address, p, n, stream)
                if stream:
                    kvc_stream_fence()
        finally:
            hb.release()

    def read_from(self, int fd, regions, size_t step, bounce=None, bint stream=False):
        """Read from file descriptor fd, from its offset on, the bytes of each region in turn (an
        (N, 2) uint64 array of address and length: writable memory the caller owns, not
        overlapping bounce) and add them, in steps of step bytes, in one loop without the GIL:
        through bounce (a writable buffer of at least step bytes: each step read into it, then
        copied and added in one pass while it is in the caches; stream: non-temporal stores) or,
        without, straight into the regions. True when every byte was read, False when the file
        ended first; OSError on a read error."""
        cdef const uint64_t[:, ::1] r = np.ascontiguousarray(regions, dtype=np.uint64)
        cdef _HeldBuffer bb = hold_buffer(bounce, "bounce", True) if bounce is not None else None
        cdef uint8_t *bp = <uint8_t *>bb.view.buf if bb is not None else NULL
        cdef Py_ssize_t k
        cdef int rc = 0, err = 0
        try:
            if r.shape[1] != 2:
                raise ValueError(f"regions must be an (N, 2) array, not {tuple(r.shape)}")
            if step == 0 or (bb is not None and <size_t>bb.view.len < step):
                raise ValueError(f"step = {step} must be > 0 and at most the bounce buffer's bytes")
            for k in range(r.shape[0]):
                if r[k, 1] and r[k, 0] == 0:
                    raise ValueError(f"region {k}: address 0")
            with nogil:
                for k in range(r.shape[0]):
                    rc = kvc_store_read(&self.s, fd, <uint8_t *><uintptr_t>r[k, 0], <size_t>r[k, 1], bp, step, stream)
                    if rc != 0:
                        err = c_errno.errno
                        break
                if stream:
                    kvc_stream_fence()
        finally:
            if bb is not None:
                bb.release()
        if rc < 0:
            c_errno.errno = err
            PyErr_SetFromErrno(OSError)
        return rc == 0

    def digest(self):
        """The checksum of the bytes added so far, an int below 2**64."""
        return kvc_store_sum_digest(&self.s)

    @property
    def n_bytes(self):
        """Bytes added so far."""
        return self.s.n


def _handoff_checksum(data):
    """The checksum that ends a hand-off header (FNV-1a 64 of data's bytes): what
    ``kvcache.store`` puts after a header it assembles for ``seq_import_begin``."""
    cdef _HeldBuffer hb = state_data_view(data)
    cdef size_t n
    cdef const uint8_t *p = state_data_ptr(hb, &n)
    cdef uint64_t h
    try:
        with nogil:
            h = kvc_handoff_checksum(p, n)
    finally:
        hb.release()
    return h


# Bytes from which a copy into a cache is written with non-temporal stores (the C core's rule).
_STREAM_BYTES = KVC_STREAM_BYTES


def _copy_pairs(src, dst, stream=None):
    """Copy region k of src to region k of dst for every k (two (N, 2) uint64 arrays of (address,
    length) of equal lengths, as kvcache.handoff.pair_regions gives them; live, not overlapping
    memory), without the GIL. stream: non-temporal stores; None: from _STREAM_BYTES in all.
    Returns the bytes copied."""
    cdef const uint64_t[:, ::1] a = np.ascontiguousarray(src, dtype=np.uint64)
    cdef const uint64_t[:, ::1] b = np.ascontiguousarray(dst, dtype=np.uint64)
    if a.shape[0] != b.shape[0] or a.shape[1] != 2 or b.shape[1] != 2:
        raise ValueError(f"src and dst must be (N, 2) arrays of the same N, not {tuple(a.shape)} and {tuple(b.shape)}")
    cdef Py_ssize_t k
    cdef uint64_t total = 0
    for k in range(a.shape[0]):
        if a[k, 1] != b[k, 1]:
            raise ValueError(f"region {k}: {a[k, 1]} bytes in src, {b[k, 1]} in dst")
        if a[k, 1] and (a[k, 0] == 0 or b[k, 0] == 0):
            raise ValueError(f"region {k}: address 0")
        total += a[k, 1]
    cdef bint nt = total >= KVC_STREAM_BYTES if stream is None else bool(stream)
    with nogil:
        for k in range(a.shape[0]):
            kvc_copy(<void *><uintptr_t>b[k, 0], <const void *><uintptr_t>a[k, 0], <size_t>a[k, 1], nt)
        if nt:
            kvc_stream_fence()
    return total


def _salt_hash(salt):
    """The 64-bit hash a prefix index keeps for a salt (None: 0): how the prefix store names the
    salts of the prompts a cache evicts."""
    return salt_c(salt)
