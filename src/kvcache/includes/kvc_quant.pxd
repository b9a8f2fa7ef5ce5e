from libc.stdint cimport int8_t, int32_t, int64_t, uint8_t

cdef extern from "kvc_quant.h" nogil:
    const int8_t kvc_iq4nl_values[16]
    int kvc_dequantize_row(int32_t type, const void *src, float *dst, int64_t n)
    int kvc_quantize_row(int32_t type, const float *src, void *dst, int64_t n)
    int kvc_type_is_quantized(int32_t type)
