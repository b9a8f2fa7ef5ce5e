# Declarations of csrc/kvc_hybrid.h: the rules of the hybrid memory's pair.
from libc.stdint cimport int32_t, int64_t
from kvcache.includes.kvc_common cimport kvc_err, kvc_ubatch
from kvcache.includes.kvc_unified cimport kvc_unified
from kvcache.includes.kvc_recurrent cimport kvc_recurrent
from kvcache.includes.kvc_iswa cimport kvc_iswa

cdef extern from "kvc_hybrid.h" nogil:
    ctypedef struct kvc_hybrid:
        kvc_unified *attn
        kvc_iswa *iswa
        kvc_recurrent *recr

    int     kvc_hybrid_init(kvc_hybrid *h, kvc_unified *attn, kvc_recurrent *recr, kvc_err *err)
    int     kvc_hybrid_init_iswa(kvc_hybrid *h, kvc_iswa *iswa, kvc_recurrent *recr, kvc_err *err)
    kvc_unified *kvc_hybrid_attn_layer(const kvc_hybrid *h, int64_t il, int64_t *index)
    int64_t kvc_hybrid_recr_layer(const kvc_hybrid *h, int64_t il)
    int     kvc_hybrid_find_slot(kvc_hybrid *h, const kvc_ubatch *ub, kvc_err *err)
    void    kvc_hybrid_clear(kvc_hybrid *h)
    bint    kvc_hybrid_seq_rm(kvc_hybrid *h, int32_t s, int32_t p0, int32_t p1)
    int     kvc_hybrid_seq_cp(kvc_hybrid *h, int32_t src, int32_t dst, int32_t p0, int32_t p1, kvc_err *err)
    void    kvc_hybrid_seq_keep(kvc_hybrid *h, int32_t s)
    void    kvc_hybrid_seq_add(kvc_hybrid *h, int32_t s, int32_t p0, int32_t p1, int32_t shift)
    void    kvc_hybrid_seq_div(kvc_hybrid *h, int32_t s, int32_t p0, int32_t p1, int32_t d)
    int32_t kvc_hybrid_seq_pos_min(const kvc_hybrid *h, int32_t s)
    int32_t kvc_hybrid_seq_pos_max(const kvc_hybrid *h, int32_t s)
