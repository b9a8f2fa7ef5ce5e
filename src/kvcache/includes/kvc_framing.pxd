# Declarations of csrc/kvc_framing.h: a blob's framings as a memory state, found without a cache.
from libc.stdint cimport int32_t, uint8_t, uint32_t
from kvcache.includes.kvc_common cimport kvc_err

cdef extern from "kvc_framing.h" nogil:
    enum:
        KVC_FRAMING_SECS
        KVC_FRAMING_MAX
    ctypedef struct kvc_framing:
        bint     streams
        uint32_t ext_bytes
        bint     prefixed
        int32_t  src_seq_id
        uint32_t n_parts
        uint32_t n_sec[2]
        size_t   sec_off[2][256]
        uint32_t sec_cells[2][256]
        uint32_t recurrent_records
        size_t   rec_off
        uint32_t rec_cells
    ctypedef struct kvc_framing_miss:
        int     rc
        size_t  end
        kvc_err err
    void kvc_state_framings(const uint8_t *data, size_t len, bint allow_prefix, kvc_framing *out, uint32_t *n_out,
                            kvc_framing_miss miss[4])
