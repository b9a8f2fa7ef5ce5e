from libc.stdint cimport int32_t, uint32_t, uint64_t, uint8_t
from kvcache.includes.kvc_common cimport kvc_err, kvc_layer, kvc_ubatch
from kvcache.includes.kvc_seqops cimport kvc_seq_ops

cdef extern from "kvc_recurrent.h" nogil:
    ctypedef struct kvc_rec_cells:
        uint32_t size
        uint32_t head
        uint32_t n
        uint32_t used
        int32_t rs_z
        int32_t *pos
        int32_t *src
        int32_t *src0
        int32_t *tail
        uint32_t *rs_idx
        uint32_t *snap
        uint64_t *seq
        uint32_t seq_words

    ctypedef struct kvc_recurrent_ops:
        int32_t semantics
        bint checkpoints

    ctypedef struct kvc_recurrent:
        kvc_rec_cells cells
        uint32_t n_seq_max
        int32_t type_k
        int32_t type_v
        uint32_t n_layer
        kvc_layer *layers
        const kvc_recurrent_ops *ops
        uint32_t n_rs_seq
        uint32_t n_warn
        char warn[1024]

    ctypedef struct kvc_recurrent_params:
        uint32_t kv_size
        uint32_t n_seq_max
        int32_t type_k
        int32_t type_v
        uint32_t n_layer
        const uint32_t *n_embd_k
        const uint32_t *n_embd_v
        int32_t semantics
        uint32_t n_rs_seq

    enum:
        KVC_REC_2025
        KVC_REC_2026
        KVC_REC_MAX_RS_SEQ

    void kvc_recurrent_free(kvc_recurrent *c)
    void kvc_recurrent_set_layer_buffers(kvc_recurrent *c, uint32_t il, uint8_t *k, uint8_t *v)

    const kvc_seq_ops kvc_recurrent_seq_ops   # clear, seq_rm, seq_cp, seq_keep, seq_add, seq_div
    int32_t kvc_recurrent_seq_pos_min(const kvc_recurrent *c, int32_t s)
    int32_t kvc_recurrent_seq_pos_max(const kvc_recurrent *c, int32_t s)

    int     kvc_recurrent_find_slot(kvc_recurrent *c, const kvc_ubatch *ub, kvc_err *err)
    int     kvc_recurrent_unplace(kvc_recurrent *c)
    int     kvc_recurrent_prepare(kvc_recurrent *c, const kvc_ubatch *ubs, uint32_t n_ub, kvc_err *err)
    void    kvc_recurrent_commit(kvc_recurrent *c)
    void    kvc_recurrent_restore(kvc_recurrent *c)
    void    kvc_recurrent_set_full(kvc_recurrent *c)

    int      kvc_recurrent_s_copy(kvc_recurrent *c, uint32_t count, int32_t *out)
    int      kvc_recurrent_s_mask(kvc_recurrent *c, uint32_t count, float *out)
    uint32_t kvc_recurrent_cell_max(const kvc_recurrent *c)
    int      kvc_recurrent_store(kvc_recurrent *c, uint32_t il, uint32_t n_rows, const void *k, const void *v)
    int      kvc_recurrent_store_plane(kvc_recurrent *c, uint32_t il, uint32_t plane, uint32_t n_rows, const void *k,
                                       const void *v)
    int32_t  kvc_recurrent_rollback_len(const kvc_recurrent *c, int32_t s, int32_t p0)
    bint     kvc_recurrent_rollback_ok(const kvc_recurrent *c, int32_t s, int32_t r)

    size_t kvc_recurrent_state_size(const kvc_recurrent *c, int32_t seq_id)
    int    kvc_recurrent_state_write(const kvc_recurrent *c, int32_t seq_id, uint8_t *out, size_t cap, size_t *written)
    int    kvc_recurrent_state_read(kvc_recurrent *c, int32_t seq_id, const uint8_t *data, size_t len,
                                    size_t *consumed, kvc_err *err)
    int    kvc_recurrent_state_read_ex(kvc_recurrent *c, int32_t seq_id, const uint8_t *data, size_t len,
                                       unsigned flags, size_t *consumed, kvc_err *err)
    size_t kvc_recurrent_state_size_lay(const kvc_recurrent *c, int32_t seq_id, unsigned layout)
    uint32_t kvc_recurrent_seq_rows(const kvc_recurrent *c, int32_t seq_id, const uint8_t **rows, uint64_t *offs,
                                    uint64_t *lens)
    int    kvc_recurrent_state_write_range_lay(const kvc_recurrent *c, int32_t seq_id, unsigned layout,
                                               uint64_t offset, uint8_t *out, size_t cap, size_t *written)
    int    kvc_recurrent_state_read_lay(kvc_recurrent *c, int32_t seq_id, const uint8_t *data, size_t len,
                                        unsigned flags, unsigned layout, size_t *consumed, kvc_err *err)
    int    kvc_recurrent_state_write_range(const kvc_recurrent *c, int32_t seq_id, uint64_t offset, uint8_t *out,
                                           size_t cap, size_t *written)

cdef extern from "kvc_recurrent_ops.h" nogil:
    const kvc_recurrent_ops kvc_recurrent_2025_ops
    const kvc_recurrent_ops kvc_recurrent_2026_ops
    int  kvc_recurrent_init(kvc_recurrent *c, const kvc_recurrent_params *p, kvc_err *err)
