# Declarations of csrc/kvc_state.h: the state codec of the unified cache.
from libc.stdint cimport int32_t, uint32_t, uint8_t
from kvcache.includes.kvc_common cimport kvc_err
from kvcache.includes.kvc_unified cimport kvc_unified

cdef extern from "kvc_state.h" nogil:
    size_t kvc_unified_state_size(const kvc_unified *c, int32_t seq_id)
    int kvc_unified_state_write(const kvc_unified *c, int32_t seq_id, uint8_t *out, size_t cap, size_t *written)
    int kvc_unified_state_read(kvc_unified *c, int32_t seq_id, const uint8_t *data, size_t len,
                               size_t *consumed, kvc_err *err)

    int KVC_STATE_MAX_PARTS
    ctypedef struct kvc_state_plan:
        const uint8_t *data
        int32_t seq_id
        uint32_t cell_count
        size_t data_off
        size_t len
        int32_t *pos
    int  kvc_unified_state_prepare(kvc_unified *c, int32_t seq_id, const uint8_t *data, size_t len,
                                   kvc_state_plan *plan, kvc_err *err)
    int  kvc_unified_state_apply(kvc_unified *c, const kvc_state_plan *plan)
    void kvc_state_plan_free(kvc_state_plan *plan)
    int  kvc_unified_state_read_parts(kvc_unified *const *caches, uint32_t n_parts, int32_t seq_id,
                                      const uint8_t *data, size_t len, size_t *consumed, kvc_err *err)
