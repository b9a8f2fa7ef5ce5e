/* kvcache — the RoPE K-shift: rotating cached keys by a per-cell position delta.
 *
 * The arithmetic is ggml's extended RoPE (rope_ext) as llama.cpp's K-shift graph
 * applies it, in single precision: per pair i of a head the angle starts at the
 * cell's shift and is multiplied by freq_base^(-2/n_rot) once per pair; it is
 * divided by freq_factors[i] when given, mixed between interpolation (times
 * freq_scale) and extrapolation by the YaRN ramp when ext_factor != 0; cos and sin
 * are scaled by attn_factor (times 1 + 0.1 ln(1/freq_scale) under YaRN).
 * Dimensions >= n_rot of every head are left alone (quantized rows are still
 * re-encoded as a whole, as the reference does). */
#ifndef KVC_ROPE_H
#define KVC_ROPE_H

#include "kvc_types.h"

#ifdef __cplusplus
extern "C" {
#endif

enum kvc_rope_mode {
    KVC_ROPE_NORMAL = 0, /* rotates adjacent pairs (2i, 2i + 1) */
    KVC_ROPE_NEOX   = 2, /* rotates pairs (i, i + n_rot/2) */
};

typedef struct kvc_rope_params {
    int32_t      n_rot;        /* rotated dimensions per head: even, <= head_dim */
    int32_t      mode;         /* enum kvc_rope_mode */
    int32_t      n_ctx_orig;   /* training context of the YaRN correction range */
    float        freq_base;    /* frequency base (> 0) */
    float        freq_scale;   /* position scale (> 0; 1 = none) */
    float        ext_factor;   /* YaRN extrapolation mix; 0 = plain RoPE */
    float        attn_factor;  /* magnitude factor on cos / sin */
    float        beta_fast;    /* YaRN correction bounds */
    float        beta_slow;
    const float *freq_factors; /* NULL or n_rot/2 per-pair divisors of the angle */
} kvc_rope_params;

/* Fill p with the defaults (normal mode, base 10000, scale 1, no YaRN, attn 1,
 * beta_fast 32, beta_slow 1, n_ctx_orig 0, no factors) for n_rot dimensions. */
void kvc_rope_params_init(kvc_rope_params *p, int32_t n_rot);

/* KVC_OK when p is usable on heads of head_dim elements, else KVC_E_ARG. */
int kvc_rope_params_check(const kvc_rope_params *p, uint32_t head_dim);

/* ggml_rope_yarn_corr_dims: the first and last pair index of the YaRN ramp. */
void kvc_rope_corr_dims(int32_t n_rot, int32_t n_ctx_orig, float freq_base,
                        float beta_fast, float beta_slow, float dims[2]);

/* cos and sin (times the magnitude factor) of every pair for position delta pos:
 * cs[2i] = cos, cs[2i + 1] = sin, i < n_rot/2. */
void kvc_rope_angles(const kvc_rope_params *p, int32_t pos, float *cs);

/* Floats of scratch kvc_rope_shift_rows needs for these heads. */
size_t kvc_rope_scratch_floats(uint32_t n_head, uint32_t head_dim, int32_t n_rot);

/* Rotate, in place, the keys of n_rows rows (cells) of `type` starting at k: row r
 * begins at k + r*row_stride_bytes and holds n_head heads of head_dim elements,
 * back to back; row r is rotated by shift[r]. f32 / f16 / bf16 are rotated
 * directly; quantized rows are decoded, rotated and re-encoded (every block,
 * shift 0 included). scratch holds kvc_rope_scratch_floats(...) floats, or is NULL
 * to let the call allocate it once. Quantized types need head_dim to be a multiple
 * of the block size. Returns KVC_OK, KVC_E_ARG (nothing modified) or KVC_E_NOMEM. */
int kvc_rope_shift_rows(int32_t type, uint8_t *k, uint32_t n_rows, uint32_t n_head,
                        uint32_t head_dim, size_t row_stride_bytes, const int32_t *shift,
                        const kvc_rope_params *p, float *scratch);

#ifdef __cplusplus
}
#endif

#endif
