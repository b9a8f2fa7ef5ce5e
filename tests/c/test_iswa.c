/* Tests of what the iSWA cache adds in C: multi-part state reads that change no cache unless
 * every part succeeds (csrc/kvc_state.c), and the rules of the pair (csrc/kvc_iswa.c): the SWA
 * cache's size, the pending pruning ranges, find_slot in both caches, commit-and-prune and the
 * sequence operations. */
#include "kvc_iswa.h"
#include "kvc_state.h"
#include "kvc_types.h"
#include "kvc_unified_ops.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"

/* --- a pair of caches with their own memory: base (layers 1, 3) and SWA (layers 0, 2) ----- */

typedef struct bytes {
    uint8_t *p;
    size_t n;
} bytes;

static void bytes_put(bytes *b, const void *src, size_t n) {
    uint8_t *p = realloc(b->p, b->n + n + 1);
    if (!p) {
        abort();
    }
    b->p = p;
    memcpy(b->p + b->n, src, n);
    b->n += n;
}

static void bytes_free(bytes *b) {
    free(b->p);
    b->p = NULL;
    b->n = 0;
}

typedef struct pair {
    kvc_unified c[2];
    uint8_t *k[2][2], *v[2][2];
} pair;

static bool cache_init(kvc_unified *c, uint32_t size, uint32_t n_swa, const int32_t il[2], uint8_t *k[2],
                       uint8_t *v[2]) {
    const uint32_t ek[2] = { 4, 2 }, ev[2] = { 2, 6 };
    const kvc_unified_params p = {
        .kv_size = size, .n_seq_max = 3, .n_pad = 32, .n_swa = n_swa,
        .swa_type = n_swa ? KVC_SWA_STANDARD : KVC_SWA_NONE, .type_k = KVC_TYPE_F16, .type_v = KVC_TYPE_F32,
        .v_trans = true, .n_layer = 2, .layer_il = il, .n_embd_k = ek, .n_embd_v = ev,
    };
    kvc_err err = { 0, "" };
    if (kvc_unified_init(c, &p, &err) != KVC_OK) {
        fprintf(stderr, "kvc_unified_init: %s\n", err.msg);
        return false;
    }
    for (uint32_t l = 0; l < 2; l++) {
        k[l] = calloc(size, c->layers[l].k_row_bytes);
        v[l] = calloc(size, c->layers[l].v_row_bytes);
        if (!k[l] || !v[l]) {
            abort();
        }
        kvc_unified_set_layer_buffers(c, l, k[l], v[l]);
    }
    return true;
}

static bool pair_init(pair *t) {
    static const int32_t il_base[2] = { 1, 3 }, il_swa[2] = { 0, 2 };
    memset(t, 0, sizeof *t);
    return cache_init(&t->c[0], 64, 0, il_base, t->k[0], t->v[0]) &&
           cache_init(&t->c[1], 32, 4, il_swa, t->k[1], t->v[1]);
}

static void pair_free(pair *t) {
    for (int i = 0; i < 2; i++) {
        kvc_unified_free(&t->c[i]);
        for (int l = 0; l < 2; l++) {
            free(t->k[i][l]);
            free(t->v[i][l]);
        }
    }
}

/* Place n tokens in both caches (find_slot, data, and commit unless told not to). */
static bool pair_place(pair *t, const int32_t *pos, int32_t seq, uint32_t n, bool commit, uint8_t fill) {
    uint32_t off[65];
    int32_t ids[64];
    for (uint32_t i = 0; i < n; i++) {
        off[i] = i;
        ids[i] = seq;
    }
    off[n] = n;
    const kvc_ubatch ub = { n, 1, n, pos, off, ids, NULL, NULL, NULL };
    for (int i = 0; i < 2; i++) {
        kvc_unified *c = &t->c[i];
        if (kvc_unified_find_slot(c, &ub) != 1) {
            return false;
        }
        for (uint32_t l = 0; l < 2; l++) {
            memset(c->layers[l].k + (size_t)c->head * c->layers[l].k_row_bytes, fill, n * c->layers[l].k_row_bytes);
            for (uint32_t e = 0; e < c->layers[l].n_embd_v; e++) {
                memset(c->layers[l].v + ((size_t)e * c->cells.size + c->head) * 4, fill + 1, (size_t)n * 4);
            }
        }
        if (commit) {
            kvc_unified_commit(c);
        }
    }
    return true;
}

