/* The check macros shared by the C tests: CHECK counts and reports a failed condition and
 * goes on; REQUIRE also returns from the (void) test function. Each test program reports
 * n_checks and n_failed at the end. check_rand: a fixed-seed pseudo-random generator, so that
 * every run draws the same cases. */
#ifndef KVC_TEST_CHECK_H
#define KVC_TEST_CHECK_H

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

static int n_failed, n_checks;

#define CHECK(cond, ...)                                                   \
    do {                                                                   \
        n_checks++;                                                        \
        if (!(cond)) {                                                     \
            n_failed++;                                                    \
            fprintf(stderr, "%s:%d: CHECK(%s) failed: ", __FILE__, __LINE__, #cond); \
            fprintf(stderr, __VA_ARGS__);                                  \
            fputc('\n', stderr);                                           \
        }                                                                  \
    } while (0)

#define REQUIRE(cond, ...)                                                 \
    do {                                                                   \
        const bool required_ok_ = (cond);                                  \
        CHECK(required_ok_, __VA_ARGS__);                                  \
        if (!required_ok_) {                                               \
            return;                                                        \
        }                                                                  \
    } while (0)

/* A value in [0, n), n > 0 (xorshift64). */
static uint64_t check_rng = 88172645463325252ull;
static inline uint32_t check_rand(uint32_t n) {
    check_rng ^= check_rng << 13;
    check_rng ^= check_rng >> 7;
    check_rng ^= check_rng << 17;
    return (uint32_t)(check_rng % n);
}

#endif
