#if defined(__linux__) && !defined(_DEFAULT_SOURCE)
#define _DEFAULT_SOURCE 1 /* madvise */
#endif
#include "kvc_common.h"
#include "kvc_simd.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#if defined(__linux__)
#include <sys/mman.h>
#ifdef MADV_COLLAPSE
#define KVC_MADV_COLLAPSE MADV_COLLAPSE
#else
#define KVC_MADV_COLLAPSE 25   /* its value in every Linux that has it: older headers lack the name */
#endif
#endif
#if (defined(__unix__) || defined(__APPLE__)) && !defined(KVC_NO_THREADS)
#include <pthread.h>
#include <unistd.h>
#define KVC_HAVE_PTHREADS 1
#endif

int kvc_fail_alloc_after = 0;

/* Counts down the test hook; returns true when this allocation must fail. */
static bool kvc_alloc_should_fail(void) {
    if (kvc_fail_alloc_after <= 0) {
        return false;
    }
    return --kvc_fail_alloc_after == 0;
}

void *kvc_malloc(size_t n) {
    if (kvc_alloc_should_fail()) {
        return NULL;
    }
    return malloc(n ? n : 1);
}

void *kvc_malloc_n(uint64_t count, uint64_t size) {
    uint64_t n;
    return kvc_size_mul(count, size, &n) ? kvc_malloc((size_t)n) : NULL;
}

void *kvc_realloc_n(void *p, uint64_t count, uint64_t size) {
    uint64_t n;
    return kvc_size_mul(count, size, &n) ? kvc_realloc(p, (size_t)n) : NULL;
}

void *kvc_calloc(size_t count, size_t size) {
    if (kvc_alloc_should_fail()) {
        return NULL;
    }
    return calloc(count ? count : 1, size ? size : 1);
}

void *kvc_table_calloc(uint64_t count, uint64_t size) {
    uint64_t n;
    if (!kvc_size_mul(count, size, &n) || n > (uint64_t)SIZE_MAX - KVC_HUGE_PAGE || kvc_alloc_should_fail()) {
        return NULL;
    }
    n = n ? n : 1;
#if defined(__linux__)
    if (n >= KVC_HUGE_PAGE / 2) {
        /* whole huge pages: the slack of rounding up is at most the array itself */
        const size_t bytes = ((size_t)n + KVC_HUGE_PAGE - 1) & ~(KVC_HUGE_PAGE - 1);
        unsigned char *p = aligned_alloc(KVC_HUGE_PAGE, bytes);
        if (p) {
            kvc_advise_huge_pages(p, bytes);
            memset(p, 0, (size_t)n);   /* writes every page: resident from now on */
#if defined(MADV_HUGEPAGE)
            /* memory the allocator had mapped before keeps its small pages when written: those
             * are made huge now (Linux 6.1 on; refused elsewhere, which changes nothing) */
            (void)madvise(p, bytes, KVC_MADV_COLLAPSE);
#endif
        }
        return p;
    }
#endif
    volatile unsigned char *p = calloc((size_t)n, 1);
    /* calloc's fresh pages are mapped on first write: one write per page maps them now */
    for (size_t k = 0; p && k < (size_t)n; k += 4096) {
        p[k] = 0;
    }
    return (void *)p;
}

void *kvc_realloc(void *p, size_t n) {
    if (kvc_alloc_should_fail()) {
        return NULL;
    }
    return realloc(p, n ? n : 1);
}

void kvc_free(void *p) { free(p); }

/* An array's pointer is read and written as bytes through its address (kvc_array.at): every
 * object pointer has the representation of a void * on the platforms kvcache builds for. */
static void *array_get(const void *at) {
    void *p;
    memcpy(&p, at, sizeof p);
    return p;
}

static void array_set(void *at, void *p) { memcpy(at, &p, sizeof p); }

int kvc_alloc_arrays(const kvc_array *a, size_t n) {
    for (size_t i = 0; i < n; i++) {
        uint64_t bytes;
        void *p = kvc_size_mul(a[i].count, a[i].size, &bytes) ? kvc_calloc((size_t)a[i].count, (size_t)a[i].size)
                                                             : NULL;
        array_set(a[i].at, p);
        if (!p) {
            kvc_free_arrays(a, i);
            for (size_t j = i + 1; j < n; j++) {
                array_set(a[j].at, NULL);
            }
            return KVC_E_NOMEM;
        }
    }
    return KVC_OK;
}

void kvc_free_arrays(const kvc_array *a, size_t n) {
    for (size_t i = 0; i < n; i++) {
        kvc_free_clear(a[i].at);
    }
}

void kvc_free_clear(void *at) {
    kvc_free(array_get(at));
    array_set(at, NULL);
}

