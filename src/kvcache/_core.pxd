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

# --- rope --------------------------------------------------------------------
