# Declarations of csrc/kvc_update.h: llama.cpp's update() of unified caches (K-shift, then defrag).
from libc.stdint cimport int32_t, uint32_t
from kvcache.includes.kvc_common cimport kvc_err
from kvcache.includes.kvc_unified cimport kvc_unified
from kvcache.includes.kvc_rope cimport kvc_rope_params

cdef extern from "kvc_update.h" nogil:
    ctypedef struct kvc_update_opts:
        const kvc_rope_params *rope
        const uint32_t *head_dim
        int32_t n_max_nodes
        int32_t *k_shift
        bint stream_copies

    ctypedef struct kvc_update_result:
        bint shifted
        bint rotated
        bint defragged
        bint moved
        bint need_reserve
        uint32_t copies

    enum:
        KVC_UPDATE_MAX_PARTS
    int kvc_unified_update_parts(kvc_unified *const *caches, uint32_t n, const kvc_update_opts *opts,
                                 kvc_update_result *res, kvc_err *err)
    int kvc_unified_update(kvc_unified *c, const kvc_update_opts *opts, kvc_update_result *res, kvc_err *err)
