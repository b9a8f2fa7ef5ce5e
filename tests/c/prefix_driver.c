/* A text driver of the prefix index (csrc/kvc_prefix.h) for tests/test_prefix_index_model.py,
 * which runs the same operations on tests/reference_prefix.py and compares the lines.
 *
 * Reads operations from stdin, one per line, words separated by spaces:
 *   init STREAMS CELLS CAP        a fresh index
 *   insert SALT N (TOKEN CELL STREAM) * N
 *   match SALT MAX_LEN N TOKEN * N
 *   lock|unlock|pin|unpin H       H: the number of an earlier insert's or match's handle
 *   evict N | remove N (CELL STREAM) * N | cap CAP | clear
 *   end                           prints "end" and flushes (the end of a scenario)
 * and writes one line per operation: its result, then " | held=.. evictable=.. nodes=..". Every
 * operation is followed by kvc_prefix_check; a failure adds a line "CHECK FAILED: ...". */
#include "kvc_prefix.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_HANDLES 100000

static kvc_prefix idx;
static bool have_idx;
static kvc_prefix_handle handles[MAX_HANDLES];
static uint32_t n_handles;

static unsigned long long next_num(void) {
    unsigned long long v = 0;
    if (scanf("%llu", &v) != 1) {
        fprintf(stderr, "prefix_driver: a number expected\n");
        exit(2);
    }
    return v;
}

static void *alloc_or_die(size_t n) {
    void *p = malloc(n ? n : 1);
    if (!p) {
        exit(3);
    }
    return p;
}

static void print_cells(const char *name, const uint32_t *cells, const uint32_t *streams, uint32_t n) {
    printf(" %s=[", name);
    for (uint32_t i = 0; i < n; i++) {
        printf(i ? " %u:%u" : "%u:%u", cells[i], streams[i]);
    }
    printf("]");
}

static const char *status_word(int rc) {
    switch (rc) {
    case KVC_OK: return "ok";
    case KVC_E_ARG: return "arg";
    case KVC_E_NOSPACE: return "nospace";
    case KVC_E_NOMEM: return "nomem";
    default: return "error";
    }
}

static uint32_t new_handle(kvc_prefix_handle h) {
    if (n_handles == MAX_HANDLES) {
        exit(4);
    }
    handles[n_handles] = h;
    return n_handles++;
}

