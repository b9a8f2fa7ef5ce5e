#include "kvc_cols.h"

#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "kvc_common.h"

/* The vector path needs AVX-512BW (a 16-bit permute across two 64-byte registers); it is
 * compiled for that target alone and chosen at run time, so the core still runs on any x86-64. */
#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#define KVC_COLS_AVX512 1
#include <immintrin.h>
#endif

/* A transposed move reads and writes lines all over each row, in an order the hardware
 * prefetchers do not follow; so while a row is moved, the blocks of the row KVC_COLS_AHEAD
 * further on (vector path), or of the next pass of four rows (scalar path), are prefetched.
 * Without it the moves ran at about two thirds of the speed. */
#define KVC_COLS_AHEAD 2u

/* One chunk of a row (64 bytes: lanes elements) filled from a window of two chunks of the same
 * row: for each lane in mask, chunk element lane = window element idx[lane]. */
struct kvc_cols_op {
    uint32_t dst;   /* first element of the chunk */
    uint32_t win;   /* first element of the window */
    uint32_t mask;
    uint32_t pad;
    union {
        uint16_t w[32];
        uint32_t d[16];
    } idx;
};

/* A walk over the blocks of the next rows, handing out a few prefetches at a time. */
typedef struct kvc_cols_ahead {
    const uint8_t *row;
    size_t         stride;
    uint32_t       n_rows, j, p;
    bool           aligned;   /* rows on 64-byte lines: one line per block */
} kvc_cols_ahead;

static inline void kvc_cols_prefetch(kvc_cols_ahead *a, const kvc_cols *cols, uint32_t n) {
    for (; n && a->j < a->n_rows; n--) {
        const uint8_t *b = a->row + (size_t)a->j * a->stride + (size_t)cols->blocks[a->p] * 64;
        KVC_PREFETCH(b);
        if (!a->aligned) {
            KVC_PREFETCH(b + 63);
        }
        if (++a->p == cols->n_blocks) {
            a->p = 0;
            a->j++;
        }
    }
}

static kvc_cols_ahead kvc_cols_ahead_of(const kvc_cols *cols, const uint8_t *base, size_t stride, uint32_t e,
                                        uint32_t n, uint32_t n_rows) {
    const uint32_t rows = cols->n_blocks && e < n_rows ? kvc_min_u32(n, n_rows - e) : 0;
    return (kvc_cols_ahead){ rows ? base + (size_t)e * stride : NULL, stride, rows, 0, 0,
                             ((uintptr_t)base | stride) % 64 == 0 };
}

/* The definition: in every row, element dst = element src for each pair. No element is both,
 * so the order does not matter. Four rows per pass read the pair list a quarter as often. */
#define KVC_COLS_SCALAR(T, cols, base, stride, n_rows)                                              \
    do {                                                                                            \
        const uint32_t *pr_ = (cols)->pairs, np_ = (cols)->n_pairs;                                 \
        const uint32_t chunks_ = (np_ + 7) / 8;                                                     \
        uint32_t e_ = 0;                                                                            \
        for (; e_ + 4 <= (n_rows); e_ += 4) {                                                       \
            T *r0_ = (T *)((base) + (size_t)e_ * (stride));                                         \
            T *r1_ = (T *)((uint8_t *)r0_ + (stride));                                              \
            T *r2_ = (T *)((uint8_t *)r1_ + (stride));                                              \
            T *r3_ = (T *)((uint8_t *)r2_ + (stride));                                              \
            kvc_cols_ahead a_ = kvc_cols_ahead_of((cols), (base), (stride), e_ + 4, 4, (n_rows));   \
            const uint32_t per_ = (a_.n_rows * (cols)->n_blocks + chunks_ - 1) / chunks_;           \
            for (uint32_t k0_ = 0; k0_ < np_; k0_ += 8) {                                           \
                kvc_cols_prefetch(&a_, (cols), per_);                                               \
                const uint32_t k1_ = kvc_min_u32(k0_ + 8, np_);                                     \
                for (uint32_t k_ = k0_; k_ < k1_; k_++) {                                           \
                    const uint32_t d_ = pr_[2 * k_], s_ = pr_[2 * k_ + 1];                          \
                    r0_[d_] = r0_[s_];                                                              \
                    r1_[d_] = r1_[s_];                                                              \
                    r2_[d_] = r2_[s_];                                                              \
                    r3_[d_] = r3_[s_];                                                              \
                }                                                                                   \
            }                                                                                       \
        }                                                                                           \
        for (; e_ < (n_rows); e_++) {                                                               \
            T *r_ = (T *)((base) + (size_t)e_ * (stride));                                          \
            for (uint32_t k_ = 0; k_ < np_; k_++) {                                                 \
                r_[pr_[2 * k_]] = r_[pr_[2 * k_ + 1]];                                              \
            }                                                                                       \
        }                                                                                           \
    } while (0)

