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

cdef class UnifiedCore:
    cdef kvc_unified c             # the C cache: cells, head/n, recovery, defrag plan, layer table
    cdef bint _ready               # c is initialised (kvc_unified_free is due)
    cdef uint32_t _placed_n        # tokens the last successful find_slot put at head (0: none/stale)
    cdef uint32_t _n_layer_model   # model layer count given to the constructor
    cdef tuple _layers             # kept model layer indices, ascending (the cache's layer order)
    cdef dict _ikv                 # model layer index -> index into c.layers
    cdef tuple _n_embd_k           # K row width per model layer
    cdef tuple _n_embd_v           # V row width per model layer
    cdef list _k_mem               # per kept layer: K memory as uint8 (owned and aligned, or borrowed); empty without memory
    cdef list _v_mem               # per kept layer: V memory likewise
    cdef list _k_view              # per kept layer: K as the cache dtype, (size, n_embd_k) or (size, row_bytes)
    cdef list _v_view              # per kept layer: V likewise, (n_embd_v, size) when v_trans
    cdef str _buffers              # buffer mode: "owned", "borrowed" or "none" (metadata only)
    cdef object _borrowed          # borrowed mode: the caller's (K, V) objects per kept layer (kept alive)
    cdef tuple _n_embd_head_k      # K head size per model layer, or None (needed by the RoPE K-shift)
    cdef object _rope              # the model's RopeParams, or None (update() rotates K with them)
    cdef bint _defrag_pending      # the last defrag_prepare moved cells whose K/V rows are not moved yet

    # C-level operations for other extensions (`from kvcache._core cimport UnifiedCore`). They do
    # not validate: sequence ids must lie in [0, n_seq_max) (-1 allowed for seq_rm), ubatches must
    # have passed UBatch.check. They run in _core (where the C core is linked), via the vtable.
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
    cdef void store_c(self, uint32_t ikv, const void *k, const void *v) noexcept nogil       # rows of the placed ubatch
    cdef int kq_mask_c(self, const kvc_ubatch *ub, bint causal, bint alibi, int dtype, void *out) noexcept nogil
    cdef void k_shift_c(self, int32_t *out) noexcept nogil
    cdef void reset_shift_c(self) noexcept nogil
    # field reads and header-inline queries: inlined into the caller
    cdef inline int32_t seq_pos_min_c(self, int32_t s) noexcept nogil:
        return kvc_unified_seq_pos_min(&self.c, s)
    cdef inline int32_t seq_pos_max_c(self, int32_t s) noexcept nogil:
        return kvc_unified_seq_pos_max(&self.c, s)
    cdef inline uint32_t head_c(self) noexcept nogil:
        return self.c.head
    cdef inline uint32_t n_c(self) noexcept nogil:
        return self.c.n
    cdef inline uint32_t used_c(self) noexcept nogil:
        return self.c.cells.used

# --- batch -------------------------------------------------------------------
from kvcache.includes.kvc_batch cimport kvc_sbatch, kvc_split_mode

cdef class SplitUBatch(UBatch):
    cdef readonly object ids        # int64[n_tokens]: batch index of each token, in ubatch order
    cdef readonly bint equal_seqs   # False for a simple split

cdef class Batch:
    cdef kvc_sbatch c               # the splitter (owns copies of the batch and the last ubatch)
    cdef object _split(self, kvc_split_mode mode, object n_ubatch)

# --- recurrent ---------------------------------------------------------------
from kvcache.includes.kvc_recurrent cimport kvc_recurrent

cdef class RecurrentCache:
    cdef kvc_recurrent c           # the C cache: cells, head/n/used, layer table
    cdef bint _ready               # c is initialised (and must be freed)
    cdef list _k                   # per layer: the owned K buffer (uint8, size rows)
    cdef list _v                   # per layer: the owned V buffer (uint8, size rows)
    cdef list _warnings            # messages of the last find_slot
    cdef str _buffers              # buffer mode: "owned", "borrowed" or "none" (metadata only)
    cdef object _borrowed          # borrowed mode: the caller's (K, V) objects per layer (kept alive)
    cdef readonly str type_k       # K type name ("f32", "f16", ...)
    cdef readonly str type_v       # V type name
    cdef int _seq(self, object seq_id, str name, bint allow_any) except -2
    # C-level calls for other extensions (arguments already checked, no exceptions)
    cdef int find_slot_c(self, const kvc_ubatch *ub) noexcept nogil
    cdef bint seq_rm_c(self, int32_t seq_id, int32_t p0, int32_t p1) noexcept nogil
    cdef int s_copy_c(self, int32_t *out) noexcept nogil
    cdef int s_mask_c(self, float *out) noexcept nogil

# --- rope --------------------------------------------------------------------
from kvcache.includes.kvc_rope cimport kvc_rope_params

cdef class RopeParams:
    cdef kvc_rope_params c         # the C view; c.freq_factors points into _factors
    cdef object _factors           # float32[n_rot/2] (C-contiguous) or None
    cdef object _layer_base        # dict model layer -> freq_base override, or None
    cdef object _layer_scale       # dict model layer -> freq_scale override, or None
    cdef int fill(self, kvc_rope_params *out, object layer, uint32_t head_dim) except -1

# --- iswa --------------------------------------------------------------------
from kvcache.includes.kvc_iswa cimport kvc_iswa_pending

cdef class SWAPending:
    cdef kvc_iswa_pending c        # per sequence: the smallest and largest position of the last batch
