/* kvcache — the ggml tensor types a K/V cache can hold: the one type table.
 *
 * Ids, block sizes and block byte sizes are ggml's, so that state blobs carry
 * the same type ids and row sizes as llama.cpp's. */
#ifndef KVC_TYPES_H
#define KVC_TYPES_H

#include "kvc_common.h"

#ifdef __cplusplus
extern "C" {
#endif

enum kvc_type {
    KVC_TYPE_F32    = 0,
    KVC_TYPE_F16    = 1,
    KVC_TYPE_Q4_0   = 2,
    KVC_TYPE_Q4_1   = 3,
    KVC_TYPE_Q5_0   = 6,
    KVC_TYPE_Q5_1   = 7,
    KVC_TYPE_Q8_0   = 8,
    KVC_TYPE_IQ4_NL = 20,
    KVC_TYPE_BF16   = 30,
};

typedef struct kvc_type_info {
    int32_t     id;         /* ggml type id */
    const char *name;       /* ggml type name ("f16", "q8_0", ...) */
    uint32_t    blck_size;  /* elements per block */
    uint32_t    type_size;  /* bytes per block */
} kvc_type_info;

/* The info of a supported type id, or NULL when the id is not supported. */
const kvc_type_info *kvc_type_get(int32_t id);
/* The info of a type by name, or NULL. */
const kvc_type_info *kvc_type_by_name(const char *name);
/* Number of supported types and the i-th one (for listing). */
size_t kvc_type_count(void);
const kvc_type_info *kvc_type_at(size_t i);

/* ggml_row_size: bytes of a row of n elements; 0 when n is not a multiple of the block, the
 * type is unknown or the bytes exceed SIZE_MAX. */
size_t kvc_row_size(int32_t type, uint64_t n);

/* The geometry of model layer il of a cache (no memory attached): its widths and the bytes of
 * its rows of types type_k / type_v. */
kvc_layer kvc_layer_geometry(int32_t il, int32_t type_k, int32_t type_v, uint32_t n_embd_k, uint32_t n_embd_v);

/* f16 / bf16 <-> f32 conversion (IEEE round-to-nearest-even, as ggml). */
float    kvc_f16_to_f32(uint16_t h);
uint16_t kvc_f32_to_f16(float f);
float    kvc_bf16_to_f32(uint16_t h);
uint16_t kvc_f32_to_bf16(float f);

#ifdef __cplusplus
}
#endif

#endif