bool kvc_cols_vector_available(void) {
    if (!kvc_avx512_wanted()) {
        return false;
    }
#ifdef KVC_COLS_AVX512
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
#else
    return false;
#endif
}

#ifdef KVC_COLS_AVX512

/* The vector path, for elements of 2 (W = 16) or 4 bytes (W = 32). */
#define KVC_COLS_VECTOR(W, T, LANES, MASK)                                                              \
    __attribute__((target("avx512f,avx512bw"))) static void kvc_cols_apply##W(                        \
        const kvc_cols *cols, uint8_t *base, size_t stride, uint32_t n_rows) {                        \
        const uint32_t per = (cols->n_blocks + cols->n_ops - 1) / cols->n_ops;                        \
        for (uint32_t e = 0; e < n_rows; e++) {                                                       \
            T *r = (T *)(base + (size_t)e * stride);                                                  \
            kvc_cols_ahead a = kvc_cols_ahead_of(cols, base, stride, e + KVC_COLS_AHEAD, 1, n_rows);  \
            for (uint32_t q = 0; q < cols->n_ops; q++) {                                              \
                const kvc_cols_op *o = &cols->ops[q];                                                 \
                kvc_cols_prefetch(&a, cols, per);                                                     \
                const __m512i lo = _mm512_loadu_si512(r + o->win);                                    \
                const __m512i hi = _mm512_loadu_si512(r + o->win + (LANES));                          \
                const __m512i v = _mm512_permutex2var_epi##W(lo, _mm512_loadu_si512(&o->idx), hi);    \
                _mm512_mask_storeu_epi##W(r + o->dst, (MASK)o->mask, v);                              \
            }                                                                                         \
        }                                                                                             \
    }
KVC_COLS_VECTOR(16, uint16_t, 32, __mmask32)
KVC_COLS_VECTOR(32, uint32_t, 16, __mmask16)

/* The ops: chunks in order; within a chunk, destinations in order, and a new op whenever the
 * sources no longer fit one window. The last chunk ends at the row's end (it may overlap the
 * one before it, and takes only the destinations that one did not). */
static void kvc_cols_plan_ops(kvc_cols *cols) {
    const uint32_t n_cells = cols->n_cells, el = cols->el, lanes = 64 / el;
    if (n_cells < 2 * lanes) {
        return;
    }
    uint32_t *src_of = kvc_calloc(n_cells, sizeof *src_of);   /* per destination: its source + 1 */
    kvc_cols_op *ops = kvc_malloc_n(cols->n_pairs, sizeof *ops);   /* >= 1 pair per op */
    if (!src_of || !ops) {
        kvc_free(src_of);
        kvc_free(ops);
        return;
    }
    for (uint32_t k = 0; k < cols->n_pairs; k++) {
        src_of[cols->pairs[2 * k]] = cols->pairs[2 * k + 1] + 1;
    }
    uint32_t n_ops = 0;
    for (uint32_t c0 = 0; c0 < n_cells; c0 += lanes) {
        const uint32_t c = c0 + lanes <= n_cells ? c0 : n_cells - lanes;
        kvc_cols_op *o = NULL;
        uint32_t lo = 0, hi = 0;
        for (uint32_t d = c0; d < c + lanes; d++) {
            if (!src_of[d]) {
                continue;
            }
            const uint32_t s = src_of[d] - 1;
            if (o && (s < lo ? hi - s : s - lo) >= 2 * lanes) {
                o = NULL;
            }
            if (!o) {
                o = &ops[n_ops++];
                memset(o, 0, sizeof *o);
                o->dst = c;
                lo = hi = s;
            }
            lo = s < lo ? s : lo;
            hi = s > hi ? s : hi;
            o->mask |= (uint32_t)1 << (d - c);
            o->win = lo;
        }
    }
    /* each window from its lowest source, pulled back where it would run past the row's end;
     * the indices are offsets in it */
    for (uint32_t q = 0; q < n_ops; q++) {
        kvc_cols_op *o = &ops[q];
        o->win = o->win + 2 * lanes <= n_cells ? o->win : n_cells - 2 * lanes;
        for (uint32_t lane = 0; lane < lanes; lane++) {
            if (o->mask >> lane & 1u) {
                const uint32_t off = src_of[o->dst + lane] - 1 - o->win;
                if (el == 2) {
                    o->idx.w[lane] = (uint16_t)off;
                } else {
                    o->idx.d[lane] = off;
                }
            }
        }
    }
    kvc_free(src_of);
    cols->ops = ops;
    cols->n_ops = n_ops;
}
#endif

