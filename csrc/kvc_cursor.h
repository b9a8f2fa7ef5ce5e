/* Internal to the C core: the one bounds-checked reader of serialized state, under the section
 * parser (kvc_section.h) that the unified and recurrent state readers and the description of a
 * blob without a cache share. Every take checks the bytes left first and leaves the cursor
 * unmoved when they are too few. */
#ifndef KVC_CURSOR_H
#define KVC_CURSOR_H

#include "kvc_common.h"
#include "kvc_le.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct kvc_cursor {
    const uint8_t *p;
    size_t len, off;
} kvc_cursor;

/* Take the next n bytes, or false (cursor unmoved) when fewer remain. */
static inline bool kvc_cur_take(kvc_cursor *r, size_t n, const uint8_t **out) {
    if (r->len - r->off < n) {
        return false;
    }
    *out = r->p + r->off;
    r->off += n;
    return true;
}

static inline bool kvc_cur_skip(kvc_cursor *r, uint64_t n) {
    if ((uint64_t)(r->len - r->off) < n) {
        return false;
    }
    r->off += (size_t)n;
    return true;
}

static inline bool kvc_cur_u32(kvc_cursor *r, uint32_t *v) {
    const uint8_t *q;
    if (!kvc_cur_take(r, 4, &q)) {
        return false;
    }
    *v = kvc_le_get_u32(q);
    return true;
}

static inline bool kvc_cur_i32(kvc_cursor *r, int32_t *v) {
    const uint8_t *q;
    if (!kvc_cur_take(r, 4, &q)) {
        return false;
    }
    *v = kvc_le_get_i32(q);
    return true;
}

static inline bool kvc_cur_u64(kvc_cursor *r, uint64_t *v) {
    const uint8_t *q;
    if (!kvc_cur_take(r, 8, &q)) {
        return false;
    }
    *v = kvc_le_get_u64(q);
    return true;
}

/* KVC_E_STATE with "state truncated at byte X of N while reading <what> (<need> bytes)" (X: where
 * the failed read starts; the byte count left out when need is 0; err NULL: KVC_E_STATE alone).
 * Defined in kvc_section.c. */
KVC_PRINTF_FORMAT(4, 5) int kvc_cur_truncated(kvc_err *err, const kvc_cursor *r, size_t need, const char *fmt, ...);

#ifdef __cplusplus
}
#endif

#endif
