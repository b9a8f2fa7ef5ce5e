/* Tests of the placement of semantics 2026 (csrc/kvc_slot.c): find_slot(cont=false) +
 * apply_ubatch against a naive transcription of today's rule (the usable cells tested one at a
 * time from the stream's head, wrapping, until the group has its cells or every cell was
 * tested; head reset to 0 when enough cells are free before it) on random fragmented streams
 * of sizes that are not multiples of 64, with and without a sliding window; a failed find_slot
 * changing nothing; the heads after a placement; the refusal of badly grouped ubatches; the
 * dry run (prepare) leaving every stream as it was; the rows of store() in scattered cells of
 * each stream, with V transposed per stream; the placement over two caches (an iSWA pair) in
 * both or in neither. */
#include "kvc_slot.h"
#include "kvc_types.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "fixture.h"

#define SIZE 200
#define N_STREAM 3
#define WIDTH 2

typedef struct fixture {
    kvc_unified c;
    float k[N_STREAM * SIZE * WIDTH], v[N_STREAM * SIZE * WIDTH];
} fixture;

static int fixture_init(fixture *f, bool per_seq, uint32_t n_swa, int32_t swa_type) {
    const int32_t il[1] = { 0 };
    const uint32_t w[1] = { WIDTH };
    const kvc_unified_params p = {
        .kv_size = SIZE, .semantics = KVC_SEM_2026, .stream_per_seq = per_seq, .n_seq_max = N_STREAM, .n_pad = 1,
        .n_swa = n_swa, .swa_type = swa_type, .type_k = KVC_TYPE_F32, .type_v = KVC_TYPE_F32, .v_trans = true,
        .n_layer = 1, .layer_il = il, .n_embd_k = w, .n_embd_v = w,
    };
    return fixture_attach(&f->c, &p, f->k, sizeof f->k, f->v, sizeof f->v);
}

/* A ubatch of one group: n tokens of sequence s at positions p0, p0 + 1, ... */
typedef struct one_seq {
    int32_t pos[SIZE + 1];
    uint32_t off[SIZE + 2];
    int32_t ids[SIZE + 1];
    kvc_ubatch ub;
} one_seq;

static const kvc_ubatch *one_seq_make(one_seq *o, uint32_t n, int32_t s, int32_t p0) {
    for (uint32_t t = 0; t < n; t++) {
        o->pos[t] = p0 + (int32_t)t;
        o->ids[t] = s;
        o->off[t] = t;
    }
    o->off[n] = n;
    o->ub = (kvc_ubatch){ .n_tokens = n, .n_seq_tokens = 1, .n_seqs = n, .pos = o->pos, .seq_off = o->off,
                          .seq_ids = o->ids };
    return &o->ub;
}

/* The rule cell by cell (FORMAT-2026.md "Placement rule"): the cells, or false. */
static bool naive_place(const kvc_unified *c, uint32_t st, uint32_t n, int32_t *idx) {
    const kvc_cells *t = kvc_unified_stream_cells_c(c, st);
    uint32_t head = kvc_unified_stream_head_c(c, st);
    if (head > t->used + 2 * n) {
        head = 0;
    }
    if (n > t->size) {
        return false;
    }
    uint32_t got = 0, tested = 0;
    for (;;) {
        if (head == t->size) {
            head = 0;
        }
        const uint32_t i = head++;
        tested++;
        bool usable = t->pos[i] == -1;
        if (!usable && c->swa_type != KVC_SWA_NONE &&
            kvc_cells_seq_count(t, i) == 1) {
            const int32_t q = kvc_cells_seq_next(t, i, -1);
            usable = kvc_unified_is_masked_swa(c, t->pos[i], kvc_cells_seq_pos_max(t, q) + 1);
        }
        if (usable) {
            idx[got++] = (int32_t)i;
        }
        if (got == n) {
            return true;
        }
        if (tested >= t->size) {
            return false;
        }
    }
}

