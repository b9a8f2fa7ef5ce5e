/* Helpers shared by the libFuzzer targets of tests/fuzz: a byte reader over the fuzz input,
 * a small deterministic PRNG, little-endian scalars, and a check that aborts with a message
 * (libFuzzer reports an abort as a crash and keeps the input). */
#ifndef KVC_FUZZ_COMMON_H
#define KVC_FUZZ_COMMON_H

#include "kvc_common.h"
#include "kvc_le.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Abort on a broken contract: the fuzzer reports it and saves the input. */
#define FUZZ_CHECK(cond, ...)                                                        \
    do {                                                                             \
        if (!(cond)) {                                                               \
            fprintf(stderr, "%s:%d: contract broken: %s: ", __FILE__, __LINE__, #cond); \
            fprintf(stderr, __VA_ARGS__);                                            \
            fputc('\n', stderr);                                                     \
            abort();                                                                 \
        }                                                                            \
    } while (0)

/* KVC_FUZZ_VERBOSE=1 in the environment: the targets say what each input did. */
static inline bool fz_verbose(void) {
    static int v = -1;
    if (v < 0) {
        const char *e = getenv("KVC_FUZZ_VERBOSE");
        v = e && *e && *e != '0';
    }
    return v != 0;
}

/* A refused call: KVC_E_STATE, or KVC_E_NOMEM when an injected allocation fault (`fault`) was
 * used up (not `fault_pending`), with a message in err. */
static inline void fz_check_refused(int rc, const kvc_err *err, bool fault, bool fault_pending, const char *call) {
    FUZZ_CHECK(rc == KVC_E_STATE || (rc == KVC_E_NOMEM && fault && !fault_pending), "%s failed with %d (%s)", call, rc,
               err->msg);
    FUZZ_CHECK(err->code == rc && err->msg[0] != 0 && memchr(err->msg, 0, sizeof err->msg) != NULL,
               "error %d without a message", rc);
}

/* Reads bytes from the front of the input; past the end every read yields 0. */
typedef struct fz_reader {
    const uint8_t *p;
    size_t n, off;
} fz_reader;

static inline uint8_t fz_u8(fz_reader *r) { return r->off < r->n ? r->p[r->off++] : 0; }

static inline uint16_t fz_u16(fz_reader *r) {
    const uint16_t lo = fz_u8(r);
    return (uint16_t)(lo | (uint16_t)fz_u8(r) << 8);
}

static inline bool fz_done(const fz_reader *r) { return r->off >= r->n; }

/* xorshift64*: deterministic, so a saved input replays the same cache. */
typedef struct fz_rng {
    uint64_t s;
} fz_rng;

static inline void fz_rng_seed(fz_rng *g, uint64_t seed) { g->s = seed * 0x9e3779b97f4a7c15u + 0x2545f4914f6cdd1du; }

static inline uint64_t fz_next(fz_rng *g) {
    g->s ^= g->s >> 12;
    g->s ^= g->s << 25;
    g->s ^= g->s >> 27;
    return g->s * 0x2545f4914f6cdd1du;
}

/* Uniform-ish in [0, n) (n > 0). */
static inline uint32_t fz_below(fz_rng *g, uint32_t n) { return (uint32_t)(fz_next(g) >> 32) % n; }

static inline void fz_fill(fz_rng *g, uint8_t *p, size_t n) {
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const uint64_t x = fz_next(g);
        memcpy(p + i, &x, 8);
    }
    for (; i < n; i++) {
        p[i] = (uint8_t)(fz_next(g) >> 56);
    }
}

/* A copy of n bytes (NULL stays NULL); aborts when memory runs out, which is not a finding. */
static inline uint8_t *fz_dup(const uint8_t *p, size_t n) {
    if (!p) {
        return NULL;
    }
    uint8_t *q = malloc(n ? n : 1);
    if (!q) {
        abort();
    }
    memcpy(q, p, n);
    return q;
}

static inline void *fz_alloc(size_t n) {
    void *q = calloc(1, n ? n : 1);
    if (!q) {
        abort();
    }
    return q;
}

