from libc.stdint cimport int32_t, uint8_t, uint32_t

cdef extern from "kvc_rope.h" nogil:
    enum kvc_rope_mode:
        KVC_ROPE_NORMAL
        KVC_ROPE_NEOX
    ctypedef struct kvc_rope_params:
        int32_t n_rot
        int32_t mode
        int32_t n_ctx_orig
        float freq_base
        float freq_scale
        float ext_factor
        float attn_factor
        float beta_fast
        float beta_slow
        const float *freq_factors
    void kvc_rope_params_init(kvc_rope_params *p, int32_t n_rot)
    int kvc_rope_params_check(const kvc_rope_params *p, uint32_t head_dim)
    void kvc_rope_corr_dims(int32_t n_rot, int32_t n_ctx_orig, float freq_base,
                            float beta_fast, float beta_slow, float dims[2])
    void kvc_rope_angles(const kvc_rope_params *p, int32_t pos, float *cs)
    size_t kvc_rope_scratch_floats(uint32_t n_head, uint32_t head_dim, int32_t n_rot)
    int kvc_rope_shift_rows(int32_t type, uint8_t *k, uint32_t n_rows, uint32_t n_head,
                            uint32_t head_dim, size_t row_stride_bytes, const int32_t *shift,
                            const kvc_rope_params *p, float *scratch)
