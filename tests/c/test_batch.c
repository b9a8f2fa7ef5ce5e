/* Tests of the batch splitter (csrc/kvc_batch.c) against a naive model written from llama.cpp's
 * rules: tokens ordered by more sequence ids first, then the id lists, then position; runs of
 * equal id lists form groups ordered by fewer ids first, then longer first; split_equal takes
 * equal slices from the last groups (a shared group alone, as many as fit), split_seq a slice
 * of the last group, split_simple a prefix of the batch. The random batches are made so that no
 * two tokens and no two groups compare equal: the order is then the same for every correct sort,
 * and the model can use qsort. Outputs (flags, out_ids) follow the tokens; ids up to 255. */
#include "kvc_batch.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"

#define MAXT 400

typedef struct batch {
    uint32_t n;
    int32_t pos[MAXT];
    uint32_t off[MAXT + 1];
    int32_t ids[4 * MAXT];
    int8_t logits[MAXT];
} batch;

static const batch *cmp_batch;

static int cmp_lists(uint32_t a, uint32_t b) {
    const batch *B = cmp_batch;
    const uint32_t na = B->off[a + 1] - B->off[a], nb = B->off[b + 1] - B->off[b];
    if (na != nb) {
        return na > nb ? -1 : 1;
    }
    for (uint32_t k = 0; k < na; k++) {
        const int32_t x = B->ids[B->off[a] + k], y = B->ids[B->off[b] + k];
        if (x != y) {
            return x < y ? -1 : 1;
        }
    }
    return 0;
}

static int cmp_tokens(const void *pa, const void *pb) {
    const uint32_t a = *(const uint32_t *)pa, b = *(const uint32_t *)pb;
    const int c = cmp_lists(a, b);
    if (c) {
        return c;
    }
    return (cmp_batch->pos[a] > cmp_batch->pos[b]) - (cmp_batch->pos[a] < cmp_batch->pos[b]);
}

typedef struct mgroup {
    uint32_t n_ids, first, length, taken;   /* first: index into the token order */
} mgroup;

static int cmp_groups(const void *pa, const void *pb) {
    const mgroup *a = pa, *b = pb;
    if (a->n_ids != b->n_ids) {
        return a->n_ids < b->n_ids ? -1 : 1;
    }
    return (a->length < b->length) - (a->length > b->length);
}

/* A batch of distinct-comparing tokens and groups: k id lists (some shared), list j's tokens at
 * distinct positions, and the lists' token counts distinct among lists of as many ids. */
static void make_batch(batch *b) {
    static const int32_t pool[] = { 0, 1, 5, 63, 64, 100, 200, 254, 255 };
    const uint32_t k = 1 + check_rand(7);
    int32_t lists[8][3];
    uint32_t len[8], nids[8];
    uint32_t used_len[4][64] = { { 0 } };
    for (uint32_t j = 0; j < k; j++) {
        /* a fresh id list: 1 to 3 distinct ids, distinct from the lists before */
        for (bool fresh = false; !fresh;) {
            nids[j] = 1 + (check_rand(3) == 0 ? 1 + check_rand(2) : 0);
            for (uint32_t i = 0; i < nids[j]; i++) {
                bool dup;
                do {
                    lists[j][i] = pool[check_rand(9)];
                    dup = false;
                    for (uint32_t q = 0; q < i; q++) {
                        dup = dup || lists[j][q] == lists[j][i];
                    }
                } while (dup);
            }
            fresh = true;
            for (uint32_t q = 0; q < j && fresh; q++) {
                fresh = nids[q] != nids[j] || memcmp(lists[q], lists[j], nids[j] * sizeof(int32_t)) != 0;
            }
        }
        do {
            len[j] = 1 + check_rand(60);
        } while (used_len[nids[j]][len[j]]);
        used_len[nids[j]][len[j]] = 1;
    }
    /* the tokens, interleaved in a random order */
    uint32_t left[8], n = 0;
    memcpy(left, len, sizeof len);
    b->off[0] = 0;
    for (;;) {
        uint32_t total = 0;
        for (uint32_t j = 0; j < k; j++) {
            total += left[j];
        }
        if (total == 0 || n == MAXT) {
            break;
        }
        uint32_t j = check_rand(k);
        while (!left[j]) {
            j = (j + 1) % k;
        }
        b->pos[n] = (int32_t)(len[j] - left[j]) * 3 + (int32_t)check_rand(3);   /* increasing per list */
        memcpy(b->ids + b->off[n], lists[j], nids[j] * sizeof(int32_t));
        b->off[n + 1] = b->off[n] + nids[j];
        b->logits[n] = (int8_t)(check_rand(3) == 0);
        left[j]--;
        n++;
    }
    b->n = n;
}

