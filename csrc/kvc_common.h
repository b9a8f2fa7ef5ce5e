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

#ifdef __cplusplus
extern "C" {
#endif

#define KVC_MAX_SEQ 64          /* LLAMA_MAX_PARALLEL_SEQUENCES: one bit per sequence */
#define KVC_KQ_MASK_PAD 64      /* GGML_KQ_MASK_PAD: mask rows are padded to this */
#define KVC_POS_MAX INT32_MAX   /* "infinity" for open position ranges */

enum kvc_status {
    KVC_OK          =  0,
    KVC_E_NOMEM     = -1,  /* an allocation failed (-> MemoryError) */
    KVC_E_ARG       = -2,  /* an argument is out of range (-> ValueError) */
    KVC_E_STATE     = -3,  /* a state blob is malformed or incompatible (-> StateError) */
    KVC_E_NOSPACE   = -4,  /* no room in the cache / output buffer */
    KVC_E_INTERNAL  = -5,  /* an invariant does not hold (a bug) */
};

/* Error details filled by functions that can fail for many reasons. */
typedef struct kvc_err {
    int  code;       /* one of enum kvc_status */
    char msg[256];   /* human-readable, NUL-terminated */
} kvc_err;

/* Fill err (if not NULL) with code and a printf-style message; returns code. */
int kvc_err_set(kvc_err *err, int code, const char *fmt, ...);

/* Round x up to a multiple of n (n > 0). */
static inline uint32_t kvc_pad_u32(uint32_t x, uint32_t n) { return ((x + n - 1) / n) * n; }

/* Test hook: when > 0, the n-th following allocation through kvc_malloc fails. */
extern int kvc_fail_alloc_after;
void *kvc_malloc(size_t n);
void *kvc_calloc(size_t count, size_t size);
void *kvc_realloc(void *p, size_t n);
void  kvc_free(void *p);


/* Bit helpers (portable: GCC/Clang builtins, MSVC intrinsics). x must be non-zero. */
#if defined(_MSC_VER) && !defined(__clang__)
#include <intrin.h>
static inline unsigned kvc_ctz64(uint64_t x) { unsigned long i; _BitScanForward64(&i, x); return (unsigned)i; }
static inline unsigned kvc_msb64(uint64_t x) { unsigned long i; _BitScanReverse64(&i, x); return (unsigned)i; }
static inline unsigned kvc_popcount64(uint64_t x) { return (unsigned)__popcnt64(x); }
#else
static inline unsigned kvc_ctz64(uint64_t x) { return (unsigned)__builtin_ctzll(x); }
static inline unsigned kvc_msb64(uint64_t x) { return 63u - (unsigned)__builtin_clzll(x); }
static inline unsigned kvc_popcount64(uint64_t x) { return (unsigned)__builtin_popcountll(x); }
#endif

#ifdef __cplusplus
}
#endif

#endif
