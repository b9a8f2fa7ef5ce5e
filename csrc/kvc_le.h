/* Internal to the C core: little-endian scalars. Every serialized field (state blobs, the scales
 * of quantized blocks) is little-endian whatever the host; these are its only readers and
 * writers. */
#ifndef KVC_LE_H
#define KVC_LE_H

#include <stdint.h>

static inline uint16_t kvc_le_get_u16(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }

static inline void kvc_le_put_u16(uint8_t *p, uint16_t v) {
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
}

static inline uint32_t kvc_le_get_u32(const uint8_t *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static inline void kvc_le_put_u32(uint8_t *p, uint32_t v) {
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
    p[2] = (uint8_t)(v >> 16);
    p[3] = (uint8_t)(v >> 24);
}

static inline uint64_t kvc_le_get_u64(const uint8_t *p) {
    return (uint64_t)kvc_le_get_u32(p) | (uint64_t)kvc_le_get_u32(p + 4) << 32;
}

static inline void kvc_le_put_u64(uint8_t *p, uint64_t v) {
    kvc_le_put_u32(p, (uint32_t)v);
    kvc_le_put_u32(p + 4, (uint32_t)(v >> 32));
}

/* Two's complement, without the implementation-defined conversion of an unsigned value. */
static inline int32_t kvc_le_get_i32(const uint8_t *p) {
    const uint32_t u = kvc_le_get_u32(p);
    return u <= (uint32_t)INT32_MAX ? (int32_t)u : -(int32_t)(~u) - 1;
}

static inline void kvc_le_put_i32(uint8_t *p, int32_t v) { kvc_le_put_u32(p, (uint32_t)v); }

#endif
