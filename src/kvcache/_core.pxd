# cython: language_level=3
# The cimport contract of kvcache: C-level methods of the caches, nothing of their state.
# Other extensions write `from kvcache._core cimport UnifiedCore, UBatch`.
#
# The caches are opaque here: UnifiedCore and RecurrentCore declare methods only (their state,
# the lock among it, is private to kvcache._core, where the methods run, reached through the
# vtable). The methods neither validate nor raise: sequence ids must lie in [0, n_seq_max)
# (-1 allowed for seq_rm_c), ubatches must have passed UBatch.check. They do not lock either:
# the caller serializes, with lock_c() ... unlock_c() around them (from any thread; lock_c() is
# called without the GIL, since it may wait; reentrant for the holder), unless the cache is used
# by one thread only.

from libc.stdint cimport int32_t, uint32_t
from kvcache.includes.kvc_common cimport kvc_ubatch

# --- common ------------------------------------------------------------------
cdef class UBatch:
    cdef kvc_ubatch c              # the tokens as C sees them (memory the ubatch owns; read-only)
    cdef readonly object output    # per-token output flags or None
    cdef readonly int max_seq      # largest sequence id (-1 when none)
    cdef object _ext               # int32 [3, n_tokens]: pos_x, pos_y, token (what c points into), or None
    # ValueError unless the ids fit (and 2-D positions have a cache with the per-cell extension)
    cdef int check(self, uint32_t n_seq_max, bint cell_ext=*) except -1

# --- unified -----------------------------------------------------------------
cdef class UnifiedCore:
    # the lock: lock_c() returns 0 once held, -1 (not held) when this thread is in the middle of
    # an operation on the cache that runs Python code (a callback of it called the extension);
    # unlock_c() returns 0, or -1 (nothing released) when this thread does not hold the lock
    cdef int lock_c(self) noexcept nogil
    cdef int unlock_c(self) noexcept nogil
    cdef int find_slot_c(self, const kvc_ubatch *ub) noexcept nogil        # 1 placed, 0 no room, <0 error
    cdef void commit_c(self) noexcept nogil
    cdef void restore_c(self) noexcept nogil
    cdef bint seq_rm_c(self, int32_t s, int32_t p0, int32_t p1) noexcept nogil
    cdef void seq_cp_c(self, int32_t src, int32_t dst, int32_t p0, int32_t p1) noexcept nogil
    cdef void seq_keep_c(self, int32_t s) noexcept nogil
    cdef void seq_add_c(self, int32_t s, int32_t p0, int32_t p1, int32_t shift) noexcept nogil
    cdef void seq_div_c(self, int32_t s, int32_t p0, int32_t p1, int32_t d) noexcept nogil   # d > 0
    cdef void clear_c(self) noexcept nogil
    cdef void set_full_c(self) noexcept nogil
    # raw rows of the tokens the last find_slot placed, for the ikv-th kept layer (ikv < n_layer_c());
    # 0, or < 0 (nothing written) when no ubatch is placed
    cdef int store_c(self, uint32_t ikv, const void *k, const void *v) noexcept nogil
    cdef int kq_mask_c(self, const kvc_ubatch *ub, bint causal, bint alibi, int dtype, bint pad, size_t row_stride,
                       void *out) noexcept nogil
    cdef void k_shift_c(self, int32_t *out) noexcept nogil                 # out: size_c() entries
    cdef void reset_shift_c(self) noexcept nogil
    cdef int32_t seq_pos_min_c(self, int32_t s) noexcept nogil
    cdef int32_t seq_pos_max_c(self, int32_t s) noexcept nogil
    cdef uint32_t head_c(self) noexcept nogil
    cdef uint32_t n_c(self) noexcept nogil
    cdef uint32_t used_c(self) noexcept nogil
    cdef uint32_t size_c(self) noexcept nogil
    cdef uint32_t n_seq_max_c(self) noexcept nogil
    cdef uint32_t n_layer_c(self) noexcept nogil                           # kept layers

# --- recurrent ---------------------------------------------------------------
cdef class RecurrentCore:
    cdef int lock_c(self) noexcept nogil                                   # as UnifiedCore's
    cdef int unlock_c(self) noexcept nogil
    cdef int find_slot_c(self, const kvc_ubatch *ub) noexcept nogil
    cdef bint seq_rm_c(self, int32_t seq_id, int32_t p0, int32_t p1) noexcept nogil
    cdef int s_copy_c(self, int32_t *out) noexcept nogil                   # out: n_c() entries
    cdef int s_mask_c(self, float *out) noexcept nogil
    cdef uint32_t head_c(self) noexcept nogil
    cdef uint32_t n_c(self) noexcept nogil
    cdef uint32_t used_c(self) noexcept nogil
    cdef uint32_t size_c(self) noexcept nogil
    cdef uint32_t n_seq_max_c(self) noexcept nogil
