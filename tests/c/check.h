/* The check macros shared by the C tests: CHECK counts and reports a failed condition and
 * goes on; REQUIRE also returns from the (void) test function. Each test program reports
 * n_checks and n_failed at the end. */
#ifndef KVC_TEST_CHECK_H
#define KVC_TEST_CHECK_H

#include <stdbool.h>
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

#endif
