from libc.stdint cimport int32_t, int64_t, uint32_t, uint64_t, uint8_t, uint16_t

cdef extern from "kvc_common.h" nogil:
    enum kvc_status:
        KVC_OK
        KVC_E_NOMEM
        KVC_E_ARG
        KVC_E_STATE
        KVC_E_NOSPACE
        KVC_E_INTERNAL
    ctypedef struct kvc_err:
        int code
        char msg[256]
    ctypedef struct kvc_layer:
        int32_t il
        uint32_t n_embd_k
        uint32_t n_embd_v
        size_t k_row_bytes
        size_t v_row_bytes
        uint8_t *k
        uint8_t *v
    ctypedef struct kvc_pos_range:
        int32_t p0
        int64_t p1
    int KVC_MAX_SEQ
    int KVC_KQ_MASK_PAD
    int kvc_fail_alloc_after
    uint32_t kvc_pad_u32(uint32_t x, uint32_t n)
    int kvc_n_seq_max_check(uint32_t n_seq_max, kvc_err *err)
    void kvc_advise_huge_pages(void *p, size_t n)
    size_t KVC_HUGE_PAGE
    void kvc_copy(void *dst, const void *src, size_t n, bint stream)
    void kvc_stream_fence()
    void kvc_parallel(void (*fn)(void *) noexcept nogil, void *args, size_t arg_size, unsigned int n)
    unsigned int kvc_parallel_width()
    unsigned int KVC_MAX_THREADS
    unsigned int KVC_AUTO_THREADS
    size_t KVC_STREAM_BYTES

cdef extern from "kvc_ubatch.h" nogil:
    ctypedef struct kvc_ubatch:
        uint32_t n_tokens
        uint32_t n_seq_tokens
        uint32_t n_seqs
        const int32_t *pos
        const uint32_t *seq_off
        const int32_t *seq_ids
        const int32_t *pos_x
        const int32_t *pos_y
        const int32_t *token
    int kvc_ubatch_check(const kvc_ubatch *ub, uint32_t n_seq_max, kvc_err *err)

cdef extern from "kvc_types.h" nogil:
    enum kvc_type:
        KVC_TYPE_F32
        KVC_TYPE_F16
        KVC_TYPE_Q4_0
        KVC_TYPE_Q4_1
        KVC_TYPE_Q5_0
        KVC_TYPE_Q5_1
        KVC_TYPE_Q8_0
        KVC_TYPE_IQ4_NL
        KVC_TYPE_BF16
    ctypedef struct kvc_type_info:
        int32_t id
        const char *name
        uint32_t blck_size
        uint32_t type_size
    const kvc_type_info *kvc_type_get(int32_t id)
    const kvc_type_info *kvc_type_by_name(const char *name)
    size_t kvc_type_count()
    const kvc_type_info *kvc_type_at(size_t i)
    size_t kvc_row_size(int32_t type, uint64_t n)
    float kvc_f16_to_f32(uint16_t h)
    uint16_t kvc_f32_to_f16(float f)
    float kvc_bf16_to_f32(uint16_t h)
    uint16_t kvc_f32_to_bf16(float f)