static int8_t want_output(const batch *b, uint32_t t, int logits_mode) {
    return logits_mode == 2 ? 1 : logits_mode == 1 ? b->logits[t] : (int8_t)(t == b->n - 1);
}

static void run_sorted(const batch *b, enum kvc_split_mode mode, int logits_mode) {
    kvc_sbatch sb;
    kvc_err err = { 0, "" };
    REQUIRE(kvc_sbatch_init(&sb, b->n, b->pos, b->off, b->ids, logits_mode == 1 ? b->logits : NULL,
                            logits_mode == 2, false, &err) == KVC_OK, "init: %s", err.msg);
    /* the model's order and groups */
    static uint32_t order[MAXT];
    static mgroup groups[MAXT];
    for (uint32_t t = 0; t < b->n; t++) {
        order[t] = t;
    }
    cmp_batch = b;
    qsort(order, b->n, sizeof *order, cmp_tokens);
    uint32_t n_groups = 0;
    for (uint32_t i = 0; i < b->n; i++) {
        if (i == 0 || cmp_lists(order[i - 1], order[i]) != 0) {
            groups[n_groups++] = (mgroup){ b->off[order[i] + 1] - b->off[order[i]], i, 0, 0 };
        }
        groups[n_groups - 1].length++;
    }
    qsort(groups, n_groups, sizeof *groups, cmp_groups);
    CHECK(memcmp(sb.order, order, b->n * sizeof *order) == 0, "token order");
    CHECK(sb.n_groups == n_groups, "%u groups, the model %u", sb.n_groups, n_groups);
    static uint32_t out_ids[MAXT];
    uint32_t n_out = 0, placed = 0;
    for (int round = 0; round < MAXT; round++) {
        const uint32_t n_ubatch = 1 + check_rand(round % 3 ? 16 : 120);
        kvc_sbatch_ubatch u;
        const int r = kvc_sbatch_split(&sb, mode, n_ubatch, &u, &err);
        while (n_groups > 0 && groups[n_groups - 1].taken == groups[n_groups - 1].length) {
            n_groups--;
        }
        if (n_groups == 0) {
            CHECK(r == 0 && u.ub.n_tokens == 0, "exhausted");
            break;
        }
        REQUIRE(r == 1, "split: %d %s", r, err.msg);
        /* which groups the model takes, and how many tokens of each */
        uint32_t take[MAXT], n_take = 0, length;
        const mgroup *last = &groups[n_groups - 1];
        length = last->length - last->taken;
        length = length < n_ubatch ? length : n_ubatch;
        if (mode == KVC_SPLIT_SEQ) {
            take[n_take++] = n_groups - 1;
        } else {
            uint32_t total = 0;
            for (uint32_t g = n_groups; g-- > 0;) {
                take[n_take++] = g;
                total += length;
                if (groups[g].n_ids > 1 || length + total > n_ubatch) {
                    break;
                }
            }
        }
        CHECK(u.ub.n_seqs == (mode == KVC_SPLIT_SEQ ? 1 : n_take) && u.ub.n_seq_tokens == length &&
                  u.ub.n_tokens == length * u.ub.n_seqs && u.equal_seqs,
              "round %d: shape %u x %u, the model %u x %u", round, u.ub.n_seqs, u.ub.n_seq_tokens, n_take, length);
        if (u.ub.n_seqs != n_take) {
            break;
        }
        for (uint32_t q = 0; q < n_take; q++) {
            mgroup *g = &groups[take[q]];
            const uint32_t first = order[g->first];
            const uint32_t nid = b->off[first + 1] - b->off[first];
            CHECK(u.ub.seq_off[q + 1] - u.ub.seq_off[q] == nid &&
                      memcmp(u.ub.seq_ids + u.ub.seq_off[q], b->ids + b->off[first], nid * sizeof(int32_t)) == 0,
                  "round %d group %u: its id list", round, q);
            for (uint32_t j = 0; j < length; j++) {
                const uint32_t t = order[g->first + g->taken + j], k = q * length + j;
                CHECK(u.token[k] == t && u.ub.pos[k] == b->pos[t] && u.output[k] == want_output(b, t, logits_mode),
                      "round %d: token %u of group %u", round, j, q);
                if (want_output(b, t, logits_mode)) {
                    out_ids[n_out++] = t;
                }
            }
            g->taken += length;
            placed += length;
        }
        CHECK(kvc_ubatch_check(&u.ub, KVC_MAX_SEQ, &err) == KVC_OK, "a well-formed ubatch: %s", err.msg);
    }
    CHECK(placed == b->n && sb.n_left == 0, "every token placed once (%u of %u)", placed, b->n);
    CHECK(sb.n_out == n_out && memcmp(sb.out_ids, out_ids, n_out * sizeof *out_ids) == 0, "out_ids");
    kvc_sbatch_free(&sb);
}

