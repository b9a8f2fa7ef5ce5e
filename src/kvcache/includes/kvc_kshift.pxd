# Declarations of csrc/kvc_kshift.h: applying a unified cache's K-shift to its K memory.
from libc.stdint cimport uint32_t
from kvcache.includes.kvc_common cimport kvc_err
from kvcache.includes.kvc_unified cimport kvc_unified
from kvcache.includes.kvc_rope cimport kvc_rope_params

cdef extern from "kvc_kshift.h" nogil:
    int kvc_unified_apply_k_shift(kvc_unified *c, const kvc_rope_params *p, const uint32_t *head_dim,
                                  kvc_err *err)
