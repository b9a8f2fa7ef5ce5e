# cython: language_level=3
# The cimport contract of kvcache: cdef classes and their nogil C-level methods.
# Other extensions write `from kvcache._core cimport UnifiedCore`.

from libc.stdint cimport int32_t, uint32_t, uint64_t
from kvcache.includes.kvc_common cimport kvc_ubatch

# --- common ------------------------------------------------------------------
cdef class UBatch:
    cdef kvc_ubatch c              # the C view of the arrays below (pointers into them)
    cdef object _pos               # int32[n_tokens]
    cdef object _seq_off           # uint32[n_seqs + 1]
    cdef object _seq_ids           # int32[total ids]
    cdef object _seq_mask          # uint64[n_seqs]
    cdef object _seq_lists         # list of lists of ints, as given
    cdef readonly object output    # per-token output flags or None
    cdef readonly int max_seq      # largest sequence id (-1 when none)
    cdef int check(self, uint32_t n_seq_max) except -1

# --- unified -----------------------------------------------------------------
from kvcache.includes.kvc_unified cimport *
from kvcache.includes.kvc_cells cimport kvc_cells_reset_shift

cdef class UnifiedCore:
    cdef kvc_unified c             # the C cache: cells, head/n, recovery, defrag plan, layer table
    cdef bint _ready               # c is initialised (kvc_unified_free is due)
    cdef uint32_t _placed_n        # tokens the last successful find_slot put at head (0: none/stale)
    cdef uint32_t _n_layer_model   # model layer count given to the constructor
    cdef tuple _layers             # kept model layer indices, ascending (the cache's layer order)
    cdef dict _ikv                 # model layer index -> index into c.layers
    cdef tuple _n_embd_k           # K row width per model layer
    cdef tuple _n_embd_v           # V row width per model layer
    cdef list _k_mem               # per kept layer: owned K memory (aligned uint8 ndarray)
    cdef list _v_mem               # per kept layer: owned V memory (aligned uint8 ndarray)
    cdef list _k_view              # per kept layer: K as the cache dtype, (size, n_embd_k) or (size, row_bytes)
    cdef list _v_view              # per kept layer: V likewise, (n_embd_v, size) when v_trans
    cdef str _buffers              # buffer mode ("owned")
    cdef bint _defrag_pending      # the last defrag_prepare moved cells whose K/V rows are not moved yet

    # C-level operations for other extensions. They do not validate: sequence ids must lie in
    # [0, n_seq_max) (-1 allowed for seq_rm), ubatches must have passed UBatch.check.
    cdef inline int find_slot_c(self, const kvc_ubatch *ub) noexcept nogil:
        cdef int r = kvc_unified_find_slot(&self.c, ub)
        self._placed_n = ub.n_tokens if r == 1 else 0
        return r
    cdef inline void commit_c(self) noexcept nogil:
        kvc_unified_commit(&self.c)
    cdef inline void restore_c(self) noexcept nogil:
        self._placed_n = 0
        kvc_unified_restore(&self.c)
    cdef inline bint seq_rm_c(self, int32_t s, int32_t p0, int32_t p1) noexcept nogil:
        self._placed_n = 0
        return kvc_unified_seq_rm(&self.c, s, p0, p1)
    cdef inline void seq_cp_c(self, int32_t src, int32_t dst, int32_t p0, int32_t p1) noexcept nogil:
        self._placed_n = 0
        kvc_unified_seq_cp(&self.c, src, dst, p0, p1)
    cdef inline void seq_keep_c(self, int32_t s) noexcept nogil:
        self._placed_n = 0
        kvc_unified_seq_keep(&self.c, s)
    cdef inline void seq_add_c(self, int32_t s, int32_t p0, int32_t p1, int32_t shift) noexcept nogil:
        self._placed_n = 0
        kvc_unified_seq_add(&self.c, s, p0, p1, shift)
    cdef inline void seq_div_c(self, int32_t s, int32_t p0, int32_t p1, int32_t d) noexcept nogil:
        self._placed_n = 0
        kvc_unified_seq_div(&self.c, s, p0, p1, d)
    cdef inline int32_t seq_pos_min_c(self, int32_t s) noexcept nogil:
        return kvc_unified_seq_pos_min(&self.c, s)
    cdef inline int32_t seq_pos_max_c(self, int32_t s) noexcept nogil:
        return kvc_unified_seq_pos_max(&self.c, s)
    cdef inline void clear_c(self) noexcept nogil:
        self._placed_n = 0
        self._defrag_pending = False
        kvc_unified_clear(&self.c)
    cdef inline void set_full_c(self) noexcept nogil:
        self._placed_n = 0
        kvc_unified_set_full(&self.c)
    cdef inline void store_c(self, uint32_t ikv, const void *k, const void *v) noexcept nogil:
        # rows of the _placed_n tokens at head; a no-op when nothing is placed
        if self._placed_n:
            kvc_unified_store(&self.c, ikv, self._placed_n, k, v)
    cdef inline int kq_mask_c(self, const kvc_ubatch *ub, bint causal, bint alibi, int dtype, void *out) noexcept nogil:
        # dtype: KVC_MASK_F32 / F16 / BOOL; KVC_OK or KVC_E_NOMEM
        return kvc_unified_kq_mask(&self.c, ub, causal, alibi, dtype, out)
    cdef inline void k_shift_c(self, int32_t *out) noexcept nogil:
        kvc_unified_k_shift(&self.c, out)
    cdef inline void reset_shift_c(self) noexcept nogil:
        kvc_cells_reset_shift(&self.c.cells)
    cdef inline uint32_t head_c(self) noexcept nogil:
        return self.c.head
    cdef inline uint32_t n_c(self) noexcept nogil:
        return self.c.n
    cdef inline uint32_t used_c(self) noexcept nogil:
        return self.c.cells.used

# --- batch -------------------------------------------------------------------

# --- recurrent ---------------------------------------------------------------

# --- rope --------------------------------------------------------------------