/* Everything observable about both caches, as bytes. */
static void pair_dump(const pair *t, bytes *out) {
    out->n = 0;
    for (int i = 0; i < 2; i++) {
        const kvc_unified *c = &t->c[i];
        const uint32_t size = c->cells.size;
        bytes_put(out, &c->head, sizeof c->head);
        bytes_put(out, &c->n, sizeof c->n);
        bytes_put(out, &c->cells.used, sizeof c->cells.used);
        bytes_put(out, &c->cells.has_shift, sizeof c->cells.has_shift);
        bytes_put(out, &c->do_defrag, sizeof c->do_defrag);
        bytes_put(out, c->cells.pos, size * sizeof *c->cells.pos);
        bytes_put(out, c->cells.shift, size * sizeof *c->cells.shift);
        for (uint32_t i = 0; i < size; i++) {
            const uint64_t set = kvc_cells_seq_word(&c->cells, i, 0);
            bytes_put(out, &set, sizeof set);
        }
        for (uint32_t s = 0; s < c->n_seq_max; s++) {
            const int32_t mm[2] = { kvc_unified_seq_pos_min(c, s), kvc_unified_seq_pos_max(c, s) };
            bytes_put(out, mm, sizeof mm);
        }
        bytes_put(out, &c->undo.n_spans, sizeof c->undo.n_spans);
        bytes_put(out, c->undo.spans, c->undo.n_spans * sizeof *c->undo.spans);
        bytes_put(out, c->undo.pos, c->undo.n_cells * sizeof *c->undo.pos);
        bytes_put(out, c->undo.seq, c->undo.n_cells * sizeof *c->undo.seq);
        for (uint32_t l = 0; l < 2; l++) {
            bytes_put(out, c->layers[l].k, size * c->layers[l].k_row_bytes);
            bytes_put(out, c->layers[l].v, size * c->layers[l].v_row_bytes);
        }
    }
}

/* The state of seq_id of both caches: base part, then SWA part. */
static void pair_write(pair *t, int32_t seq_id, bytes *out, size_t *n_base) {
    out->n = 0;
    for (int i = 0; i < 2; i++) {
        const size_t n = kvc_unified_state_size(&t->c[i], seq_id);
        uint8_t *p = malloc(n ? n : 1);
        size_t written = 0;
        if (!p || kvc_unified_state_write(&t->c[i], seq_id, p, n, &written) != KVC_OK || written != n) {
            abort();
        }
        bytes_put(out, p, n);
        free(p);
        if (i == 0) {
            *n_base = n;
        }
    }
}

static int pair_read(pair *t, int32_t seq_id, const uint8_t *data, size_t len, size_t *consumed, kvc_err *err) {
    kvc_unified *const caches[2] = { &t->c[0], &t->c[1] };
    return kvc_unified_state_read_parts(caches, 2, seq_id, data, len, consumed, err);
}

/* A source pair: sequence 0 at 0..9 (its SWA cells pruned to the window), sequence 1 at 0..2. */
static bool source(pair *t) {
    int32_t pos[10];
    for (int32_t i = 0; i < 10; i++) {
        pos[i] = i;
    }
    if (!pair_init(t) || !pair_place(t, pos, 0, 10, true, 0x11) || !pair_place(t, pos, 1, 3, true, 0x22)) {
        return false;
    }
    return kvc_unified_prune_swa(&t->c[1], 0, 0, 9) == 0;
}

/* A busy target: cells of sequence 2, a shift, and an uncommitted find_slot. */
static bool target(pair *t) {
    const int32_t pos[6] = { 0, 1, 2, 3, 4, 5 }, more[2] = { 6, 7 };
    if (!pair_init(t) || !pair_place(t, pos, 2, 6, true, 0x33)) {
        return false;
    }
    kvc_unified_seq_add(&t->c[0], 2, 0, 2, 1);
    kvc_unified_seq_add(&t->c[1], 2, 0, 2, 1);
    return pair_place(t, more, 2, 2, false, 0x44);
}

