/* Tests of the column moves of a transposed buffer (csrc/kvc_cols.c) against the definition
 * (element dst = element src in every row, for each pair): random plans over rows of many
 * lengths, 2- and 4-byte elements, rows on and off 64-byte lines, with the vector path (where
 * the processor has it) and with the scalar one (KVCACHE_NO_AVX512), and with each of the
 * preparation's allocations failing. */
#define _POSIX_C_SOURCE 200112L
#include "kvc_cols.h"
#include "kvc_common.h"

#include <stdlib.h>
#include <string.h>

#include "check.h"

static bool vector;   /* the pass: the vector path where the processor has it, or the scalar one */
static uint32_t rng_state = 12345;
static uint32_t rnd(uint32_t n) {
    rng_state = rng_state * 1664525u + 1013904223u;
    return (rng_state >> 8) % n;
}

/* n_pairs (dst, src) pairs over n_cells, no cell both; clustered: destinations low and
 * sources high as a defrag plan makes them, else anywhere (windows that must split). */
static uint32_t make_pairs(uint32_t *pairs, uint32_t n_cells, bool clustered) {
    uint8_t *role = calloc(n_cells, 1);   /* 1 destination, 2 source */
    uint32_t n = 0, want = 1 + rnd(n_cells / 2);
    for (uint32_t tries = 0; n < want && tries < 8 * n_cells; tries++) {
        uint32_t d = rnd(n_cells), s = rnd(n_cells);
        if (clustered) {
            d = rnd(n_cells / 2 + 1) % n_cells;
            s = n_cells - 1 - rnd(n_cells / 2 + 1) % n_cells;
        }
        if (d == s || role[d] || role[s]) {
            continue;
        }
        role[d] = 1;
        role[s] = 2;
        pairs[2 * n] = d;
        pairs[2 * n + 1] = s;
        n++;
    }
    free(role);
    return n;
}

static void reference(uint8_t *base, size_t stride, uint32_t n_rows, uint32_t el, const uint32_t *pairs, uint32_t n) {
    for (uint32_t e = 0; e < n_rows; e++) {
        uint8_t *row = base + e * stride;
        for (uint32_t k = 0; k < n; k++) {
            memcpy(row + (size_t)pairs[2 * k] * el, row + (size_t)pairs[2 * k + 1] * el, el);
        }
    }
}

/* One plan on n_rows rows of n_cells elements, starting `skew` bytes past a 64-byte line. */
static void check_plan(uint32_t n_cells, uint32_t el, uint32_t n_rows, uint32_t skew, bool clustered, int fail_at) {
    const size_t stride = (size_t)n_cells * el, bytes = stride * n_rows + skew;
    uint32_t *pairs = malloc(sizeof(uint32_t) * 2 * n_cells);
    uint8_t *a = aligned_alloc(64, (bytes + 63) / 64 * 64), *b = aligned_alloc(64, (bytes + 63) / 64 * 64);
    const uint32_t n = make_pairs(pairs, n_cells, clustered);
    for (size_t i = 0; i < bytes; i++) {
        a[i] = b[i] = (uint8_t)rnd(256);
    }
    kvc_fail_alloc_after = fail_at;
    kvc_cols cols;
    kvc_cols_init(&cols, pairs, n, n_cells, el, vector);
    kvc_fail_alloc_after = 0;
    kvc_cols_apply(&cols, a + skew, stride, n_rows);
    kvc_cols_free(&cols);
    reference(b + skew, stride, n_rows, el, pairs, n);
    CHECK(memcmp(a, b, bytes) == 0, "n_cells %u el %u rows %u skew %u clustered %d pairs %u fail_at %d", n_cells, el,
          n_rows, skew, clustered, n, fail_at);
    free(pairs);
    free(a);
    free(b);
}

static void test_random_plans(void) {
    static const uint32_t cells[] = { 1, 2, 3, 31, 32, 33, 63, 64, 65, 70, 96, 100, 127, 128, 129, 1000, 4096 };
    for (size_t i = 0; i < sizeof cells / sizeof cells[0]; i++) {
        for (uint32_t el = 2; el <= 4; el += 2) {
            for (int clustered = 0; clustered < 2; clustered++) {
                for (uint32_t rep = 0; rep < 4; rep++) {
                    const uint32_t n_rows = 1 + rnd(11), skew = rep == 0 ? 0 : el * rnd(32);
                    if (cells[i] >= 2) {
                        check_plan(cells[i], el, n_rows, skew, clustered, 0);
                    }
                }
            }
        }
    }
}

static void test_allocation_failures(void) {
    /* each of the preparation's allocations failing leaves a slower, still exact, path */
    for (int fail_at = 1; fail_at <= 4; fail_at++) {
        check_plan(1000, 2, 9, 0, true, fail_at);
        check_plan(1000, 4, 5, 4, false, fail_at);
    }
}

static void test_long_rows(void) {
    /* past the prefetch distance and the four-row passes, with remainders */
    check_plan(4096, 2, 23, 0, true, 0);
    check_plan(2048, 4, 13, 8, true, 0);
    check_plan(777, 2, 30, 2, false, 0);
}

static void test_no_pairs(void) {
    uint16_t rows[3 * 100], orig[3 * 100];
    for (size_t i = 0; i < 300; i++) {
        rows[i] = orig[i] = (uint16_t)rnd(65536);
    }
    kvc_cols cols;
    kvc_cols_init(&cols, NULL, 0, 100, 2, vector);
    kvc_cols_apply(&cols, (uint8_t *)rows, 200, 3);
    kvc_cols_free(&cols);
    CHECK(memcmp(rows, orig, sizeof rows) == 0, "no pairs, no change");
}

int main(void) {
    for (int scalar = 0; scalar < 2; scalar++) {
        if (scalar) {
            setenv("KVCACHE_NO_AVX512", "1", 1);
        }
        vector = kvc_cols_vector_available();
        CHECK(!(scalar && vector), "KVCACHE_NO_AVX512 keeps the scalar path");
        test_random_plans();
        test_allocation_failures();
        test_long_rows();
        test_no_pairs();
    }
    printf("%d checks, %d failed\n", n_checks, n_failed);
    return n_failed != 0;
}