/* Bytes [0, n) of a equal b's, or are all 0 when b is NULL. */
/* The K/V data of a state section whose first layer header starts at off: every layer's K,
 * then every layer's V, each a 12-byte header and cc rows. Fills the offset of each layer's
 * first K / V byte and returns where the data ends. */
static inline size_t fz_data_offsets(const kvc_layer *layers, uint32_t n_layer, uint32_t cc, size_t off,
                                     size_t *k_off, size_t *v_off) {
    for (uint32_t l = 0; l < n_layer; l++) {
        k_off[l] = off + 12;
        off += 12 + (size_t)cc * layers[l].k_row_bytes;
    }
    for (uint32_t l = 0; l < n_layer; l++) {
        /* rows or transposed, V holds cc * v_row_bytes bytes after its header */
        v_off[l] = off + 12;
        off += 12 + (size_t)cc * layers[l].v_row_bytes;
    }
    return off;
}

static inline bool fz_same_or_zero(const uint8_t *a, const uint8_t *b, size_t n) {
    if (b) {
        return memcmp(a, b, n) == 0;
    }
    for (size_t i = 0; i < n; i++) {
        if (a[i]) {
            return false;
        }
    }
    return true;
}

/* Index of the first differing byte, or -1 when equal (for messages). */
static inline long fz_first_diff(const uint8_t *a, const uint8_t *b, size_t n) {
    for (size_t i = 0; i < n; i++) {
        if (a[i] != b[i]) {
            return (long)i;
        }
    }
    return -1;
}

/* --- the K/V memory a target gives its cache ---------------------------------------------- */

enum { FZ_MAX_LAYERS = 4 };

/* One block per layer and half (NULL where the cache runs without memory), and deep copies of
 * it for the checks that a failed call changed nothing. */
typedef struct fz_kv {
    uint8_t *k[FZ_MAX_LAYERS], *v[FZ_MAX_LAYERS];
    size_t k_bytes[FZ_MAX_LAYERS], v_bytes[FZ_MAX_LAYERS];
} fz_kv;

static inline void fz_kv_layer(fz_kv *m, uint32_t l, size_t k_bytes, size_t v_bytes) {
    m->k_bytes[l] = k_bytes;
    m->v_bytes[l] = v_bytes;
    m->k[l] = (uint8_t *)fz_alloc(k_bytes);
    m->v[l] = (uint8_t *)fz_alloc(v_bytes);
}

static inline void fz_kv_free(fz_kv *m) {
    for (uint32_t l = 0; l < FZ_MAX_LAYERS; l++) {
        free(m->k[l]);
        free(m->v[l]);
    }
    memset(m, 0, sizeof *m);
}

static inline void fz_kv_fill(fz_kv *m, fz_rng *g) {
    for (uint32_t l = 0; l < FZ_MAX_LAYERS; l++) {
        if (m->k[l]) {
            fz_fill(g, m->k[l], m->k_bytes[l]);
            fz_fill(g, m->v[l], m->v_bytes[l]);
        }
    }
}

static inline void fz_kv_copy(fz_kv *copy, const fz_kv *m) {
    *copy = *m;
    for (uint32_t l = 0; l < FZ_MAX_LAYERS; l++) {
        copy->k[l] = fz_dup(m->k[l], m->k_bytes[l]);
        copy->v[l] = fz_dup(m->v[l], m->v_bytes[l]);
    }
}

/* Every byte of now is the copy's. */
static inline void fz_kv_check(const fz_kv *now, const fz_kv *was, const char *when) {
    for (uint32_t l = 0; l < FZ_MAX_LAYERS; l++) {
        if (was->k[l]) {
            FUZZ_CHECK(memcmp(now->k[l], was->k[l], was->k_bytes[l]) == 0, "%s: K memory of layer %u differs at byte %ld",
                       when, l, fz_first_diff(now->k[l], was->k[l], was->k_bytes[l]));
            FUZZ_CHECK(memcmp(now->v[l], was->v[l], was->v_bytes[l]) == 0, "%s: V memory of layer %u differs at byte %ld",
                       when, l, fz_first_diff(now->v[l], was->v[l], was->v_bytes[l]));
        }
    }
}

#endif