/* Read bad into a fresh target and expect failure `code` with no change at all. */
static void expect_unchanged(const uint8_t *bad, size_t len, int32_t seq_id, int code, const char *what) {
    pair t;
    bytes before = { 0 }, after = { 0 };
    REQUIRE(target(&t), "target");
    pair_dump(&t, &before);
    kvc_err err = { 0, "" };
    size_t consumed = 7;
    const int rc = pair_read(&t, seq_id, bad, len, &consumed, &err);
    pair_dump(&t, &after);
    CHECK(rc == code, "%s: rc %d, expected %d (%s)", what, rc, code, err.msg);
    CHECK(consumed == 0, "%s: consumed %zu", what, consumed);
    CHECK(before.n == after.n && memcmp(before.p, after.p, before.n) == 0, "%s: a cache changed", what);
    CHECK(code != KVC_E_STATE || strstr(err.msg, "part 1 of 2") != NULL, "%s: message '%s'", what, err.msg);
    bytes_free(&before);
    bytes_free(&after);
    pair_free(&t);
}

static void test_round_trip(void) {
    pair a, b;
    REQUIRE(source(&a) && target(&b), "init");
    bytes blob = { 0 }, again = { 0 };
    size_t nb, nb2, consumed = 0;
    pair_write(&a, -1, &blob, &nb);
    kvc_err err = { 0, "" };
    bytes_put(&blob, "trailing", 8);
    CHECK(pair_read(&b, -1, blob.p, blob.n, &consumed, &err) == KVC_OK, "%s", err.msg);
    CHECK(consumed == blob.n - 8, "consumed %zu of %zu", consumed, blob.n);
    pair_write(&b, -1, &again, &nb2);
    CHECK(again.n == blob.n - 8 && memcmp(again.p, blob.p, again.n) == 0 && nb2 == nb, "same state");
    /* one sequence into another id: the SWA part holds only the window */
    pair_write(&a, 0, &blob, &nb);
    CHECK(pair_read(&b, 1, blob.p, blob.n, &consumed, &err) == KVC_OK, "%s", err.msg);
    CHECK(consumed == blob.n, "consumed");
    CHECK(kvc_unified_seq_pos_min(&b.c[0], 1) == 0 && kvc_unified_seq_pos_max(&b.c[0], 1) == 9, "base: 0..9");
    CHECK(kvc_unified_seq_pos_min(&b.c[1], 1) == 6 && kvc_unified_seq_pos_max(&b.c[1], 1) == 9, "swa: 6..9");
    CHECK(b.c[0].undo.n_spans == 0 && b.c[1].undo.n_spans == 0, "committed");
    bytes_free(&blob);
    bytes_free(&again);
    pair_free(&a);
    pair_free(&b);
}

static void test_failing_second_part(void) {
    pair a;
    REQUIRE(source(&a), "source");
    bytes blob = { 0 };
    size_t nb;
    for (int32_t seq = -1; seq <= 0; seq++) {
        pair_write(&a, seq, &blob, &nb);
        /* every truncation inside the SWA part (the base part alone is complete) */
        for (size_t len = nb; len < blob.n; len++) {
            expect_unchanged(blob.p, len, seq < 0 ? -1 : 2, KVC_E_STATE, "truncated");
        }
        /* a wrong layer count in the SWA part: its data section starts after the cell records */
        uint8_t *copy = malloc(blob.n);
        REQUIRE(copy, "malloc");
        memcpy(copy, blob.p, blob.n);
        const uint32_t cc = (uint32_t)copy[nb] | (uint32_t)copy[nb + 1] << 8;
        const size_t meta = seq < 0 ? 0 : (size_t)cc * 12;
        if (seq >= 0) {
            copy[nb + 4 + meta + 4] = 3;
            expect_unchanged(copy, blob.n, 2, KVC_E_STATE, "layer count");
        }
        /* an out-of-range position in the SWA part */
        memcpy(copy, blob.p, blob.n);
        copy[nb + 4 + 3] = 0x80;
        expect_unchanged(copy, blob.n, seq < 0 ? -1 : 2, KVC_E_STATE, "negative position");
        free(copy);
    }
    bytes_free(&blob);
    pair_free(&a);
}

