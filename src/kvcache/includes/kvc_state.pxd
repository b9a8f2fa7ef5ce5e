# Declarations of csrc/kvc_state.h: the state codec of the unified cache.
from libc.stdint cimport int32_t, uint8_t
from kvcache.includes.kvc_common cimport kvc_err
from kvcache.includes.kvc_unified cimport kvc_unified

cdef extern from "kvc_state.h" nogil:
    size_t kvc_unified_state_size(const kvc_unified *c, int32_t seq_id)
    int kvc_unified_state_write(const kvc_unified *c, int32_t seq_id, uint8_t *out, size_t cap, size_t *written)
    int kvc_unified_state_read(kvc_unified *c, int32_t seq_id, const uint8_t *data, size_t len,
                               size_t *consumed, kvc_err *err)