#ifdef KVC_HAVE_SSE2
/* One 64-byte line from s to d (16-byte aligned) with non-temporal stores. */
static inline void kvc_stream_line(uint8_t *d, const uint8_t *s) {
    const __m128i a = _mm_loadu_si128((const __m128i *)s);
    const __m128i b = _mm_loadu_si128((const __m128i *)(s + 16));
    const __m128i c = _mm_loadu_si128((const __m128i *)(s + 32));
    const __m128i e = _mm_loadu_si128((const __m128i *)(s + 48));
    _mm_stream_si128((__m128i *)d, a);
    _mm_stream_si128((__m128i *)(d + 16), b);
    _mm_stream_si128((__m128i *)(d + 32), c);
    _mm_stream_si128((__m128i *)(d + 48), e);
}
#endif

/* 4 KiB pages: a streamed copy of at least KVC_COPY_PAGED bytes goes four pages at a time. */
#define KVC_PAGE 4096u
#define KVC_COPY_PAGED ((size_t)8 * KVC_PAGE)

bool kvc_avx512_wanted(void) {
    const char *no = getenv("KVCACHE_NO_AVX512");
    return !(no && *no && strcmp(no, "0") != 0);
}

#if defined(KVC_HAVE_SSE2) && (defined(__GNUC__) || defined(__clang__)) && (defined(__x86_64__) || defined(__i386__))
#define KVC_COPY_AVX512 1
#include <immintrin.h>
#include <stdatomic.h>

/* Whether the four-page blocks go with AVX-512 (a 64-byte store, one whole line each): 0.9x of
 * the SSE2 loop's time here. The processor and the environment (kvc_avx512_wanted) are asked
 * once. */
static bool kvc_pages_avx512(void) {
    static atomic_int have = -1;
    int h = atomic_load_explicit(&have, memory_order_relaxed);
    if (h < 0) {
        __builtin_cpu_init();
        h = kvc_avx512_wanted() && __builtin_cpu_supports("avx512f");
        atomic_store_explicit(&have, h, memory_order_relaxed);
    }
    return h != 0;
}

/* n bytes (a multiple of four pages; d 64-byte aligned) four pages at a time, as kvc_copy. */
__attribute__((target("avx512f"))) static void kvc_stream_pages_avx512(uint8_t *d, const uint8_t *s, size_t n) {
    for (size_t i = 0; i < n; i += 4 * KVC_PAGE) {
        for (size_t o = i; o < i + KVC_PAGE; o += 64) {
            const __m512i a = _mm512_loadu_si512((const void *)(s + o));
            const __m512i b = _mm512_loadu_si512((const void *)(s + o + KVC_PAGE));
            const __m512i c = _mm512_loadu_si512((const void *)(s + o + 2 * KVC_PAGE));
            const __m512i e = _mm512_loadu_si512((const void *)(s + o + 3 * KVC_PAGE));
            _mm512_stream_si512((__m512i *)(d + o), a);
            _mm512_stream_si512((__m512i *)(d + o + KVC_PAGE), b);
            _mm512_stream_si512((__m512i *)(d + o + 2 * KVC_PAGE), c);
            _mm512_stream_si512((__m512i *)(d + o + 3 * KVC_PAGE), e);
        }
    }
}
#endif

/* Whether source and destination lie at nearly the same offset within their pages (4 KiB
 * aliasing). The four-page loop's SSE2 form loads the line of page k + 1 right after storing the
 * line of page k at the same page offset; the processor, comparing the addresses' low 12 bits,
 * holds the load for the store to retire: 1.2-1.3x of memcpy's time here, where one stream runs
 * at memcpy's speed (a chunk of a prefix store at 16 bytes past a page into a page-aligned cache).
 * The AVX-512 form loads the four lines before storing them and is left as it is. */
static inline bool kvc_page_aliased(const uint8_t *d, const uint8_t *s) {
    return (((uintptr_t)s - (uintptr_t)d + 63u) & (KVC_PAGE - 1)) < 127u;   /* less than a line apart */
}