static void test_no_room_in_the_second_cache(void) {
    pair a, t;
    REQUIRE(source(&a) && target(&t), "init");
    bytes blob = { 0 }, before = { 0 }, after = { 0 };
    size_t nb, consumed = 0;
    pair_write(&a, 0, &blob, &nb);                /* 10 base cells, 4 SWA cells */
    int32_t pos[22];
    for (int32_t i = 0; i < 22; i++) {
        pos[i] = 100 + i;
    }
    /* the SWA cache (32 cells) now has 32 - 8 - 22 = 2 free cells, the base cache 34 */
    REQUIRE(pair_place(&t, pos, 1, 22, true, 0x55), "fill");
    pair_dump(&t, &before);
    kvc_err err = { 0, "" };
    const int rc = pair_read(&t, 0, blob.p, blob.n, &consumed, &err);
    pair_dump(&t, &after);
    CHECK(rc == KVC_E_STATE && strstr(err.msg, "part 1 of 2") && strstr(err.msg, "no room"), "rc %d: %s", rc,
          err.msg);
    CHECK(before.n == after.n && memcmp(before.p, after.p, before.n) == 0, "a cache changed");
    bytes_free(&blob);
    bytes_free(&before);
    bytes_free(&after);
    pair_free(&a);
    pair_free(&t);
}

static void test_allocation_failures(void) {
    pair a;
    REQUIRE(source(&a), "source");
    bytes blob = { 0 };
    size_t nb;
    pair_write(&a, 0, &blob, &nb);
    bool done = false;
    for (int k = 1; k < 60 && !done; k++) {
        pair t;
        bytes before = { 0 }, after = { 0 };
        REQUIRE(target(&t), "target");
        pair_dump(&t, &before);
        kvc_err err = { 0, "" };
        size_t consumed = 0;
        kvc_fail_alloc_after = k;
        const int rc = pair_read(&t, 1, blob.p, blob.n, &consumed, &err);
        const bool hit = kvc_fail_alloc_after == 0;
        kvc_fail_alloc_after = 0;
        pair_dump(&t, &after);
        done = rc == KVC_OK;
        if (done) {
            CHECK(!hit && k > 1, "allocation %d", k);
        } else {
            CHECK(rc == KVC_E_NOMEM, "allocation %d: rc %d", k, rc);
            CHECK(before.n == after.n && memcmp(before.p, after.p, before.n) == 0, "allocation %d: a cache changed",
                  k);
        }
        bytes_free(&before);
        bytes_free(&after);
        pair_free(&t);
    }
    CHECK(done, "the read never succeeded");
    bytes_free(&blob);
    pair_free(&a);
}

static void test_bad_part_lists(void) {
    pair t;
    REQUIRE(target(&t), "target");
    kvc_err err = { 0, "" };
    size_t consumed = 0;
    const uint8_t z[4] = { 0 };
    kvc_unified *const same[2] = { &t.c[0], &t.c[0] };
    CHECK(kvc_unified_state_read_parts(same, 2, -1, z, 4, &consumed, &err) == KVC_E_ARG, "same cache twice");
    CHECK(kvc_unified_state_read_parts(same, 0, -1, z, 4, &consumed, &err) == KVC_E_ARG, "no part");
    kvc_unified *const many[9] = { &t.c[0], &t.c[1], NULL, NULL, NULL, NULL, NULL, NULL, NULL };
    CHECK(kvc_unified_state_read_parts(many, 9, -1, z, 4, &consumed, &err) == KVC_E_ARG, "too many parts");
    kvc_unified *const two[2] = { &t.c[0], &t.c[1] };
    CHECK(kvc_unified_state_read_parts(two, 2, 3, z, 4, &consumed, &err) == KVC_E_ARG, "seq_id out of range");
    pair_free(&t);
}

static void test_pending(void) {
    kvc_iswa_pending p;
    kvc_err err = { 0, "" };
    kvc_iswa_pending_clear(&p);
    const int32_t pos[5] = { 5, 3, 9, 4, 7 };
    const uint32_t off[6] = { 0, 1, 3, 4, 5, 6 };
    const int32_t ids[6] = { 1, 0, 1, 2, 1, 0 };
    CHECK(kvc_iswa_pending_set(&p, 5, pos, off, ids, 3, true, &err) == KVC_OK, "%s", err.msg);
    CHECK(p.seqs.w[0] == 7 && !p.seqs.w[1] && !p.seqs.w[2] && !p.seqs.w[3], "seqs %llx", (unsigned long long)p.seqs.w[0]);
    CHECK(p.pmin[0] == 3 && p.pmax[0] == 7, "seq 0: %d..%d", p.pmin[0], p.pmax[0]);
    CHECK(p.pmin[1] == 3 && p.pmax[1] == 5, "seq 1: %d..%d", p.pmin[1], p.pmax[1]);
    CHECK(p.pmin[2] == 9 && p.pmax[2] == 9, "seq 2: %d..%d", p.pmin[2], p.pmax[2]);
    const kvc_iswa_pending keep = p;
    CHECK(kvc_iswa_pending_set(&p, 5, pos, off, ids, 2, true, &err) == KVC_E_ARG && strstr(err.msg, "token 2"),
          "id 2 with n_seq_max 2: %s", err.msg);
    CHECK(memcmp(&p, &keep, sizeof p) == 0, "rejected batch changed the ranges");
    CHECK(kvc_iswa_pending_set(&p, 5, pos, off, ids, 3, false, &err) == KVC_OK && !kvc_seqset_any(&p.seqs, KVC_SEQ_WORDS), "not recorded");
    CHECK(kvc_iswa_pending_set(&p, 0, NULL, off, ids, 3, true, &err) == KVC_OK && !kvc_seqset_any(&p.seqs, KVC_SEQ_WORDS), "empty batch");
}


