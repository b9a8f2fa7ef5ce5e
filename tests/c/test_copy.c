/* kvc_copy: plain and streamed (non-temporal stores; from 32 KiB four 4 KiB pages at a time, one
 * stream where source and destination lie at nearly the same page offset) copies give memcpy's
 * bytes and touch nothing outside the destination, at any alignment of either side and any
 * length around the line, page and four-page boundaries; with the AVX-512
 * pages where the processor has them, and in a child process with KVCACHE_NO_AVX512 (the
 * choice is made at the first large copy, so the child is started before any). */
#define _POSIX_C_SOURCE 200112L
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "check.h"
#include "kvc_common.h"

#define GUARD 128u

static void check_copy(size_t n, size_t d_off, size_t s_off, bool stream) {
    uint8_t *src = malloc(n + s_off + 1), *dst = malloc(n + d_off + 2 * GUARD);
    REQUIRE(src && dst, "allocation");
    for (size_t i = 0; i < n + s_off + 1; i++) {
        src[i] = (uint8_t)check_rand(256);
    }
    memset(dst, 0xa5, n + d_off + 2 * GUARD);
    kvc_copy(dst + GUARD + d_off, src + s_off, n, stream);
    kvc_stream_fence();
    CHECK(n == 0 || memcmp(dst + GUARD + d_off, src + s_off, n) == 0, "bytes of %zu (offsets %zu, %zu, stream %d)",
          n, d_off, s_off, stream);
    bool outside = true;
    for (size_t i = 0; i < GUARD + d_off; i++) {
        outside = outside && dst[i] == 0xa5;
    }
    for (size_t i = GUARD + d_off + n; i < n + d_off + 2 * GUARD; i++) {
        outside = outside && dst[i] == 0xa5;
    }
    CHECK(outside, "bytes outside the destination (n %zu, offsets %zu, %zu, stream %d)", n, d_off, s_off, stream);
    free(src);
    free(dst);
}

static void run_checks(void) {
    static const size_t sizes[] = { 0, 1, 15, 63, 64, 65, 255, 256, 4095, 4096, 4097, 16384, 32767, 32768,
                                    32769, 36864, 65536 + 17, 3 * 16384 + 4032, 200000 };
    for (size_t k = 0; k < sizeof sizes / sizeof sizes[0]; k++) {
        for (int stream = 0; stream < 2; stream++) {
            check_copy(sizes[k], 0, 0, stream);
            check_copy(sizes[k], 1 + check_rand(63), check_rand(64), stream);
            check_copy(sizes[k], 64 * check_rand(64) + check_rand(64), check_rand(4096), stream);
        }
    }
    for (int r = 0; r < 200; r++) {
        check_copy(check_rand(300000), check_rand(4096), check_rand(4096), true);
    }
    for (size_t k = 0; k < 8; k++) {     /* nearly the same page offset on both sides */
        const size_t d_off = check_rand(4096);
        check_copy(40000 + check_rand(200000), d_off, (d_off + GUARD + 4096 - 63 + check_rand(127)) % 4096, true);
    }
}

int main(void) {
    fflush(stdout);
    const pid_t child = fork();
    if (child == 0) {
        setenv("KVCACHE_NO_AVX512", "1", 1);
        run_checks();
        printf("without AVX-512: %d checks, %d failed\n", n_checks, n_failed);
        fflush(stdout);
        _exit(n_failed != 0);
    }
    run_checks();
    int status = 0;
    CHECK(child > 0 && waitpid(child, &status, 0) == child && WIFEXITED(status) && WEXITSTATUS(status) == 0,
          "the checks without AVX-512 (child process) passed");
    printf("%d checks, %d failed\n", n_checks, n_failed);
    return n_failed != 0;
}
