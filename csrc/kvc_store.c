/* The chunk checksum of the prefix store: kvc_store.h. */
#if !defined(_WIN32) && !defined(_POSIX_C_SOURCE)
#define _POSIX_C_SOURCE 200809L /* read */
#endif
#include "kvc_store.h"

#include <errno.h>
#include <limits.h>
#include <string.h>
#if defined(_WIN32)
#include <io.h>
#else
#include <unistd.h>
#endif

#include "kvc_common.h"
#include "kvc_le.h"

void kvc_store_sum_init(kvc_store_sum *s) { memset(s, 0, sizeof *s); }

/* A little-endian word (a plain load where the host is little-endian: the loop vectorizes). */
static inline uint64_t word(const uint8_t *p) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    uint64_t v;
    memcpy(&v, p, sizeof v);
    return v;
#else
    return kvc_le_get_u64(p);
#endif
}

/* Whole groups only: n a multiple of KVC_STORE_GROUP. */
static void groups(kvc_store_sum *s, const uint8_t *p, size_t n) {
    uint64_t a[4], b[4];
    for (int j = 0; j < 4; j++) {
        a[j] = s->a[j];
        b[j] = s->b[j];
    }
    for (size_t i = 0; i < n; i += KVC_STORE_GROUP) {
        for (int j = 0; j < 4; j++) {   /* four independent lanes: vector adds */
            a[j] += word(p + i + 8 * (size_t)j);
            b[j] += a[j];
        }
    }
    for (int j = 0; j < 4; j++) {
        s->a[j] = a[j];
        s->b[j] = b[j];
    }
}

void kvc_store_sum_update(kvc_store_sum *s, const uint8_t *p, size_t n) {
    s->n += n;
    if (s->n_pend) {
        const size_t take = n < KVC_STORE_GROUP - s->n_pend ? n : KVC_STORE_GROUP - s->n_pend;
        memcpy(s->pend + s->n_pend, p, take);
        s->n_pend += (uint32_t)take;
        p += take;
        n -= take;
        if (s->n_pend < KVC_STORE_GROUP) {
            return;
        }
        groups(s, s->pend, KVC_STORE_GROUP);
        s->n_pend = 0;
    }
    const size_t whole = n - n % KVC_STORE_GROUP;
    groups(s, p, whole);
    memcpy(s->pend, p + whole, n - whole);
    s->n_pend = (uint32_t)(n - whole);
}

void kvc_store_sum_copy(kvc_store_sum *s, uint8_t *dst, const uint8_t *src, size_t n, bool stream) {
    enum { STEP = 16384 };   /* a part of the first-level cache */
    for (size_t i = 0; i < n; i += STEP) {
        const size_t k = n - i < STEP ? n - i : STEP;
        kvc_copy(dst + i, src + i, k, stream);
        kvc_store_sum_update(s, src + i, k);
    }
}

/* Fill p[0, n) from fd: 0, 1 at the end of the file, -1 on an error. */
static int read_full(int fd, uint8_t *p, size_t n) {
    while (n) {
#if defined(_WIN32)
        const int r = _read(fd, p, n < (size_t)INT_MAX ? (unsigned)n : (unsigned)INT_MAX);
#else
        const ssize_t r = read(fd, p, n < (size_t)SSIZE_MAX ? n : (size_t)SSIZE_MAX);
#endif
        if (r < 0) {
            if (errno == EINTR) {
                continue;
            }
            return -1;
        }
        if (r == 0) {
            return 1;
        }
        p += r;
        n -= (size_t)r;
    }
    return 0;
}

int kvc_store_read(kvc_store_sum *s, int fd, uint8_t *dst, size_t n, uint8_t *bounce, size_t step, bool stream) {
    for (size_t i = 0; i < n; i += step) {
        const size_t k = n - i < step ? n - i : step;
        const int rc = read_full(fd, bounce ? bounce : dst + i, k);
        if (rc != 0) {
            return rc;
        }
        if (bounce) {
            kvc_store_sum_copy(s, dst + i, bounce, k, stream);
        } else {
            kvc_store_sum_update(s, dst + i, k);
        }
    }
    return 0;
}

/* splitmix64's finalizer: every input bit reaches every output bit */
static uint64_t mix(uint64_t h, uint64_t v) {
    h ^= v + 0x9E3779B97F4A7C15ull + (h << 6) + (h >> 2);
    h ^= h >> 30;
    h *= 0xBF58476D1CE4E5B9ull;
    h ^= h >> 27;
    h *= 0x94D049BB133111EBull;
    return h ^ (h >> 31);
}

uint64_t kvc_store_sum_digest(const kvc_store_sum *s) {
    kvc_store_sum t = *s;
    if (t.n_pend) {
        memset(t.pend + t.n_pend, 0, KVC_STORE_GROUP - t.n_pend);
        groups(&t, t.pend, KVC_STORE_GROUP);
    }
    uint64_t h = mix(0x6B7663732D73756Dull, t.n);  /* "kvcs-sum" */
    for (int j = 0; j < 4; j++) {
        h = mix(h, t.a[j]);
        h = mix(h, t.b[j]);
    }
    return h;
}