static void test_swa_size(void) {
    /* kv_size, n_swa, n_seq_max, n_ubatch, n_pad, swa_full, kv_unified, semantics -> cells */
    static const struct { kvc_iswa_sizing s; uint64_t cells; } cases[] = {
        { { 4096, 128, 1, 512, 32, false, true, KVC_SEM_2025 }, 640 },      /* pad(640, 32) */
        { { 4096, 100, 3, 16, 32, false, true, KVC_SEM_2025 }, 320 },       /* pad(316, 32) */
        { { 256, 100, 3, 16, 32, false, true, KVC_SEM_2025 }, 256 },        /* capped at kv_size */
        { { 4096, 128, 1, 512, 0, false, true, KVC_SEM_2025 }, 640 },       /* n_pad 0: none */
        { { 4096, 128, 1, 512, 32, true, true, KVC_SEM_2025 }, 4096 },      /* swa_full */
        { { 4096, 128, 4, 512, 32, false, false, KVC_SEM_2025 }, 1024 },    /* 2025: one stream always */
        { { 1024, 100, 3, 16, 1, false, true, KVC_SEM_2026 }, 512 },        /* pad(316, 256) */
        { { 1024, 100, 3, 16, 1, false, false, KVC_SEM_2026 }, 256 },       /* one window per stream */
        { { 1000, 4, 4096, 512, 1, false, true, KVC_SEM_2026 }, 1024 },     /* capped, then padded past it */
        { { 1024, 100, 3, 16, 1, true, false, KVC_SEM_2026 }, 1024 },       /* swa_full */
        /* the largest inputs: exact in 64 bits */
        { { UINT32_MAX, UINT32_MAX, UINT32_MAX, UINT32_MAX, UINT32_MAX, false, true, KVC_SEM_2025 }, UINT32_MAX },
        { { UINT32_MAX, UINT32_MAX, 2, 0, 1, false, true, KVC_SEM_2026 }, (uint64_t)UINT32_MAX + 1 },
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        const uint64_t got = kvc_iswa_swa_size(&cases[i].s);
        CHECK(got == cases[i].cells, "case %zu: %llu cells, expected %llu", i, (unsigned long long)got,
              (unsigned long long)cases[i].cells);
    }
}

static bool iswa_of(kvc_iswa *c, pair *t, bool swa_full) {
    kvc_err err = { 0, "" };
    if (kvc_iswa_init(c, &t->c[0], &t->c[1], swa_full, &err) != KVC_OK) {
        fprintf(stderr, "kvc_iswa_init: %s\n", err.msg);
        return false;
    }
    return true;
}

static void test_init(void) {
    pair t;
    kvc_iswa c;
    kvc_err err = { 0, "" };
    REQUIRE(pair_init(&t), "init");
    CHECK(kvc_iswa_init(&c, &t.c[0], &t.c[0], false, &err) == KVC_E_ARG && strstr(err.msg, "same"), "same: %s",
          err.msg);
    CHECK(kvc_iswa_init(&c, &t.c[1], &t.c[0], false, &err) == KVC_E_ARG && strstr(err.msg, "window"),
          "no window: %s", err.msg);
    t.c[1].n_seq_max = 2;
    CHECK(kvc_iswa_init(&c, &t.c[0], &t.c[1], false, &err) == KVC_E_ARG, "n_seq_max differs");
    t.c[1].n_seq_max = 3;
    CHECK(iswa_of(&c, &t, false) && !kvc_seqset_any(&c.pending.seqs, KVC_SEQ_WORDS), "bound");
    pair_free(&t);
}

