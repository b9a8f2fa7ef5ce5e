/* Tests of the attention indices (csrc/kvc_attn.c) against the KQ mask (csrc/kvc_mask.c), which
 * defines them: for random caches of both semantics (one stream and a stream per sequence; no
 * window, a standard and a chunked one; 2-D positions) driven by placements, seq_rm holes,
 * seq_cp shares and seq_add shifts, each token's cells as the groups' rule gives them (causal:
 * the first L - q + i + 1 rows of its group; else all) are exactly the cells its mask row shows;
 * rows are ordered by position, the positions are the cells', a causal call has only causal
 * groups of several tokens and a non-causal one none; the counts come back when the arrays are
 * too small (nothing written past them); a ubatch that is not the placement is refused. */
#include "kvc_attn.h"
#include "kvc_mask.h"
#include "kvc_slot.h"
#include "kvc_unified.h"
#include "kvc_types.h"
#include "kvc_unified_ops.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"

#define SIZE 256
#define N_SEQ 4
#define MAX_TOK 24

/* what the cases exercised: causal groups of several tokens, non-causal ones, single tokens */
static unsigned n_causal_groups, n_full_groups, n_single, n_placed;

typedef struct ubuf {
    int32_t pos[MAX_TOK], x[MAX_TOK], y[MAX_TOK];
    uint32_t off[MAX_TOK + 1];
    int32_t ids[2 * MAX_TOK];
    kvc_ubatch ub;
} ubuf;

typedef struct config {
    int32_t semantics;
    bool per_seq, ext;
    int32_t swa_type;
    uint32_t n_swa;
} config;

static int make(kvc_unified *c, const config *cf) {
    const int32_t il[1] = { 0 };
    const uint32_t w[1] = { 4 };
    const kvc_unified_params p = {
        .kv_size = SIZE, .semantics = cf->semantics, .stream_per_seq = cf->per_seq, .n_seq_max = N_SEQ,
        .n_pad = 1, .n_swa = cf->n_swa, .swa_type = cf->swa_type, .type_k = KVC_TYPE_F16, .type_v = KVC_TYPE_F16,
        .n_layer = 1, .layer_il = il, .n_embd_k = w, .n_embd_v = w, .cell_ext = cf->ext,
    };
    return kvc_unified_init(c, &p, NULL);
}

static int32_t next_pos(const kvc_unified *c, int32_t s) {
    return kvc_unified_seq_pos_max(c, s) + 1;
}

/* A random ubatch: runs of tokens of random sequences (with a stream per sequence: m sequences
 * of k tokens each, one id per token), positions following each sequence's last, now and then
 * out of order, repeated (with 2-D positions) or with a second id. */
static const kvc_ubatch *random_ubatch(ubuf *b, const kvc_unified *c, const config *cf) {
    int32_t next[N_SEQ];
    for (int32_t s = 0; s < N_SEQ; s++) {
        next[s] = next_pos(c, s) + (int32_t)(check_rand(8) == 0 ? check_rand(4) : 0);
    }
    uint32_t n = 0, k = 0;
    const bool decode = check_rand(3) == 0;
    const uint32_t per = cf->per_seq ? (decode ? 1 : 1 + check_rand(5)) : 0;
    bool used[N_SEQ] = { false };
    while (n < (decode ? N_SEQ : 3 + check_rand(MAX_TOK - 6))) {
        const int32_t s = (int32_t)check_rand(N_SEQ);
        if (cf->per_seq && used[s]) {
            if (check_rand(3) == 0) {
                break;
            }
            continue;
        }
        used[s] = true;
        const uint32_t run = per ? per : (decode ? 1 : 1 + check_rand(6));
        for (uint32_t i = 0; i < run && n < MAX_TOK; i++) {
            b->off[n] = k;
            b->ids[k++] = s;
            if (!cf->per_seq && check_rand(8) == 0) {
                b->ids[k++] = (s + 1) % N_SEQ;
            }
            b->x[n] = (int32_t)check_rand(3);
            b->y[n] = (int32_t)check_rand(2);
            /* 2-D: an image's tokens share a position */
            const bool repeat = cf->ext && i > 0 && check_rand(2) == 0;
            b->pos[n] = repeat ? b->pos[n - 1] : next[s]++;
            if (check_rand(16) == 0 && n > 0 && b->ids[b->off[n - 1]] == s && b->pos[n - 1] > 0) {
                /* out of order */
                const int32_t p = b->pos[n];
                b->pos[n] = b->pos[n - 1];
                b->pos[n - 1] = p;
            }
            n++;
        }
        if (cf->per_seq && n + per > MAX_TOK) {
            break;
        }
    }
    b->off[n] = k;
    b->ub = (kvc_ubatch){ .n_tokens = n, .n_seq_tokens = 1, .n_seqs = n, .pos = b->pos, .seq_off = b->off,
                          .seq_ids = b->ids, .pos_x = cf->ext ? b->x : NULL, .pos_y = cf->ext ? b->y : NULL };
    return &b->ub;
}