static bool same_stream(const kvc_cells *a, const kvc_cells *b) {
    return memcmp(a->pos, b->pos, a->size * sizeof *a->pos) == 0 &&
           kvc_cells_same_sets(a, b) &&
           memcmp(a->shift, b->shift, a->size * sizeof *a->shift) == 0 && a->used == b->used &&
           a->used_max_p1 == b->used_max_p1;
}

/* Fill the stream of s to a random fragmentation: decode steps, then random removals. */
static void fragment(fixture *f, int32_t s, uint32_t steps) {
    one_seq o;
    for (uint32_t k = 0; k < steps; k++) {
        const int32_t p = kvc_unified_seq_pos_max(&f->c, s) + 1;
        kvc_unified_find_slot_2026(&f->c, one_seq_make(&o, 1 + check_rand(3), s, p), NULL);
        if (check_rand(3) == 0) {
            const int32_t at = (int32_t)check_rand((uint32_t)p + 1);
            kvc_unified_seq_rm(&f->c, s, at, at + 1 + (int32_t)check_rand(4));
        }
    }
}

static void test_placement_matches_the_rule(bool per_seq, uint32_t n_swa, int32_t swa_type) {
    fixture f;
    REQUIRE(fixture_init(&f, per_seq, n_swa, swa_type) == KVC_OK, "init");
    for (uint32_t round = 0; round < 300; round++) {
        const int32_t s = (int32_t)check_rand(N_STREAM);
        const uint32_t st = kvc_unified_stream_of(&f.c, s);
        fragment(&f, s, check_rand(20));
        const uint32_t n = 1 + check_rand(round % 10 == 0 ? SIZE + 1 : 24);
        int32_t want[SIZE + 1];
        const bool fits = naive_place(&f.c, st, n, want);
        kvc_cells before;
        REQUIRE(kvc_cells_init(&before, SIZE, N_STREAM) == KVC_OK, "copy");
        kvc_cells_copy(&before, kvc_unified_stream_cells(&f.c, st));
        const uint32_t head_before = kvc_unified_stream_head_c(&f.c, st);
        one_seq o;
        const int32_t p = kvc_unified_seq_pos_max(&f.c, s) + 1;
        const int r = kvc_unified_find_slot_2026(&f.c, one_seq_make(&o, n, s, p), NULL);
        CHECK(r == (int)fits, "round %u: find_slot %d, the rule says %d", round, r, fits);
        if (r == 1) {
            bool same = kvc_unified_slot_n(&f.c) == n;
            for (uint32_t t = 0; same && t < n; t++) {
                same = (int32_t)kvc_unified_slot_cell(&f.c, t) == want[t] && kvc_unified_slot_stream(&f.c, t) == st;
            }
            CHECK(same, "round %u: the cells of %u tokens differ from the rule's", round, n);
            CHECK(kvc_unified_stream_head_c(&f.c, st) == (uint32_t)want[n - 1] + 1, "round %u: head", round);
            CHECK(kvc_unified_seq_pos_max(&f.c, s) == p + (int32_t)n - 1, "round %u: pos_max", round);
        } else {
            CHECK(same_stream(&before, kvc_unified_stream_cells(&f.c, st)) &&
                  kvc_unified_stream_head_c(&f.c, st) == head_before && kvc_unified_slot_n(&f.c) == 0,
                  "round %u: a failed find_slot changed the stream", round);
        }
        kvc_cells_free(&before);
        if (round % 50 == 49) {
            kvc_unified_clear(&f.c);
        }
    }
    kvc_unified_free(&f.c);
}

/* Every index of a stream the same (the change log and the emptied bits aside, which a dry run
 * restarts and sets). */
