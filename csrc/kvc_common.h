/* kvcache — common definitions shared by every C module.
 *
 * Pure C11, no Python headers. Every fallible function returns an int status:
 * KVC_OK (0) on success, a negative KVC_E_* code on failure. Functions that
 * answer a yes/no question return 1 / 0 and negative codes for errors.
 * Nothing in csrc/ aborts the process. */
#ifndef KVC_COMMON_H
#define KVC_COMMON_H

#include <stddef.h>
#include <stdint.h>
#include <stdbool.h>

#if defined(_MSC_VER) && !defined(__GNUC__) && !defined(__clang__) && (defined(_M_X64) || defined(_M_ARM64))
#include <intrin.h>   /* outside extern "C": it declares C++ overloads when compiled as C++ */
#define KVC_MSVC_BITSCAN 1
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* Lets GCC and Clang check printf-style arguments against the format (a no-op elsewhere).
 * The formats are C99's (%zu, PRIu64): MinGW checks them as such, not as the old msvcrt's. */
#if defined(__MINGW32__)
#define KVC_PRINTF_FORMAT(fmt_index, first_arg) __attribute__((format(gnu_printf, fmt_index, first_arg)))
#elif defined(__GNUC__) || defined(__clang__)
#define KVC_PRINTF_FORMAT(fmt_index, first_arg) __attribute__((format(printf, fmt_index, first_arg)))
#else
#define KVC_PRINTF_FORMAT(fmt_index, first_arg)
#endif

#define KVC_MAX_SEQ 256         /* LLAMA_MAX_SEQ of today's llama.cpp (64 in mid-2025's): ids [0, 256) */
#define KVC_KQ_MASK_PAD 64      /* GGML_KQ_MASK_PAD: mask rows are padded to this */
#define KVC_POS_MAX INT32_MAX   /* the largest position */

enum kvc_status {
    KVC_OK          =  0,
    KVC_E_NOMEM     = -1,  /* an allocation failed (-> MemoryError) */
    KVC_E_ARG       = -2,  /* an argument is out of range (-> ValueError) */
    KVC_E_STATE     = -3,  /* a state blob is malformed or incompatible (-> StateError) */
    KVC_E_NOSPACE   = -4,  /* no room in the cache / output buffer */
    KVC_E_INTERNAL  = -5,  /* an invariant does not hold (a bug) */
};

/* One layer of a cache's K/V memory (the unified cache's and the recurrent cache's: their
 * headers say how the rows are laid out). */
typedef struct kvc_layer {
    int32_t  il;           /* model layer index */
    uint32_t n_embd_k;     /* K row width in elements */
    uint32_t n_embd_v;     /* V row width in elements */
    size_t   k_row_bytes;  /* kvc_row_size(type_k, n_embd_k) */
    size_t   v_row_bytes;  /* kvc_row_size(type_v, n_embd_v) */
    uint8_t *k;            /* the K rows, or NULL */
    uint8_t *v;            /* the V rows, or NULL */
} kvc_layer;

/* The index in layers[0, n) of model layer il, or -1 when none of them is it: every layer
 * table (a unified cache's, a recurrent cache's) is in model order, ascending il. */