static int place(kvc_unified *c, const kvc_ubatch *ub) {
    if (c->ops->semantics == KVC_SEM_2026) {
        kvc_err err;
        return kvc_unified_find_slot_2026(c, ub, &err);
    }
    const int r = kvc_unified_find_slot(c, ub);
    if (r == 1) {
        kvc_unified_commit(c);
    }
    return r;
}

/* The indices of ub against its mask, both ways round. */
static void compare(const kvc_unified *c, const kvc_ubatch *ub, bool causal) {
    kvc_attn a = { 0 };
    kvc_err err;
    REQUIRE(kvc_unified_attn_indices(c, ub, causal, &a, &err) == KVC_E_NOSPACE, "the sizes");
    const uint32_t G = a.n_groups, nnz = a.nnz, n_kv = a.n_kv, n = ub->n_tokens;
    int32_t *qo = malloc((G + 1) * sizeof *qo), *kv = malloc((G + 1) * sizeof *kv);
    int32_t *idx = malloc((nnz + 1) * sizeof *idx), *kp = malloc((nnz + 1) * sizeof *kp);
    int32_t *st = malloc((G + 1) * sizeof *st), *qp = malloc((n + 1) * sizeof *qp);
    uint8_t *fl = malloc(G + 1);
    uint8_t *mask = malloc((size_t)n * n_kv + 1), *seen = malloc((size_t)n_kv + 1);
    REQUIRE(qo && kv && idx && kp && st && qp && fl && mask && seen, "memory");
    /* too small by one index: nothing past the arrays, the same counts */
    if (nnz > 0) {
        kvc_attn small = { .qo_indptr = qo, .kv_indptr = kv, .kv_indices = idx, .kv_pos = kp, .causal = fl,
                           .stream = st, .cap_groups = G, .cap_nnz = nnz - 1 };
        CHECK(kvc_unified_attn_indices(c, ub, causal, &small, &err) == KVC_E_NOSPACE, "too small");
        CHECK(small.n_groups == G && small.nnz == nnz, "counts when too small");
    }
    if (n > 0) {
        /* room for every group and index but one query position short: no room, q_pos untouched */
        qp[n - 1] = -7;
        kvc_attn short_q = { .qo_indptr = qo, .kv_indptr = kv, .kv_indices = idx, .causal = fl, .q_pos = qp,
                             .cap_groups = G, .cap_nnz = nnz, .cap_tokens = n - 1 };
        CHECK(kvc_unified_attn_indices(c, ub, causal, &short_q, &err) == KVC_E_NOSPACE, "q_pos too small");
        CHECK(qp[n - 1] == -7, "q_pos written when too small");
    }
    a = (kvc_attn){ .qo_indptr = qo, .kv_indptr = kv, .kv_indices = idx, .kv_pos = kp, .causal = fl, .stream = st,
                    .q_pos = qp, .cap_groups = G, .cap_nnz = nnz, .cap_tokens = n };
    REQUIRE(kvc_unified_attn_indices(c, ub, causal, &a, &err) == KVC_OK, "the indices: %s", err.msg);
    REQUIRE(a.n_groups == G && a.nnz == nnz, "the same counts");
    int rc = c->ops->semantics == KVC_SEM_2026 ? kvc_unified_kq_mask_2026(c, ub, causal, false, KVC_MASK_BOOL, mask, &err)
                                          : kvc_unified_kq_mask(c, ub, causal, false, KVC_MASK_BOOL, false, 0, mask);
    REQUIRE(rc == KVC_OK, "the mask");
    CHECK(qo[0] == 0 && qo[G] == (int32_t)n && kv[0] == 0 && kv[G] == (int32_t)nnz, "the bounds");
    for (uint32_t t = 0; t < n; t++) {
        CHECK(qp[t] == ub->pos[t], "token %u's position", t);
    }
    for (uint32_t g = 0; g < G; g++) {
        const int32_t q = qo[g + 1] - qo[g], L = kv[g + 1] - kv[g];
        REQUIRE(q >= 1 && L >= 0, "group %u: %d tokens, %d rows", g, q, L);
        CHECK(fl[g] == (causal && q > 1), "group %u: flag %d with %d tokens, causal %d", g, fl[g], q, causal);
        n_causal_groups += fl[g];
        n_full_groups += !fl[g] && q > 1;
        n_single += q == 1;
        const kvc_cells *cells = kvc_unified_stream_cells_c(c, (uint32_t)st[g]);
        for (int32_t j = kv[g]; j < kv[g + 1]; j++) {
            const int32_t cell = idx[j] - st[g] * SIZE;
            REQUIRE(cell >= 0 && (uint32_t)cell < n_kv, "row %d of stream %d", idx[j], st[g]);
            CHECK(kp[j] == cells->pos[cell], "the position of cell %d", cell);
            CHECK(j == kv[g] || kp[j - 1] < kp[j] || (kp[j - 1] == kp[j] && idx[j - 1] < idx[j]), "the order");
        }
        for (int32_t i = 0; i < q; i++) {
            const uint32_t t = (uint32_t)(qo[g] + i);
            CHECK(kvc_unified_slot_stream(c, t) == (uint32_t)st[g], "token %u's stream", t);
            memset(seen, 0, n_kv);
            const int32_t upto = fl[g] ? L - q + i + 1 : L;
            for (int32_t j = 0; j < upto; j++) {
                seen[idx[kv[g] + j] - st[g] * SIZE] = 1;
            }
            for (uint32_t col = 0; col < n_kv; col++) {
                CHECK(seen[col] == mask[(size_t)t * n_kv + col], "token %u cell %u: indices %d, mask %d (causal %d)",
                      t, col, seen[col], mask[(size_t)t * n_kv + col], causal);
            }
        }
    }
    free(qo);
    free(kv);
    free(idx);
    free(kp);
    free(st);
    free(qp);
    free(fl);
    free(mask);
    free(seen);
}

