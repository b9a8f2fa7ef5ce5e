/* kvcache — row conversion between f32 and the K/V storage types.
 *
 * Block layouts and arithmetic are ggml's reference ones (quantize_row_*_ref /
 * dequantize_row_*), byte for byte, so that a K-shift on a quantized cache writes
 * the same blocks llama.cpp's CPU backend writes. All blocks hold 32 elements:
 *
 *   q4_0   f16 d, 16 B nibbles          value (q - 8) * d
 *   q4_1   f16 d, f16 m, 16 B nibbles   value q * d + m
 *   q5_0   f16 d, u32 high bits, 16 B   value (q - 16) * d
 *   q5_1   f16 d, f16 m, u32 high bits, 16 B   value q * d + m
 *   q8_0   f16 d, 32 int8               value q * d
 *   iq4_nl f16 d, 16 B nibbles          value kvc_iq4nl_values[q] * d
 *
 * Nibble byte j of a block holds element j (low) and element j + 16 (high); high
 * bit j of q5 types belongs to element j. Multi-byte fields are little-endian.
 * f32 / f16 / bf16 rows are plain arrays (conversions from kvc_types.h). */
#ifndef KVC_QUANT_H
#define KVC_QUANT_H

#include "kvc_types.h"

#ifdef __cplusplus
extern "C" {
#endif

/* iq4_nl's non-linear 4-bit value table. */
extern const int8_t kvc_iq4nl_values[16];

/* Decode n elements (a multiple of the type's block size) of a row of `type` into f32.
 * KVC_E_ARG for an unsupported type or a partial block. */
int kvc_dequantize_row(int32_t type, const void *src, float *dst, int64_t n);

/* Encode n f32 elements (a multiple of the block size) into a row of `type`
 * (kvc_row_size(type, n) bytes). KVC_E_ARG for an unsupported type or a partial block. */
int kvc_quantize_row(int32_t type, const float *src, void *dst, int64_t n);

/* 1 when `type` is block-quantized (not f32 / f16 / bf16), 0 otherwise. */
int kvc_type_is_quantized(int32_t type);

#ifdef __cplusplus
}
#endif

#endif