void kvc_copy(void *dst, const void *src, size_t n, bool stream) {
    uint8_t *d = dst;
    const uint8_t *s = src;
    size_t i = 0;
#ifdef KVC_HAVE_SSE2
    if (stream) {
        /* whole lines of the destination: the bytes before its first line boundary plainly */
        i = (64u - ((uintptr_t)d & 63u)) & 63u;
        i = i < n ? i : n;
        memcpy(d, s, i);
        if (n - i >= KVC_COPY_PAGED) {
            /* to the destination's next page boundary, then four of its pages at a time, a line
             * of each in turn: the hardware prefetchers follow a stream of loads within a 4 KiB
             * page only, so four streams keep more reads in flight than one (with 4 KiB pages on
             * either side, one stream ran at 0.7x of memcpy here, four at 0.9-1x) */
            for (const size_t e = i + ((KVC_PAGE - ((uintptr_t)(d + i) & (KVC_PAGE - 1))) & (KVC_PAGE - 1)); i < e;
                 i += 64) {
                kvc_stream_line(d + i, s + i);
            }
#ifdef KVC_COPY_AVX512
            if (kvc_pages_avx512()) {
                const size_t blocks = (n - i) / (4 * KVC_PAGE) * (4 * KVC_PAGE);
                kvc_stream_pages_avx512(d + i, s + i, blocks);
                i += blocks;
            }
#endif
            const bool aliased = kvc_page_aliased(d, s);
            for (; !aliased && i + 4 * KVC_PAGE <= n; i += 4 * KVC_PAGE) {
                for (size_t o = i; o < i + KVC_PAGE; o += 64) {
                    kvc_stream_line(d + o, s + o);
                    kvc_stream_line(d + o + KVC_PAGE, s + o + KVC_PAGE);
                    kvc_stream_line(d + o + 2 * KVC_PAGE, s + o + 2 * KVC_PAGE);
                    kvc_stream_line(d + o + 3 * KVC_PAGE, s + o + 3 * KVC_PAGE);
                }
            }
        }
        for (; i + 64 <= n; i += 64) {
            kvc_stream_line(d + i, s + i);
        }
    }
#else
    (void)stream;
#endif
    memcpy(d + i, s + i, n - i);
}

typedef struct kvc_task {
    void (*fn)(void *);
    void *arg;
} kvc_task;

#ifdef KVC_HAVE_PTHREADS
static void *kvc_task_run(void *t) {
    ((kvc_task *)t)->fn(((kvc_task *)t)->arg);
    return NULL;
}
#endif

void kvc_parallel(void (*fn)(void *), void *args, size_t arg_size, unsigned n) {
    uint8_t *a = args;
#ifdef KVC_HAVE_PTHREADS
    kvc_task tasks[KVC_MAX_THREADS];
    pthread_t threads[KVC_MAX_THREADS];
    bool started[KVC_MAX_THREADS] = { false };
    unsigned i = 1;
    for (; i < n && i < KVC_MAX_THREADS; i++) {
        tasks[i].fn = fn;
        tasks[i].arg = a + i * arg_size;
        started[i] = pthread_create(&threads[i], NULL, kvc_task_run, &tasks[i]) == 0;
    }
    if (n) {
        fn(a);
    }
    for (unsigned k = 1; k < i; k++) {
        if (started[k]) {
            pthread_join(threads[k], NULL);
        } else {
            fn(a + k * arg_size);  /* no thread for it: done here */
        }
    }
    for (; i < n; i++) {
        fn(a + i * arg_size);
    }
#else
    for (unsigned i = 0; i < n; i++) {
        fn(a + i * arg_size);
    }
#endif
}

unsigned kvc_parallel_width(void) {
#ifdef KVC_HAVE_PTHREADS
    const long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n < 1 ? 1u : n > (long)KVC_AUTO_THREADS ? KVC_AUTO_THREADS : (unsigned)n;
#else
    return 1;
#endif
}

void kvc_advise_huge_pages(void *p, size_t n) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    /* the whole huge pages inside the range */
    const uintptr_t a = ((uintptr_t)p + KVC_HUGE_PAGE - 1) & ~(uintptr_t)(KVC_HUGE_PAGE - 1);
    const uintptr_t b = ((uintptr_t)p + n) & ~(uintptr_t)(KVC_HUGE_PAGE - 1);
    if (b > a) {
        (void)madvise((void *)a, b - a, MADV_HUGEPAGE);
    }
#else
    (void)p;
    (void)n;
#endif
}

void kvc_stream_fence(void) {
#ifdef KVC_HAVE_SSE2
    _mm_sfence();
#endif
}

int kvc_err_set(kvc_err *err, int code, const char *fmt, ...) {
    if (err) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err->msg, sizeof err->msg, fmt, ap);
        va_end(ap);
        err->code = code;
    }
    return code;
}

int kvc_n_seq_max_check(uint32_t n_seq_max, kvc_err *err) {
    if (n_seq_max == 0 || n_seq_max > KVC_MAX_SEQ) {
        return kvc_err_set(err, KVC_E_ARG, "n_seq_max (%u) must be in [1, %d]", n_seq_max, KVC_MAX_SEQ);
    }
    return KVC_OK;
}

int kvc_err_wrap(kvc_err *err, int code, const char *fmt, ...) {
    if (err) {
        char inner[sizeof err->msg], context[sizeof err->msg];
        memcpy(inner, err->msg, sizeof inner);
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(context, sizeof context, fmt, ap);
        va_end(ap);
        kvc_err_set(err, code, "%s: %s", context, inner);
    }
    return code;
}
