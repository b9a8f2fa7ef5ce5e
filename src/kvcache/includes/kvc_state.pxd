# Declarations of csrc/kvc_state.h: the state codec of the unified cache, the blob writer shared by
# the cache variants, and the description of a blob without a cache.
from libc.stdint cimport int32_t, uint8_t, uint32_t, uint64_t
from kvcache.includes.kvc_common cimport kvc_err
from kvcache.includes.kvc_unified cimport kvc_unified
from kvcache.includes.kvc_cells cimport kvc_cell_ext

cdef extern from "kvc_state.h" nogil:
    enum:
        KVC_STATE_CONVERT_V
        KVC_STATE_EXACT
    enum:
        KVC_LAYOUT_STREAMS
        KVC_LAYOUT_PREFIX
        KVC_LAYOUT_SWA_TRIM
        KVC_LAYOUT_DETECT
        KVC_LAYOUT_FRESH_OUT
        KVC_LAYOUT_EXT_XY
        KVC_LAYOUT_EXT_TOK
        KVC_LAYOUT_CELL_EXT
        KVC_SEQ_MAGIC
        KVC_SEQ_PREFIX_BYTES

    size_t kvc_unified_state_size_lay(const kvc_unified *c, int32_t seq_id, unsigned layout)
    int kvc_unified_state_write_range_lay(kvc_unified *c, int32_t seq_id, unsigned layout, uint64_t offset,
                                          uint8_t *out, size_t cap, size_t *written)
    int kvc_unified_state_read_parts_lay(kvc_unified *const *caches, uint32_t n_parts, int32_t seq_id,
                                         const uint8_t *data, size_t len, unsigned flags, unsigned layout,
                                         size_t *consumed, unsigned *used, kvc_err *err)
    ctypedef struct kvc_state_frame:
        bint     prefixed
        int32_t  src_seq_id
        uint32_t n_stream
        size_t   end
    int kvc_state_describe_frame(const uint8_t *data, size_t len, unsigned layout, bint allow_prefix,
                                 kvc_state_frame *f, size_t *sec_off, uint32_t *sec_cells, uint32_t sec_cap,
                                 kvc_err *err)

    size_t kvc_unified_state_size(const kvc_unified *c, int32_t seq_id)
    int kvc_unified_state_write(kvc_unified *c, int32_t seq_id, uint8_t *out, size_t cap, size_t *written)
    int kvc_unified_state_read(kvc_unified *c, int32_t seq_id, const uint8_t *data, size_t len,
                               size_t *consumed, kvc_err *err)
    int kvc_unified_state_read_ex(kvc_unified *c, int32_t seq_id, const uint8_t *data, size_t len,
                                  unsigned flags, size_t *consumed, kvc_err *err)
    int kvc_unified_state_write_range(kvc_unified *c, int32_t seq_id, uint64_t offset, uint8_t *out,
                                      size_t cap, size_t *written)

    ctypedef struct kvc_state_layer_desc:
        int32_t  k_type
        uint64_t k_row_size
        uint64_t k_offset
        int32_t  v_type
        uint64_t v_row_size
        uint32_t v_elem_size
        uint32_t v_width
        uint64_t v_offset
        uint64_t k_bytes
        uint64_t v_bytes

    ctypedef struct kvc_state_desc:
        uint32_t cell_count
        uint32_t v_trans
        uint32_t n_layer
        size_t   data_off
        size_t   end
        uint32_t n_seq_id_min
        uint32_t n_seq_id_max

    uint32_t kvc_layout_ext_bytes(unsigned layout)
    int kvc_state_describe_ext(const uint8_t *data, size_t len, uint32_t ext_bytes, kvc_state_desc *d, int32_t *pos,
                               uint64_t *seq, kvc_cell_ext *ext, uint32_t pos_cap, kvc_state_layer_desc *layers,
                               uint32_t layers_cap, kvc_err *err)
    int kvc_state_describe_records(const uint8_t *data, size_t len, uint32_t ext_bytes, uint32_t n_records,
                                   kvc_state_desc *d, int32_t *pos, uint64_t *seq, kvc_cell_ext *ext,
                                   uint32_t pos_cap, kvc_state_layer_desc *layers, uint32_t layers_cap,
                                   kvc_err *err)
    int kvc_state_describe(const uint8_t *data, size_t len, kvc_state_desc *d, int32_t *pos, uint64_t *seq,
                           uint32_t pos_cap, kvc_state_layer_desc *layers, uint32_t layers_cap, kvc_err *err)

    enum: KVC_STATE_MAX_PARTS
    ctypedef struct kvc_state_plan:
        const uint8_t *data
        int32_t seq_id
        size_t len
        bint noop
        uint32_t n_sec
    int  kvc_unified_state_prepare(kvc_unified *c, int32_t seq_id, const uint8_t *data, size_t len,
                                   kvc_state_plan *plan, kvc_err *err)
    int  kvc_unified_state_apply(kvc_unified *c, const kvc_state_plan *plan)
    void kvc_state_plan_free(kvc_state_plan *plan)
    int  kvc_unified_state_read_parts(kvc_unified *const *caches, uint32_t n_parts, int32_t seq_id,
                                      const uint8_t *data, size_t len, size_t *consumed, kvc_err *err)
    int  kvc_unified_state_prepare_ex(kvc_unified *c, int32_t seq_id, const uint8_t *data, size_t len,
                                      unsigned flags, kvc_state_plan *plan, kvc_err *err)
    int  kvc_unified_state_read_parts_ex(kvc_unified *const *caches, uint32_t n_parts, int32_t seq_id,
                                         const uint8_t *data, size_t len, unsigned flags, size_t *consumed,
                                         kvc_err *err)