/* A batch of one sequence at positions from..from+n-1, recorded and placed in one ubatch. */
static int place(kvc_iswa *c, int32_t seq, int32_t from, uint32_t n, int found[2]) {
    uint32_t off[65];
    int32_t pos[64], ids[64];
    for (uint32_t i = 0; i < n; i++) {
        off[i] = i;
        pos[i] = from + (int32_t)i;
        ids[i] = seq;
    }
    off[n] = n;
    kvc_err err = { 0, "" };
    if (kvc_iswa_sbatch_init(c, n, pos, off, ids, &err) != KVC_OK) {
        return KVC_E_ARG;
    }
    const kvc_ubatch ub = { n, 1, n, pos, off, ids, NULL, NULL, NULL };
    return kvc_iswa_find_slot(c, &ub, found, &err);
}

static void test_commit_prunes_the_window(void) {
    pair t;
    kvc_iswa c;
    kvc_iswa_pending partial;
    int found[2];
    REQUIRE(pair_init(&t) && iswa_of(&c, &t, false), "init");
    /* 10 positions of sequence 0: the SWA cache (n_swa 4) keeps what position 9 can see */
    CHECK(place(&c, 0, 0, 10, found) == 1 && found[0] && found[1], "placed");
    CHECK(c.pending.pmin[0] == 0 && c.pending.pmax[0] == 9, "pending 0..9");
    CHECK(kvc_iswa_commit(&c, &partial) == 0 && !kvc_seqset_any(&partial.seqs, KVC_SEQ_WORDS), "a whole window");
    CHECK(!kvc_seqset_any(&c.pending.seqs, KVC_SEQ_WORDS), "pending consumed");
    CHECK(t.c[0].undo.n_spans == 0 && t.c[1].undo.n_spans == 0, "both committed");
    CHECK(kvc_iswa_seq_pos_min(&c, 0) == 6 && kvc_iswa_seq_pos_max(&c, 0) == 9, "swa: %d..%d",
          kvc_iswa_seq_pos_min(&c, 0), kvc_iswa_seq_pos_max(&c, 0));
    CHECK(kvc_unified_seq_pos_min(&t.c[0], 0) == 0, "the base cache keeps everything");
    /* a gap: positions 20..21 see nothing of 6..9, and the window before 20 is lost */
    CHECK(place(&c, 0, 20, 2, found) == 1, "placed");
    CHECK(kvc_iswa_commit(&c, &partial) == 1 && kvc_seqset_has(&partial.seqs, 0), "partial");
    CHECK(partial.pmin[0] == 20 && partial.pmax[0] == 21, "partial range %d..%d", partial.pmin[0], partial.pmax[0]);
    CHECK(kvc_iswa_seq_pos_min(&c, 0) == 20, "pruned to %d", kvc_iswa_seq_pos_min(&c, 0));
    /* restore undoes both caches, and the next commit prunes with the ranges then pending */
    CHECK(place(&c, 1, 0, 3, found) == 1, "placed");
    kvc_iswa_restore(&c);
    CHECK(kvc_unified_seq_pos_max(&t.c[0], 1) == -1 && kvc_iswa_seq_pos_max(&c, 1) == -1, "restored");
    pair_free(&t);
}

static void test_swa_full_never_prunes(void) {
    pair t;
    kvc_iswa c;
    kvc_iswa_pending partial;
    int found[2];
    REQUIRE(pair_init(&t) && iswa_of(&c, &t, true), "init");
    CHECK(place(&c, 0, 0, 10, found) == 1, "placed");
    CHECK(!kvc_seqset_any(&c.pending.seqs, KVC_SEQ_WORDS), "nothing recorded");
    CHECK(kvc_iswa_commit(&c, &partial) == 0 && kvc_iswa_seq_pos_min(&c, 0) == 0, "nothing pruned");
    pair_free(&t);
}