static void run_simple(const batch *b, int logits_mode) {
    kvc_sbatch sb;
    kvc_err err = { 0, "" };
    REQUIRE(kvc_sbatch_init(&sb, b->n, b->pos, b->off, b->ids, logits_mode == 1 ? b->logits : NULL,
                            logits_mode == 2, true, &err) == KVC_OK, "init: %s", err.msg);
    kvc_sbatch_ubatch u;
    CHECK(kvc_sbatch_split(&sb, KVC_SPLIT_EQUAL, 4, &u, &err) == KVC_E_ARG, "equal on a simple splitter");
    uint32_t next = 0;
    for (;;) {
        const uint32_t n_ubatch = 1 + check_rand(50);
        const int r = kvc_sbatch_split(&sb, KVC_SPLIT_SIMPLE, n_ubatch, &u, &err);
        if (next == b->n) {
            CHECK(r == 0, "exhausted");
            break;
        }
        const uint32_t n = b->n - next < n_ubatch ? b->n - next : n_ubatch;
        REQUIRE(r == 1 && u.ub.n_tokens == n && u.ub.n_seqs == n && u.ub.n_seq_tokens == 1 && !u.equal_seqs,
                "a prefix of %u tokens", n);
        for (uint32_t k = 0; k < n; k++) {
            const uint32_t t = next + k, nid = b->off[t + 1] - b->off[t];
            CHECK(u.token[k] == t && u.ub.pos[k] == b->pos[t] && u.output[k] == want_output(b, t, logits_mode) &&
                      u.ub.seq_off[k + 1] - u.ub.seq_off[k] == nid &&
                      memcmp(u.ub.seq_ids + u.ub.seq_off[k], b->ids + b->off[t], nid * sizeof(int32_t)) == 0,
                  "token %u", t);
        }
        next += n;
    }
    kvc_sbatch_free(&sb);
}

static void test_rejections(void) {
    kvc_sbatch sb;
    kvc_err err = { 0, "" };
    const int32_t pos[2] = { 0, 1 }, bad[2] = { 0, KVC_MAX_SEQ }, neg[2] = { 0, -1 };
    const uint32_t off[3] = { 0, 1, 2 }, empty[3] = { 0, 1, 1 };
    CHECK(kvc_sbatch_init(&sb, 2, pos, off, bad, NULL, false, false, &err) == KVC_E_ARG && strstr(err.msg, "256"),
          "an id past the bound: %s", err.msg);
    CHECK(kvc_sbatch_init(&sb, 2, neg, off, pos, NULL, false, false, &err) == KVC_E_ARG, "a negative position");
    CHECK(kvc_sbatch_init(&sb, 2, pos, empty, pos, NULL, false, false, &err) == KVC_E_ARG, "a token without ids");
    const int32_t top[2] = { 255, 254 };
    REQUIRE(kvc_sbatch_init(&sb, 2, pos, off, top, NULL, false, false, &err) == KVC_OK, "ids 255, 254");
    kvc_sbatch_ubatch u;
    CHECK(kvc_sbatch_split(&sb, KVC_SPLIT_SEQ, 0, &u, &err) == KVC_E_ARG, "n_ubatch 0");
    CHECK(kvc_sbatch_split(&sb, KVC_SPLIT_SIMPLE, 4, &u, &err) == KVC_E_ARG, "simple on a sorted splitter");
    CHECK(kvc_sbatch_split(&sb, KVC_SPLIT_EQUAL, 4, &u, &err) == 1 && u.ub.n_seqs == 2 &&
              u.ub.seq_ids[0] == 255 && u.ub.seq_ids[1] == 254,
          "both groups, taken from the last one: 255, then 254");
    kvc_sbatch_free(&sb);
}

int main(void) {
    static batch b;
    for (int i = 0; i < 300; i++) {
        make_batch(&b);
        run_sorted(&b, i % 2 ? KVC_SPLIT_EQUAL : KVC_SPLIT_SEQ, i % 3);
        run_simple(&b, i % 3);
    }
    test_rejections();
    printf("test_batch: %d checks, %d failed\n", n_checks, n_failed);
    return n_failed != 0;
}