int main(void) {
    char op[32];
    while (scanf("%31s", op) == 1) {
        if (strcmp(op, "end") == 0) {
            printf("end\n");
            fflush(stdout);
            continue;
        }
        if (strcmp(op, "init") == 0) {
            if (have_idx) {
                kvc_prefix_free(&idx);
            }
            const uint32_t s = (uint32_t)next_num(), c = (uint32_t)next_num(), cap = (uint32_t)next_num();
            kvc_err err = { 0, "" };
            const int rc = kvc_prefix_init(&idx, s, c, cap, &err);
            have_idx = rc == KVC_OK;
            n_handles = 0;
            printf("%s", status_word(rc));
        } else if (!have_idx) {
            fprintf(stderr, "prefix_driver: %s before init\n", op);
            return 2;
        } else if (strcmp(op, "insert") == 0) {
            const uint64_t salt = next_num();
            const uint32_t n = (uint32_t)next_num();
            int32_t *tok = alloc_or_die((size_t)n * 4);
            uint32_t *cell = alloc_or_die((size_t)n * 4), *strm = alloc_or_die((size_t)n * 4);
            uint32_t *dc = alloc_or_die((size_t)n * 4), *ds = alloc_or_die((size_t)n * 4);
            for (uint32_t i = 0; i < n; i++) {
                tok[i] = (int32_t)next_num();
                cell[i] = (uint32_t)next_num();
                strm[i] = (uint32_t)next_num();
            }
            kvc_prefix_inserted res;
            kvc_err err = { 0, "" };
            const int rc = kvc_prefix_insert(&idx, salt, tok, cell, strm, n, dc, ds, &res, &err);
            if (rc == KVC_OK) {
                const uint32_t *fc, *fs;
                const uint32_t nf = kvc_prefix_freed(&idx, &fc, &fs);
                printf("ok present=%u", res.n_present);
                print_cells("dup", dc, ds, res.n_dup);
                print_cells("evicted", fc, fs, res.n_evicted ? nf : 0);
                printf(" h=%u", new_handle(res.end));
            } else {
                printf("%s", status_word(rc));
            }
            free(tok), free(cell), free(strm), free(dc), free(ds);
        } else if (strcmp(op, "match") == 0) {
            const uint64_t salt = next_num();
            const uint32_t max_len = (uint32_t)next_num(), n = (uint32_t)next_num();
            int32_t *tok = alloc_or_die((size_t)n * 4);
            uint32_t *cell = alloc_or_die((size_t)n * 4), *strm = alloc_or_die((size_t)n * 4);
            for (uint32_t i = 0; i < n; i++) {
                tok[i] = (int32_t)next_num();
            }
            kvc_prefix_handle h;
            const uint32_t m = kvc_prefix_match(&idx, salt, tok, n, max_len, cell, strm, &h);
            printf("%u", m);
            print_cells("cells", cell, strm, m);
            printf(" h=%u", new_handle(h));
            free(tok), free(cell), free(strm);
        } else if (strcmp(op, "lock") == 0 || strcmp(op, "unlock") == 0 || strcmp(op, "pin") == 0 ||
                   strcmp(op, "unpin") == 0) {
            const unsigned long long k = next_num();
            if (k >= n_handles) {
                fprintf(stderr, "prefix_driver: no handle %llu\n", k);
                return 2;
            }
            int (*fn)(kvc_prefix *, kvc_prefix_handle, kvc_err *) =
                op[0] == 'l' ? kvc_prefix_lock : op[0] == 'p' ? kvc_prefix_pin : op[2] == 'l' ? kvc_prefix_unlock
                                                                                          : kvc_prefix_unpin;
            printf("%s", status_word(fn(&idx, handles[k], NULL)));
        } else if (strcmp(op, "evict") == 0) {
            kvc_prefix_evict(&idx, (uint32_t)next_num());
            const uint32_t *fc, *fs;
            const uint32_t nf = kvc_prefix_freed(&idx, &fc, &fs);
            printf("evicted");
            print_cells("freed", fc, fs, nf);
        } else if (strcmp(op, "remove") == 0) {
            const uint32_t n = (uint32_t)next_num();
            uint32_t *cell = alloc_or_die((size_t)n * 4), *strm = alloc_or_die((size_t)n * 4);
            for (uint32_t i = 0; i < n; i++) {
                cell[i] = (uint32_t)next_num();
                strm[i] = (uint32_t)next_num();
            }
            kvc_prefix_remove_cells(&idx, cell, strm, n);
            const uint32_t *fc, *fs;
            const uint32_t nf = kvc_prefix_freed(&idx, &fc, &fs);
            printf("removed");
            print_cells("freed", fc, fs, nf);
            free(cell), free(strm);
        } else if (strcmp(op, "cap") == 0) {
            kvc_prefix_set_cap(&idx, (uint32_t)next_num());
            printf("ok");
        } else if (strcmp(op, "clear") == 0) {
            kvc_prefix_clear(&idx);
            printf("ok");
        } else {
            fprintf(stderr, "prefix_driver: unknown operation %s\n", op);
            return 2;
        }
        if (have_idx) {
            printf(" | held=%u evictable=%u nodes=%u\n", kvc_prefix_n_held(&idx), kvc_prefix_n_evictable(&idx),
                   kvc_prefix_n_nodes(&idx));
            kvc_err err = { 0, "" };
            if (kvc_prefix_check(&idx, &err) != KVC_OK) {
                printf("CHECK FAILED: %s\n", err.msg);
            }
        } else {
            printf("\n");
        }
    }
    if (have_idx) {
        kvc_prefix_free(&idx);
    }
    return 0;
}
