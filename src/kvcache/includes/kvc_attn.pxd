# Declarations of the attention indices: csrc/kvc_attn.h.
from libc.stdint cimport int32_t, uint32_t, uint8_t
from kvcache.includes.kvc_common cimport kvc_err, kvc_ubatch
from kvcache.includes.kvc_unified cimport kvc_unified

cdef extern from "kvc_attn.h" nogil:
    ctypedef struct kvc_attn:
        int32_t *qo_indptr
        int32_t *kv_indptr
        int32_t *kv_indices
        int32_t *kv_pos
        uint8_t *causal
        int32_t *stream
        int32_t *q_pos
        uint32_t cap_groups, cap_nnz, cap_tokens
        uint32_t n_groups, nnz
        uint32_t n_kv
        uint32_t span

    int kvc_unified_attn_indices(const kvc_unified *c, const kvc_ubatch *ub, bint causal, kvc_attn *out,
                                 kvc_err *err)