static bool same_table(const kvc_cells *a, const kvc_cells *b) {
    bool same = same_stream(a, b) && a->has_shift == b->has_shift &&
                memcmp(a->n_seqs, b->n_seqs, a->size * sizeof *a->n_seqs) == 0 &&
                memcmp(a->used_bits, b->used_bits, a->n_words * sizeof *a->used_bits) == 0 &&
                memcmp(a->free_words, b->free_words, (a->n_words + 63) / 64 * sizeof *a->free_words) == 0 &&
                memcmp(a->seq_blk, b->seq_blk, (size_t)a->n_seq_max * a->blk_words * sizeof *a->seq_blk) == 0;
    for (uint32_t s = 0; same && s < a->n_seq_max; s++) {
        same = a->seq_pos[s].n == b->seq_pos[s].n &&
               memcmp(a->seq_pos[s].key, b->seq_pos[s].key, a->seq_pos[s].n * sizeof *a->seq_pos[s].key) == 0;
    }
    return same;
}

/* prepare of up to three ubatches of random sequences and sizes (fitting or not; with a window,
 * overwriting cells of other sequences) leaves every stream exactly as it was. */
static void test_prepare_leaves_every_index(bool per_seq, uint32_t n_swa, int32_t swa_type) {
    fixture f;
    REQUIRE(fixture_init(&f, per_seq, n_swa, swa_type) == KVC_OK, "init");
    for (uint32_t round = 0; round < 300; round++) {
        fragment(&f, (int32_t)check_rand(N_STREAM), check_rand(20));
        kvc_cells before[N_STREAM];
        uint32_t heads[N_STREAM];
        for (uint32_t st = 0; st < f.c.n_stream; st++) {
            REQUIRE(kvc_cells_snapshot(&before[st], kvc_unified_stream_cells(&f.c, st)) == KVC_OK, "snapshot");
            heads[st] = kvc_unified_stream_head_c(&f.c, st);
        }
        one_seq o[3];
        kvc_ubatch ubs[3];
        const uint32_t n_ub = 1 + check_rand(3);
        for (uint32_t u = 0; u < n_ub; u++) {
            const int32_t s = (int32_t)check_rand(N_STREAM);
            /* after the sequence's positions, or (one in three) among them */
            const int32_t last = kvc_unified_seq_pos_max(&f.c, s);
            const int32_t p0 = check_rand(3) == 0 ? (int32_t)check_rand((uint32_t)last + 2) : last + 1 + (int32_t)(u * SIZE);
            ubs[u] = *one_seq_make(&o[u], 1 + check_rand(round % 7 == 0 ? SIZE : 40), s, p0);
        }
        int32_t cells[3 * SIZE];
        uint32_t strm[3 * N_STREAM], groups[3];
        /* every third round an allocation fails on the way: the same */
        kvc_fail_alloc_after = round % 3 == 2 ? 1 + (int)check_rand(8) : 0;
        const int r = kvc_unified_prepare_2026(&f.c, ubs, n_ub, cells, strm, groups, NULL);
        CHECK(r == 0 || r == 1 || (r == KVC_E_NOMEM && round % 3 == 2), "round %u: prepare %d", round, r);
        kvc_fail_alloc_after = 0;
        bool same = true;
        for (uint32_t st = 0; st < f.c.n_stream; st++) {
            same = same && same_table(&before[st], kvc_unified_stream_cells(&f.c, st)) &&
                   kvc_unified_stream_head_c(&f.c, st) == heads[st];
            kvc_cells_free(&before[st]);
        }
        CHECK(same, "round %u: prepare of %u ubatches changed the cache", round, n_ub);
        if (round % 50 == 49) {
            kvc_unified_clear(&f.c);
        }
    }
    kvc_unified_free(&f.c);
}