static void test_find_slot_undoes_the_base_cache(void) {
    bool done = false;
    for (int k = 1; k < 20 && !done; k++) {
        pair t;
        kvc_iswa c;
        int found[2] = { 0, 0 };
        REQUIRE(pair_init(&t) && iswa_of(&c, &t, false), "init");
        bytes before = { 0 }, after = { 0 };
        pair_dump(&t, &before);
        kvc_fail_alloc_after = k;
        const int r = place(&c, 0, 0, 10, found);
        kvc_fail_alloc_after = 0;
        pair_dump(&t, &after);
        done = r == 1;
        if (!done) {
            CHECK(r == KVC_E_NOMEM, "allocation %d: rc %d", k, r);
            CHECK(before.n == after.n && memcmp(before.p, after.p, before.n) == 0, "allocation %d: a cache changed",
                  k);
        }
        bytes_free(&before);
        bytes_free(&after);
        pair_free(&t);
    }
    CHECK(done, "find_slot never succeeded");
}

static void test_no_room_in_one(void) {
    pair t;
    kvc_iswa c;
    int found[2];
    kvc_iswa_pending partial;
    REQUIRE(pair_init(&t) && iswa_of(&c, &t, false), "init");
    /* 40 tokens: room in the base cache (64 cells), none in the SWA cache (32) */
    int32_t pos[40];
    uint32_t off[41];
    int32_t ids[40];
    for (uint32_t i = 0; i < 40; i++) {
        pos[i] = (int32_t)i;
        off[i] = i;
        ids[i] = 0;
    }
    off[40] = 40;
    const kvc_ubatch ub = { 40, 1, 40, pos, off, ids, NULL, NULL, NULL };
    kvc_err err = { 0, "" };
    CHECK(kvc_iswa_find_slot(&c, &ub, found, &err) == 0 && found[0] && !found[1], "base only");
    kvc_iswa_restore(&c);
    CHECK(kvc_unified_seq_pos_max(&t.c[0], 0) == -1, "restored");
    (void)kvc_iswa_commit(&c, &partial);
    pair_free(&t);
}

static void test_sequence_operations(void) {
    pair t;
    kvc_iswa c;
    int found[2];
    kvc_iswa_pending partial;
    kvc_err err = { 0, "" };
    REQUIRE(pair_init(&t) && iswa_of(&c, &t, false), "init");
    REQUIRE(place(&c, 0, 0, 3, found) == 1, "placed");
    (void)kvc_iswa_commit(&c, &partial);
    CHECK(kvc_iswa_seq_cp(&c, 0, 2, -1, -1, &err) == KVC_OK, "%s", err.msg);
    CHECK(kvc_unified_seq_pos_max(&t.c[0], 2) == 2 && kvc_iswa_seq_pos_max(&c, 2) == 2, "copied in both");
    kvc_iswa_seq_add(&c, 2, 0, -1, 5);
    CHECK(kvc_unified_seq_pos_max(&t.c[0], 2) == 7 && kvc_iswa_seq_pos_max(&c, 2) == 7, "shifted in both");
    CHECK(kvc_iswa_has_shift(&c) && !kvc_iswa_can_shift(&c) && kvc_iswa_shift_refused(&c), "a shift it cannot apply");
    kvc_iswa_seq_div(&c, 2, 0, -1, 2);
    CHECK(kvc_unified_seq_pos_max(&t.c[0], 2) == 3 && kvc_iswa_seq_pos_max(&c, 2) == 3, "divided in both");
    CHECK(kvc_iswa_seq_rm(&c, 2, 3, -1), "removed");
    CHECK(kvc_unified_seq_pos_max(&t.c[0], 2) == 2 && kvc_iswa_seq_pos_max(&c, 2) == 2, "removed from both");
    kvc_iswa_seq_keep(&c, 2);
    CHECK(kvc_unified_seq_pos_max(&t.c[0], 0) == -1 && kvc_iswa_seq_pos_max(&c, 0) == -1, "kept 2 only");
    kvc_iswa_set_full(&c);
    CHECK(t.c[0].n == 64 && t.c[1].n == 32, "set_full: n %u, %u", t.c[0].n, t.c[1].n);
    kvc_iswa_clear(&c);
    CHECK(t.c[0].cells.used == 0 && t.c[1].cells.used == 0, "cleared");
    pair_free(&t);
}

int main(void) {
    test_round_trip();
    test_failing_second_part();
    test_no_room_in_the_second_cache();
    test_allocation_failures();
    test_bad_part_lists();
    test_pending();
    test_swa_size();
    test_init();
    test_commit_prunes_the_window();
    test_swa_full_never_prunes();
    test_find_slot_undoes_the_base_cache();
    test_no_room_in_one();
    test_sequence_operations();
    printf("test_iswa: %d checks, %d failed\n", n_checks, n_failed);
    return n_failed ? 1 : 0;
}
