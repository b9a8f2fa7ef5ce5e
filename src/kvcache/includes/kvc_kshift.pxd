# Declarations of csrc/kvc_kshift.h: applying a unified cache's K-shift to its K memory.
from libc.stdint cimport uint32_t, int32_t
from kvcache.includes.kvc_common cimport kvc_err
from kvcache.includes.kvc_unified cimport kvc_unified
from kvcache.includes.kvc_rope cimport kvc_rope_params

cdef extern from "kvc_kshift.h" nogil:
    int kvc_unified_apply_k_shift(kvc_unified *c, const kvc_rope_params *p, const uint32_t *head_dim,
                                  kvc_err *err)
    ctypedef struct kvc_kshift_work:
        int32_t *shift
        float *scratch
    int  kvc_unified_k_shift_prepare(const kvc_unified *c, const kvc_rope_params *p, const uint32_t *head_dim,
                                     kvc_kshift_work *w, kvc_err *err)
    int  kvc_unified_k_shift_run(kvc_unified *c, const kvc_rope_params *p, const uint32_t *head_dim,
                                 kvc_kshift_work *w, kvc_err *err)
    void kvc_kshift_work_free(kvc_kshift_work *w)