static void test_groups_prepare_and_store(void) {
    fixture f;
    REQUIRE(fixture_init(&f, true, 0, KVC_SWA_NONE) == KVC_OK, "init");
    kvc_err err;
    /* tokens of sequences 2 and 0, two each, grouped: two groups in streams 2 and 0 */
    const int32_t pos[4] = { 0, 1, 0, 1 }, ids[4] = { 2, 2, 0, 0 };
    const uint32_t off[5] = { 0, 1, 2, 3, 4 };
    const kvc_ubatch ub = { .n_tokens = 4, .n_seq_tokens = 1, .n_seqs = 4, .pos = pos, .seq_off = off, .seq_ids = ids };
    /* interleaved, or of unequal groups: refused, nothing changes */
    const int32_t bad_ids[4] = { 2, 0, 2, 0 }, uneven_ids[3] = { 2, 2, 0 };
    const kvc_ubatch bad = { .n_tokens = 4, .n_seq_tokens = 1, .n_seqs = 4, .pos = pos, .seq_off = off, .seq_ids = bad_ids };
    const kvc_ubatch uneven = { .n_tokens = 3, .n_seq_tokens = 1, .n_seqs = 3, .pos = pos, .seq_off = off,
                                .seq_ids = uneven_ids };
    CHECK(kvc_unified_find_slot_2026(&f.c, &bad, &err) == KVC_E_ARG, "interleaved groups");
    CHECK(kvc_unified_find_slot_2026(&f.c, &uneven, &err) == KVC_E_ARG, "unequal groups");
    CHECK(kvc_unified_stream_cells(&f.c, 0)->used + kvc_unified_stream_cells(&f.c, 2)->used == 0, "no change");

    /* the dry run: both placements as find_slot would make them, then every stream as before */
    int32_t cells[8];
    uint32_t strm[2 * N_STREAM], groups[2];
    const kvc_ubatch two[2] = { ub, ub };
    CHECK(kvc_unified_prepare_2026(&f.c, two, 2, cells, strm, groups, &err) == 1, "prepare");
    CHECK(groups[0] == 2 && strm[0] == 2 && strm[1] == 0 && cells[0] == 0 && cells[1] == 1 && cells[4] == 2 &&
          cells[5] == 3, "prepare: the second ubatch after the first");
    CHECK(kvc_unified_stream_cells(&f.c, 2)->used == 0 && kvc_unified_stream_head_c(&f.c, 2) == 0,
          "prepare left the cache as it was");

    REQUIRE(kvc_unified_find_slot_2026(&f.c, &ub, &err) == 1, "find_slot");
    /* K and V of token t: 10 t + e */
    float rows[4 * WIDTH];
    for (uint32_t t = 0; t < 4; t++) {
        for (uint32_t e = 0; e < WIDTH; e++) {
            rows[t * WIDTH + e] = (float)(10 * t + e);
        }
    }
    CHECK(kvc_unified_store(&f.c, 0, 4, rows, rows) == KVC_OK, "store");
    /* token 1: stream 2, cell 1; token 2: stream 0, cell 0 */
    CHECK(f.k[(2 * SIZE + 1) * WIDTH + 1] == 11.0f && f.k[0 * WIDTH + 1] == 21.0f, "K rows per stream");
    CHECK(f.v[2 * SIZE * WIDTH + 1 * SIZE + 1] == 11.0f && f.v[1 * SIZE + 0] == 21.0f, "V transposed per stream");
    kvc_unified_free(&f.c);
}

/* The same cells: positions, sequences and the used count. */
static bool same_cells(const kvc_cells *x, const kvc_cells *y) {
    return x->size == y->size && x->used == y->used && memcmp(x->pos, y->pos, x->size * sizeof *x->pos) == 0 &&
           kvc_cells_same_sets(x, y);
}

/* Two caches driven as one (an iSWA pair): a ubatch that fits one and not the other changes
 * neither, one that fits both is placed in both as each alone would place it. */