static inline int64_t kvc_layers_find(const kvc_layer *layers, uint32_t n, int64_t il) {
    uint32_t lo = 0, hi = n;
    while (lo < hi) {
        const uint32_t mid = lo + (hi - lo) / 2;
        if (layers[mid].il < il) {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    return lo < n && layers[lo].il == il ? (int64_t)lo : -1;
}

/* Error details filled by functions that can fail for many reasons. */
typedef struct kvc_err {
    int  code;       /* one of enum kvc_status */
    char msg[256];   /* human-readable, NUL-terminated */
} kvc_err;

/* Fill err (if not NULL) with code and a printf-style message; returns code. */
int kvc_err_set(kvc_err *err, int code, const char *fmt, ...) KVC_PRINTF_FORMAT(3, 4);
/* KVC_OK when s is a sequence id of a cache of n_seq_max sequences, else KVC_E_ARG: the entry
 * points that index per-sequence records with a caller's id check it themselves. */
static inline int kvc_seq_id_check(int32_t s, uint32_t n_seq_max, kvc_err *err) {
    if (s < 0 || (uint32_t)s >= n_seq_max) {
        return kvc_err_set(err, KVC_E_ARG, "seq_id %d is outside [0, %u)", (int)s, (unsigned)n_seq_max);
    }
    return KVC_OK;
}
/* Put "<context>: " in front of err's message (a failure inside a part named by the caller);
 * returns code. */
int kvc_err_wrap(kvc_err *err, int code, const char *fmt, ...) KVC_PRINTF_FORMAT(3, 4);

/* KVC_OK when a cache may be made for n_seq_max sequences (1 .. KVC_MAX_SEQ), else KVC_E_ARG
 * with err: the one rule of every cache's constructor, so that they refuse alike. */
int kvc_n_seq_max_check(uint32_t n_seq_max, kvc_err *err);

/* The positions p0 <= p < p1 an operation acts on. p1 is wider than a position, so that "no
 * upper bound" (KVC_POS_END) lies past every position, KVC_POS_MAX included. */
typedef struct kvc_pos_range {
    int32_t p0;
    int64_t p1;
} kvc_pos_range;
#define KVC_POS_END ((int64_t)KVC_POS_MAX + 1)

/* The range of an operation's (p0, p1) arguments, as llama.cpp reads them: p0 < 0 means 0,
 * p1 < 0 no upper bound. */
static inline kvc_pos_range kvc_pos_range_of(int32_t p0, int32_t p1) {
    kvc_pos_range r = { p0 < 0 ? 0 : p0, p1 < 0 ? KVC_POS_END : (int64_t)p1 };
    return r;
}
static inline bool kvc_pos_range_has(kvc_pos_range r, int32_t p) { return p >= r.p0 && p < r.p1; }

/* a + b modulo 2**32, as int32 (the shifts a cell accumulates wrap rather than overflow). */
static inline int32_t kvc_wrap_add_i32(int32_t a, int32_t b) { return (int32_t)((uint32_t)a + (uint32_t)b); }

/* Round x up to a multiple of n (n > 0). */
static inline uint32_t kvc_pad_u32(uint32_t x, uint32_t n) { return ((x + n - 1) / n) * n; }
static inline uint32_t kvc_min_u32(uint32_t a, uint32_t b) { return a < b ? a : b; }

/* Checked byte arithmetic: *r = a * b (a + b), false when that exceeds SIZE_MAX. */
static inline bool kvc_size_mul(uint64_t a, uint64_t b, uint64_t *r) {
    if (a != 0 && b > (uint64_t)SIZE_MAX / a) {
        return false;
    }
    *r = a * b;
    return true;
}
static inline bool kvc_size_add(uint64_t a, uint64_t b, uint64_t *r) {
    if (b > (uint64_t)SIZE_MAX - a) {
        return false;
    }
    *r = a + b;
    return true;
}

/* Test hook: when > 0, the n-th following allocation through kvc_malloc fails. */
extern int kvc_fail_alloc_after;
void *kvc_malloc(size_t n);
/* kvc_malloc of count elements of size bytes; NULL when the product exceeds SIZE_MAX. */
void *kvc_malloc_n(uint64_t count, uint64_t size);
void *kvc_realloc_n(void *p, uint64_t count, uint64_t size);   /* likewise (p kept on failure) */
void *kvc_calloc(size_t count, size_t size);
void *kvc_realloc(void *p, size_t n);
/* A zeroed array of count elements of size bytes (NULL when out of memory; freed with kvc_free)
 * for a table a cache keeps all its life and reads at scattered cells: a cell table, the prefix
 * index's per-cell records. Its pages are made resident now, so that no later operation takes a
 * page fault on them, and from 1 MiB on it lies on whole huge pages where the system offers
 * them on request (kvc_advise_huge_pages), so that scattered cells miss the TLB far less. */
void *kvc_table_calloc(uint64_t count, uint64_t size);
void  kvc_free(void *p);

/* Arrays allocated and freed together (a table's columns): each named by the address of its
 * pointer (an int32_t ** for an int32_t array, ...), with its element count and size. Write
 * the list once, in one function the allocation and the release both call. */
typedef struct {
    void    *at;      /* where the array's pointer is */
    uint64_t count;   /* elements (allocation only) */
    uint64_t size;    /* bytes per element */
} kvc_array;
#define KVC_ARRAY(ptr, n) { (void *)&(ptr), (n), sizeof *(ptr) }
/* Allocate every array of a[0 .. n), zeroed, or none: when one allocation fails, those already
 * made are freed and every pointer is left NULL. KVC_OK or KVC_E_NOMEM. */
int   kvc_alloc_arrays(const kvc_array *a, size_t n);
/* Free every array of a[0 .. n) and set its pointer to NULL. */
void  kvc_free_arrays(const kvc_array *a, size_t n);
/* Free the array whose pointer is at `at` and set that pointer to NULL. */
void  kvc_free_clear(void *at);

/* Copy n bytes between regions that do not overlap. With stream, the destination is written
 * with non-temporal stores where the processor has them (for copies larger than the caches,
 * whose destination is not read again soon); kvc_stream_fence() orders them before later
 * reads. */
void  kvc_copy(void *dst, const void *src, size_t n, bool stream);
/* Whether the environment lets the AVX-512 paths run where the processor has them: not when
 * KVCACHE_NO_AVX512 is set and not "0" (for testing the others, or as a way out). Reads the
 * environment: ask once. */
bool  kvc_avx512_wanted(void);
void  kvc_stream_fence(void);

/* Run fn(args + i * arg_size) for every i < n, on up to min(n, KVC_MAX_THREADS) threads (the
 * caller's among them) where the platform has POSIX threads, one after the other elsewhere, for
 * the calls past that limit, or when a thread cannot be started. The calls must be independent;
 * all have returned when this does. */
void  kvc_parallel(void (*fn)(void *), void *args, size_t arg_size, unsigned n);
#define KVC_MAX_THREADS 64u
/* Threads worth using for a large memory-bound job when the caller does not say: the online
 * processors, at most KVC_AUTO_THREADS (more did not move memory faster), 1 without POSIX
 * threads. */
unsigned kvc_parallel_width(void);
#define KVC_AUTO_THREADS 4u

/* Huge pages for [p, p + n) where the system offers them on request (Linux transparent huge
 * pages in "madvise" mode): a K/V buffer's scattered accesses (defrag moves, gathers) then miss
 * the TLB far less. A hint: nothing happens elsewhere or when it is refused. */
void  kvc_advise_huge_pages(void *p, size_t n);
#define KVC_HUGE_PAGE ((size_t)2 << 20)

/* Bytes from which bulk writes (KQ masks, K/V moves) bypass the caches: about a last-level
 * cache. */
#define KVC_STREAM_BYTES ((size_t)16 << 20)


/* Bit helpers: GCC/Clang builtins, MSVC intrinsics on 64-bit targets, plain C elsewhere.
 * kvc_ctz64 and kvc_msb64 need x != 0. */
#if defined(__GNUC__) || defined(__clang__)
static inline unsigned kvc_ctz64(uint64_t x) { return (unsigned)__builtin_ctzll(x); }
static inline unsigned kvc_msb64(uint64_t x) { return 63u - (unsigned)__builtin_clzll(x); }
#else
#if defined(KVC_MSVC_BITSCAN)
static inline unsigned kvc_ctz64(uint64_t x) { unsigned long i; _BitScanForward64(&i, x); return (unsigned)i; }
static inline unsigned kvc_msb64(uint64_t x) { unsigned long i; _BitScanReverse64(&i, x); return (unsigned)i; }
#else
static inline unsigned kvc_ctz64(uint64_t x) { unsigned n = 0; while (!(x & 1u)) { x >>= 1; n++; } return n; }
static inline unsigned kvc_msb64(uint64_t x) { unsigned n = 0; while (x >>= 1) { n++; } return n; }
#endif
#endif
#if defined(__clang__) || (defined(__GNUC__) && defined(__POPCNT__))
static inline unsigned kvc_popcount64(uint64_t x) { return (unsigned)__builtin_popcountll(x); }
#else
/* Plain C elsewhere: GCC without POPCNT would call libgcc's table-driven routine, and MSVC's
 * __popcnt64 emits POPCNT, which an x86-64 CPU need not have. */
static inline unsigned kvc_popcount64(uint64_t x) {
    x = x - ((x >> 1) & 0x5555555555555555u);
    x = (x & 0x3333333333333333u) + ((x >> 2) & 0x3333333333333333u);
    x = (x + (x >> 4)) & 0x0f0f0f0f0f0f0f0fu;
    return (unsigned)((x * 0x0101010101010101u) >> 56);
}
#endif

/* A hint that the line holding p is read (KVC_PREFETCH) or written (KVC_PREFETCH_W) soon: for
 * walks over cells named by a list, which the hardware prefetchers cannot follow. */
#if defined(__GNUC__) || defined(__clang__)
#define KVC_PREFETCH(p) __builtin_prefetch((p), 0, 3)
#define KVC_PREFETCH_W(p) __builtin_prefetch((p), 1, 3)
#else
#define KVC_PREFETCH(p) ((void)(p))
#define KVC_PREFETCH_W(p) ((void)(p))
#endif
/* How a helper that only prefetches is declared: inlined wherever it is called, always. GCC takes
 * a function whose only effect is a prefetch for one without effects, and deletes a call it has
 * not inlined yet (a helper grown past its early inlining limits lost every prefetch). */
#if defined(__GNUC__) || defined(__clang__)
#define KVC_PREFETCH_FN static inline __attribute__((always_inline))
#else
#define KVC_PREFETCH_FN static inline
#endif
/* How many cells ahead a walk over a list of cells (a sequence's, a placement's, a prompt's in
 * the prefix index) prefetches what it will edit: such cells lie scattered over the cache, a
 * cache miss per field otherwise (16: a walk spends ~10 ns a cell, a miss to memory ~100). */
#define KVC_CELLS_AHEAD 16u

#ifdef __cplusplus
}
#endif

#endif