/* The 64-byte blocks of a row (offsets from its start) holding a source or a destination, and
 * with the vector path any other block its loads and stores cover. */
static void kvc_cols_plan_blocks(kvc_cols *cols) {
    const size_t row = (size_t)cols->n_cells * cols->el, n = (row + 63) / 64;
    uint64_t *bits = kvc_calloc((n + 63) / 64, sizeof *bits);
    if (!bits) {
        return;
    }
#define KVC_MARK(first, last)                                                                      \
    for (size_t b_ = (first) / 64; b_ <= (last) / 64; b_++) {                                      \
        bits[b_ / 64] |= (uint64_t)1 << (b_ % 64);                                                 \
    }
    for (uint32_t k = 0; k < 2 * cols->n_pairs; k++) {
        const size_t at = (size_t)cols->pairs[k] * cols->el;
        KVC_MARK(at, at + cols->el - 1)
    }
    for (uint32_t q = 0; q < cols->n_ops; q++) {
        const size_t win = (size_t)cols->ops[q].win * cols->el, dst = (size_t)cols->ops[q].dst * cols->el;
        KVC_MARK(win, win + 127)
        KVC_MARK(dst, dst + 63)
    }
#undef KVC_MARK
    uint32_t count = 0;
    for (size_t w = 0; w < (n + 63) / 64; w++) {
        count += (uint32_t)kvc_popcount64(bits[w]);
    }
    cols->blocks = kvc_malloc_n(count, sizeof *cols->blocks);
    if (cols->blocks) {
        for (size_t b = 0; b < n; b++) {
            if (bits[b / 64] >> (b % 64) & 1u) {
                cols->blocks[cols->n_blocks++] = (uint32_t)b;
            }
        }
    }
    kvc_free(bits);
}

void kvc_cols_init(kvc_cols *cols, const uint32_t *pairs, uint32_t n_pairs, uint32_t n_cells, uint32_t el,
                   bool vector) {
    *cols = (kvc_cols){ n_cells, el, pairs, n_pairs, NULL, 0, NULL, 0 };
    if (!n_pairs) {
        return;
    }
#ifdef KVC_COLS_AVX512
    if (vector) {
        kvc_cols_plan_ops(cols);
    }
#else
    (void)vector;
#endif
    kvc_cols_plan_blocks(cols);
}

void kvc_cols_free(kvc_cols *cols) {
    kvc_free(cols->ops);
    kvc_free(cols->blocks);
    cols->ops = NULL;
    cols->blocks = NULL;
    cols->n_ops = cols->n_blocks = 0;
}

void kvc_cols_apply(const kvc_cols *cols, uint8_t *base, size_t stride, uint32_t n_rows) {
    if (!cols->n_pairs) {
        return;
    }
#ifdef KVC_COLS_AVX512
    if (cols->ops) {
        if (cols->el == 2) {
            kvc_cols_apply16(cols, base, stride, n_rows);
        } else {
            kvc_cols_apply32(cols, base, stride, n_rows);
        }
        return;
    }
#endif
    if (cols->el == 2) {
        KVC_COLS_SCALAR(uint16_t, cols, base, stride, n_rows);
    } else {
        KVC_COLS_SCALAR(uint32_t, cols, base, stride, n_rows);
    }
}
