# Declarations of csrc/kvc_hybrid_state.h: the state codec of the hybrid memory.
from libc.stdint cimport int32_t, uint8_t, uint32_t, uint64_t
from kvcache.includes.kvc_common cimport kvc_err
from kvcache.includes.kvc_hybrid cimport kvc_hybrid

cdef extern from "kvc_hybrid_state.h" nogil:
    enum:
        KVC_HYBRID_BOTH
        KVC_HYBRID_PARTIAL_ONLY

    int    kvc_hybrid_state_init(kvc_hybrid *h, uint32_t n_layer, const uint32_t *recurrent_il, kvc_err *err)
    size_t kvc_hybrid_state_size(const kvc_hybrid *h, int32_t seq_id, unsigned layout, unsigned parts)
    int    kvc_hybrid_state_write_range(kvc_hybrid *h, int32_t seq_id, unsigned layout, unsigned parts,
                                        uint64_t offset, uint8_t *out, size_t cap, size_t *written)
    int    kvc_hybrid_state_read(kvc_hybrid *h, int32_t seq_id, const uint8_t *data, size_t len, unsigned flags,
                                 unsigned layout, unsigned parts, size_t *consumed, kvc_err *err)