static void random_op(kvc_unified *c, const config *cf) {
    const int32_t s = (int32_t)check_rand(N_SEQ), d = (int32_t)check_rand(N_SEQ);
    const int32_t pmax = kvc_unified_seq_pos_max(c, s);
    const int32_t p0 = pmax > 0 ? (int32_t)check_rand((uint32_t)pmax + 1) : 0;
    switch (check_rand(6)) {
    case 0:
        kvc_unified_seq_rm(c, s, p0, p0 + 1 + (int32_t)check_rand(4));
        break;
    case 1:
        if (!cf->per_seq && s != d) {
            kvc_unified_seq_rm(c, d, -1, -1);
            kvc_unified_seq_cp(c, s, d, 0, p0);
        }
        break;
    case 2:
        kvc_unified_seq_add(c, s, p0, -1, (int32_t)check_rand(7) - 3);
        break;
    case 3:
        if (check_rand(4) == 0) {
            kvc_unified_seq_rm(c, s, -1, -1);
        }
        break;
    default:
        break;
    }
}

static void test_against_the_mask(const config *cf, unsigned steps) {
    kvc_unified c;
    REQUIRE(make(&c, cf) == KVC_OK, "init");
    ubuf b;
    for (unsigned k = 0; k < steps; k++) {
        random_op(&c, cf);
        const kvc_ubatch *ub = random_ubatch(&b, &c, cf);
        if (place(&c, ub) != 1) {
            kvc_unified_clear(&c);
            continue;
        }
        n_placed++;
        compare(&c, ub, true);
        compare(&c, ub, false);
    }
    kvc_unified_free(&c);
}

static void test_refuses_what_is_not_placed(void) {
    const config cf = { KVC_SEM_2025, false, false, KVC_SWA_NONE, 0 };
    kvc_unified c;
    REQUIRE(make(&c, &cf) == KVC_OK, "init");
    ubuf b;
    const kvc_ubatch *ub = random_ubatch(&b, &c, &cf);
    kvc_attn a = { 0 };
    kvc_err err;
    CHECK(kvc_unified_attn_indices(&c, ub, true, &a, &err) == KVC_E_ARG, "nothing placed");
    REQUIRE(place(&c, ub) == 1, "placed");
    CHECK(kvc_unified_attn_indices(&c, ub, true, &a, &err) == KVC_E_NOSPACE, "placed: the sizes");
    b.pos[0] += 1000;
    CHECK(kvc_unified_attn_indices(&c, ub, true, &a, &err) == KVC_E_ARG, "another position");
    b.pos[0] -= 1000;
    kvc_unified_seq_rm(&c, 0, 1000, -1);
    CHECK(kvc_unified_attn_indices(&c, ub, true, &a, &err) == KVC_E_ARG, "forgotten by a sequence operation");
    kvc_unified_free(&c);
}

int main(void) {
    static const config configs[] = {
        { KVC_SEM_2025, false, false, KVC_SWA_NONE, 0 },
        { KVC_SEM_2025, false, false, KVC_SWA_STANDARD, 5 },
        { KVC_SEM_2025, false, false, KVC_SWA_CHUNKED, 4 },
        { KVC_SEM_2026, false, false, KVC_SWA_NONE, 0 },
        { KVC_SEM_2026, true, false, KVC_SWA_NONE, 0 },
        { KVC_SEM_2026, true, false, KVC_SWA_STANDARD, 6 },
        { KVC_SEM_2026, false, true, KVC_SWA_NONE, 0 },
        { KVC_SEM_2026, true, true, KVC_SWA_CHUNKED, 5 },
    };
    for (size_t i = 0; i < sizeof configs / sizeof configs[0]; i++) {
        test_against_the_mask(&configs[i], 300);
    }
    test_refuses_what_is_not_placed();
    CHECK(n_causal_groups > 1000 && n_full_groups > 1000 && n_single > 1000, "cases: %u causal groups, %u "
          "non-causal groups, %u single tokens (%u placed)", n_causal_groups, n_full_groups, n_single, n_placed);
    printf("test_attn: %d checks, %d failed\n", n_checks, n_failed);
    return n_failed != 0;
}
