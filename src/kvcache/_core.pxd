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

# --- recurrent ---------------------------------------------------------------

# --- rope --------------------------------------------------------------------
from kvcache.includes.kvc_rope cimport kvc_rope_params

cdef class RopeParams:
    cdef kvc_rope_params c         # the C view; c.freq_factors points into _factors
    cdef object _factors           # float32[n_rot/2] (C-contiguous) or None
    cdef object _layer_base        # dict model layer -> freq_base override, or None
    cdef object _layer_scale       # dict model layer -> freq_scale override, or None
    cdef int fill(self, kvc_rope_params *out, object layer, uint32_t head_dim) except -1
