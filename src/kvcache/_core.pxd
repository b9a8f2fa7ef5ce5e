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