static void test_parts_all_or_nothing(void) {
    fixture a, b;
    REQUIRE(fixture_init(&a, false, 0, KVC_SWA_NONE) == KVC_OK, "init a");
    REQUIRE(fixture_init(&b, false, 0, KVC_SWA_NONE) == KVC_OK, "init b");
    kvc_err err;
    one_seq o;
    kvc_unified *both[2] = { &a.c, &b.c };
    int found[2];
    /* b: all but 10 cells held by sequence 1 */
    REQUIRE(kvc_unified_find_slot_2026(&b.c, one_seq_make(&o, SIZE - 10, 1, 0), &err) == 1, "fill b");
    REQUIRE(kvc_unified_find_slot_2026(&a.c, one_seq_make(&o, 5, 0, 0), &err) == 1, "a: 5 cells");
    kvc_cells before_a, before_b;
    REQUIRE(kvc_cells_init(&before_a, SIZE, N_STREAM) == KVC_OK && kvc_cells_init(&before_b, SIZE, N_STREAM) == KVC_OK,
            "copies");
    kvc_cells_copy(&before_a, kvc_unified_stream_cells(&a.c, 0));
    kvc_cells_copy(&before_b, kvc_unified_stream_cells(&b.c, 0));
    const uint32_t head_a = kvc_unified_stream_head_c(&a.c, 0), head_b = kvc_unified_stream_head_c(&b.c, 0);
    /* 20 tokens of sequence 2: room in a, 10 free cells in b */
    CHECK(kvc_unified_find_slot_2026_parts(both, 2, one_seq_make(&o, 20, 2, 0), found, &err) == 0, "no room in b");
    CHECK(found[0] == 1 && found[1] == 0, "a had room, b had not");
    CHECK(same_cells(&before_a, kvc_unified_stream_cells(&a.c, 0)) &&
          same_cells(&before_b, kvc_unified_stream_cells(&b.c, 0)) &&
          kvc_unified_stream_head_c(&a.c, 0) == head_a && kvc_unified_stream_head_c(&b.c, 0) == head_b,
          "neither changed");
    CHECK(kvc_unified_slot_n(&a.c) == 0 && kvc_unified_slot_n(&b.c) == 0, "no placement current");
    /* 8 tokens fit both: placed in both, where each alone puts them */
    int32_t want_a[8], want_b[8];
    CHECK(naive_place(&a.c, 0, 8, want_a) && naive_place(&b.c, 0, 8, want_b), "room in both");
    CHECK(kvc_unified_find_slot_2026_parts(both, 2, one_seq_make(&o, 8, 2, 0), found, &err) == 1, "placed");
    CHECK(found[0] == 1 && found[1] == 1 && kvc_unified_slot_n(&a.c) == 8 && kvc_unified_slot_n(&b.c) == 8,
          "both placements current");
    for (uint32_t t = 0; t < 8; t++) {
        CHECK(kvc_unified_slot_cell(&a.c, t) == (uint32_t)want_a[t] &&
              kvc_unified_slot_cell(&b.c, t) == (uint32_t)want_b[t], "each cache's own cells");
    }
    /* a badly grouped ubatch for either: refused before either changes */
    CHECK(kvc_unified_find_slot_2026_parts(both, 0, &o.ub, found, &err) == KVC_E_ARG, "no caches");
    kvc_cells_free(&before_a);
    kvc_cells_free(&before_b);
    kvc_unified_free(&a.c);
    kvc_unified_free(&b.c);
}

int main(void) {
    test_placement_matches_the_rule(false, 0, KVC_SWA_NONE);
    test_placement_matches_the_rule(true, 0, KVC_SWA_NONE);
    test_placement_matches_the_rule(false, 8, KVC_SWA_STANDARD);
    test_placement_matches_the_rule(true, 16, KVC_SWA_CHUNKED);
    test_prepare_leaves_every_index(false, 0, KVC_SWA_NONE);
    test_prepare_leaves_every_index(true, 0, KVC_SWA_NONE);
    test_prepare_leaves_every_index(false, 8, KVC_SWA_STANDARD);
    test_prepare_leaves_every_index(true, 16, KVC_SWA_CHUNKED);
    test_groups_prepare_and_store();
    test_parts_all_or_nothing();
    printf("test_find_slot_2026: %d checks, %d failed\n", n_checks, n_failed);
    return n_failed != 0;
}
