/* Prefix reuse on a 2026 cache (kvc_reuse.h, kvc_retain.h): release, match, attach; placement
 * skipping held cells and evicting them when it needs room, never a live sequence's; seq_add
 * making the index forget; allocation failures in enable and release (nothing changed);
 * publishing a running sequence; an iSWA pair with a small SWA cache (window mode: ghosts,
 * hits only where the window is held, placement overwriting held cells its window left); pins
 * and evictions over several caches, all or nothing; kvc_reuse_check after every step. */
#include "kvc_retain.h"

#include <stdio.h>
#include <string.h>

#include "check.h"
#include "fixture.h"
#include "kvc_slot.h"
#include "kvc_types.h"

#define SIZE 32
#define WIDTH 2

typedef struct fx {
    kvc_unified c;
    float k[SIZE * WIDTH], v[SIZE * WIDTH];
} fx;

static int fx_init(fx *f) {
    const int32_t il[1] = { 0 };
    const uint32_t w[1] = { WIDTH };
    const kvc_unified_params p = {
        .kv_size = SIZE, .semantics = KVC_SEM_2026, .n_seq_max = 4, .n_pad = 1, .type_k = KVC_TYPE_F32,
        .type_v = KVC_TYPE_F32, .n_layer = 1, .layer_il = il, .n_embd_k = w, .n_embd_v = w,
    };
    return fixture_attach(&f->c, &p, f->k, sizeof f->k, f->v, sizeof f->v);
}

#define CHECKED(c)                                                                  \
    do {                                                                            \
        kvc_err err_ = { 0, "" };                                                   \
        CHECK(kvc_reuse_check((c), &err_) == KVC_OK, "invariant: %s", err_.msg);    \
    } while (0)

/* The ubatch of tokens[p0 .. p0 + n) of sequence s at positions p0.. (one group), in the arrays
 * given (room for n, off for n + 1). */
static kvc_ubatch one_group(int32_t s, const int32_t *tokens, uint32_t n, int32_t p0, int32_t *pos, int32_t *ids,
                            uint32_t *off) {
    for (uint32_t t = 0; t < n; t++) {
        pos[t] = p0 + (int32_t)t;
        ids[t] = s;
        off[t] = t;
    }
    off[n] = n;
    const kvc_ubatch ub = { .n_tokens = n, .n_seq_tokens = n, .n_seqs = 1, .pos = pos, .seq_off = off,
                            .seq_ids = ids, .token = tokens + p0 };
    return ub;
}

/* Place tokens[p0 .. p0 + n) of sequence s at positions p0.. (one group); 1 placed, 0 no room. */
static int place(kvc_unified *c, int32_t s, const int32_t *tokens, uint32_t n, int32_t p0) {
    int32_t pos[SIZE], ids[SIZE];
    uint32_t off[SIZE + 1];
    const kvc_ubatch ub = one_group(s, tokens, n, p0, pos, ids, off);
    const int r = kvc_unified_find_slot_2026(c, &ub, NULL);
    CHECKED(c);
    return r;
}

static void test_release_match_attach(void) {
    fx f;
    REQUIRE(fx_init(&f) == KVC_OK, "init");
    kvc_unified *c = &f.c;
    const int32_t a[8] = { 5, 6, 7, 8, 9, 10, 11, 12 };
    kvc_err err = { 0, "" };
    kvc_retained res;
    uint32_t k = 99;
    CHECK(kvc_retain_release(c, 0, 0, NULL, 0, &res, &err) == KVC_E_ARG, "reuse off: refused");
    CHECK(kvc_retain_match(c, 0, a, 8) == 0, "reuse off: no match");
    REQUIRE(kvc_reuse_enable(c, 0, &err) == KVC_OK, "enable: %s", err.msg);
    REQUIRE(place(c, 0, a, 6, 0) == 1, "placed");
    CHECK(kvc_retain_release(c, 0, 0, NULL, 0, &res, &err) == KVC_OK && res.n_kept == 6 && res.n_new == 6,
          "released: kept %u new %u", res.n_kept, res.n_new);
    CHECKED(c);
    CHECK(c->cells.used == 0 && kvc_unified_seq_pos_max(c, 0) == -1, "the sequence is gone, its cells held");
    CHECK(kvc_retain_match(c, 0, a, 8) == 6 && kvc_retain_match(c, 0, a, 6) == 5 && kvc_retain_match(c, 1, a, 8) == 0,
          "matches: capped at n - 1, per salt");
    CHECK(kvc_retain_attach(c, 1, 0, a, 8, &k, &err) == KVC_OK && k == 6, "attached %u", k);
    CHECKED(c);
    CHECK(kvc_unified_seq_pos_max(c, 1) == 5 && c->cells.used == 6, "positions 0..5 in sequence 1");
    CHECK(kvc_retain_attach(c, 1, 0, a, 8, &k, &err) == KVC_E_ARG, "not empty: refused");
    /* ids outside [0, n_seq_max): refused before any per-sequence record is read */
    const int32_t bad_ids[3] = { -1, (int32_t)c->n_seq_max, INT32_MIN };
    for (int b = 0; b < 3; b++) {
        CHECK(kvc_retain_attach(c, bad_ids[b], 0, a, 8, &k, &err) == KVC_E_ARG && k == 0, "attach %d", bad_ids[b]);
        CHECK(kvc_retain_release(c, bad_ids[b], 0, NULL, 0, &res, &err) == KVC_E_ARG, "release %d", bad_ids[b]);
        CHECK(kvc_retain_publish(c, bad_ids[b], 0, a, 8, &res, &err) == KVC_E_ARG, "publish %d", bad_ids[b]);
    }
    CHECKED(c);
    CHECK(kvc_reuse_evict(c, 100) == 0, "attached: nothing evictable");
    /* a shift of the attached sequence moves held cells: forgotten from there on */
    kvc_unified_seq_add(c, 1, 3, -1, 1);
    CHECKED(c);
    CHECK(kvc_retain_match(c, 0, a, 8) == 3, "the index keeps positions 0..2, got %u", kvc_retain_match(c, 0, a, 8));
    kvc_unified_seq_rm(c, 1, -1, -1);
    CHECKED(c);
    CHECK(c->reuse->lock[1].node == 0, "the lock went with the last cell");
    CHECK(kvc_reuse_evict(c, 100) == 3, "now evictable");
    CHECKED(c);
    kvc_unified_free(c);
}

static void test_placement_evicts(void) {
    fx f;
    REQUIRE(fx_init(&f) == KVC_OK, "init");
    kvc_unified *c = &f.c;
    kvc_err err = { 0, "" };
    kvc_retained res;
    int32_t t[3][12];
    for (int s = 0; s < 3; s++) {
        for (int i = 0; i < 12; i++) {
            t[s][i] = 100 * (s + 1) + i;
        }
    }
    REQUIRE(kvc_reuse_enable(c, 0, &err) == KVC_OK, "enable");
    for (int s = 0; s < 2; s++) {
        REQUIRE(place(c, s, t[s], 12, 0) == 1, "placed %d", s);
    }
    CHECK(kvc_retain_release(c, 0, 0, NULL, 0, &res, &err) == KVC_OK && res.n_kept == 12, "kept 0");
    uint32_t k;
    CHECK(kvc_retain_attach(c, 2, 0, t[0], 12, &k, &err) == KVC_OK && k == 11, "attached 11");
    /* 32 cells: sequence 1's 12, sequence 2's 11 attached, the prompt's last cell held and
     * protected with its node (the lock is on the node of the match's end): 8 free, nothing
     * evictable */
    CHECK(place(c, 3, t[2], 10, 0) == 0, "no room: 8 free + 0 evictable");
    CHECKED(c);
    CHECK(kvc_unified_seq_pos_max(c, 1) == 11 && kvc_unified_seq_pos_max(c, 2) == 10, "live sequences untouched");
    CHECK(place(c, 3, t[2], 8, 0) == 1, "8 fit");
    kvc_unified_free(c);
}

static void test_allocation_failures(void) {
    for (int at = 1; at < 12; at++) {
        fx f;
        REQUIRE(fx_init(&f) == KVC_OK, "init");
        kvc_unified *c = &f.c;
        kvc_err err = { 0, "" };
        kvc_fail_alloc_after = at;
        const int rc = kvc_reuse_enable(c, 0, &err);
        kvc_fail_alloc_after = 0;
        CHECK(rc == KVC_OK || (rc == KVC_E_NOMEM && c->reuse == NULL), "enable at %d: %d", at, rc);
        if (rc != KVC_OK) {
            kvc_unified_free(c);
            continue;
        }
        const int32_t a[6] = { 1, 2, 3, 4, 5, 6 };
        REQUIRE(place(c, 0, a, 6, 0) == 1, "placed");
        kvc_retained res;
        kvc_fail_alloc_after = at;
        const int r2 = kvc_retain_release(c, 0, 0, NULL, 0, &res, &err);
        kvc_fail_alloc_after = 0;
        CHECKED(c);
        if (r2 == KVC_OK) {
            CHECK(kvc_unified_seq_pos_max(c, 0) == -1, "released");
        } else {
            CHECK(r2 == KVC_E_NOMEM && kvc_unified_seq_pos_max(c, 0) == 5 && c->reuse->idx.n_held == 0,
                  "release failing at %d changed nothing", at);
        }
        kvc_unified_free(c);
    }
}

static void test_publish(void) {
    fx f;
    REQUIRE(fx_init(&f) == KVC_OK, "init");
    kvc_unified *c = &f.c;
    kvc_err err = { 0, "" };
    kvc_retained res;
    const int32_t a[8] = { 5, 6, 7, 8, 9, 10, 11, 12 };
    uint32_t k = 0;
    REQUIRE(kvc_reuse_enable(c, 0, &err) == KVC_OK, "enable");
    REQUIRE(place(c, 0, a, 6, 0) == 1, "placed");
    CHECK(kvc_retain_publish(c, 0, 0, NULL, 0, &res, &err) == KVC_OK && res.n_kept == 6, "published %u", res.n_kept);
    CHECKED(c);
    CHECK(kvc_unified_seq_pos_max(c, 0) == 5 && c->reuse->lock[0].node != 0, "it goes on, holding a lock");
    CHECK(kvc_reuse_evict(c, 100) == 0, "its prefix is protected");
    CHECK(kvc_retain_attach(c, 1, 0, a, 8, &k, &err) == KVC_OK && k == 6, "attached %u while it runs", k);
    REQUIRE(place(c, 0, a, 2, 6) == 1, "the publisher goes on");
    CHECK(kvc_retain_publish(c, 0, 0, NULL, 0, &res, &err) == KVC_OK && res.n_kept == 8 && res.n_new == 2,
          "published again: %u kept, %u new", res.n_kept, res.n_new);
    CHECKED(c);
    kvc_unified_seq_rm(c, 0, 3, -1);   /* what it removes stays: K/V unchanged */
    CHECKED(c);
    CHECK(kvc_retain_match(c, 0, a, 8) == 7, "still held: %u", kvc_retain_match(c, 0, a, 8));
    kvc_unified_seq_rm(c, 0, -1, -1);
    kvc_unified_seq_rm(c, 1, -1, -1);
    CHECKED(c);
    CHECK(c->reuse->lock[0].node == 0 && c->reuse->lock[1].node == 0, "the locks went with the cells");
    CHECK(kvc_reuse_evict(c, 100) == 8, "all evictable now");
    CHECKED(c);
    kvc_unified_free(c);
}

/* An iSWA pair: a base cache of 64 cells, a SWA cache of 16 (window 4). */
typedef struct pair {
    kvc_unified base, swa;
    float k[2][64 * WIDTH], v[2][64 * WIDTH];
} pair;

static int pair_init(pair *f) {
    const int32_t il[1] = { 0 };
    const uint32_t w[1] = { WIDTH };
    kvc_unified_params p = {
        .kv_size = 64, .semantics = KVC_SEM_2026, .n_seq_max = 4, .n_pad = 1, .type_k = KVC_TYPE_F32,
        .type_v = KVC_TYPE_F32, .n_layer = 1, .layer_il = il, .n_embd_k = w, .n_embd_v = w,
    };
    int rc = fixture_attach(&f->base, &p, f->k[0], sizeof f->k[0], f->v[0], sizeof f->v[0]);
    p.kv_size = 16;
    p.n_swa = 4;
    p.swa_type = KVC_SWA_STANDARD;
    return rc == KVC_OK ? fixture_attach(&f->swa, &p, f->k[1], 16 * WIDTH * sizeof(float), f->v[1],
                                         16 * WIDTH * sizeof(float))
                        : rc;
}

/* tokens[p0 .. p0 + n) of s into both caches (one group); 1 placed, 0 no room. */
static int place_pair(pair *f, int32_t s, const int32_t *tokens, uint32_t n, int32_t p0) {
    int32_t pos[16], ids[16];
    uint32_t off[17];
    const kvc_ubatch ub = one_group(s, tokens, n, p0, pos, ids, off);
    kvc_unified *const cs[2] = { &f->base, &f->swa };
    int found[2];
    const int r = kvc_unified_find_slot_2026_parts(cs, 2, &ub, found, NULL);
    CHECKED(&f->base);
    CHECKED(&f->swa);
    return r;
}

static void test_window_pair(void) {
    pair f;
    REQUIRE(pair_init(&f) == KVC_OK, "init");
    kvc_unified *const cs[2] = { &f.base, &f.swa };
    kvc_err err = { 0, "" };
    kvc_retained res;
    int32_t a[40];
    for (int i = 0; i < 40; i++) {
        a[i] = 100 + i;
    }
    REQUIRE(kvc_retain_enable_window_pair(&f.base, &f.swa, 0, &err) == KVC_OK, "enable: %s", err.msg);
    for (int32_t p0 = 0; p0 < 24; p0 += 4) {
        REQUIRE(place_pair(&f, 0, a, 4, p0) == 1, "placed at %d", p0);
    }
    CHECK(kvc_unified_seq_pos_min(&f.swa, 0) > 0, "the SWA cache overwrote the first positions");
    CHECK(kvc_retain_release_parts(cs, 2, 0, 0, NULL, 0, &res, &err) == KVC_OK && res.n_kept == 24, "kept %u",
          res.n_kept);
    CHECKED(&f.base);
    CHECKED(&f.swa);
    CHECK(kvc_reuse_n_cells(&f.swa) < 24 && kvc_prefix_n_held(&f.swa.reuse->idx) == 24, "ghosts: %u cells of 24",
          kvc_reuse_n_cells(&f.swa));
    int32_t q[30];
    memcpy(q, a, sizeof q);
    q[24] = 7;
    CHECK(kvc_retain_match_parts(cs, 2, 0, q, 25) == 24, "the continuation hits");
    q[5] = 7;
    CHECK(kvc_retain_match_parts(cs, 2, 0, q, 6) == 0, "the beginning: the window before 5 is gone");
    memcpy(q, a, sizeof q);
    /* a hit of exactly p: the end of the prompt (its window held) and not its beginning; none
     * past what is held, none of 0 tokens */
    CHECK(kvc_retain_serves_parts(cs, 2, 0, q, 25, 24) && kvc_retain_serves_parts(cs, 2, 0, q, 24, 24),
          "24 served");
    CHECK(!kvc_retain_serves_parts(cs, 2, 0, q, 25, 4), "4 not served: its window is gone");
    CHECK(!kvc_retain_serves_parts(cs, 2, 0, q, 30, 25) && !kvc_retain_serves_parts(cs, 2, 0, q, 25, 0) &&
              !kvc_retain_serves_parts(cs, 2, 0, q, 20, 21),
          "past the prompt, nothing, past n: not served");
    CHECK(kvc_retain_serves_parts(cs, 1, 0, q, 25, 4), "the base cache alone serves 4");
    uint32_t k = 0;
    CHECK(kvc_retain_attach_parts(cs, 2, -1, 0, q, 25, &k, &err) == KVC_E_ARG && k == 0, "attach -1: refused");
    CHECK(kvc_retain_release_parts(cs, 2, 99, 0, NULL, 0, &res, &err) == KVC_E_ARG, "release 99: refused");
    CHECK(kvc_retain_attach_parts(cs, 2, 1, 0, q, 25, &k, &err) == KVC_OK && k == 24, "attached %u", k);
    CHECK(kvc_unified_seq_pos_min(&f.swa, 1) == 21 && kvc_unified_seq_pos_max(&f.swa, 1) == 23 &&
              kvc_unified_seq_pos_max(&f.base, 1) == 23,
          "the window in the SWA cache, everything in the base");
    /* decoding on in a cache whose cells the index holds: the window's cells are overwritten */
    for (int32_t p = 24; p < 40; p++) {
        REQUIRE(place_pair(&f, 1, a, 1, p) == 1, "decoded %d", p);
    }
    CHECK(kvc_retain_release_parts(cs, 2, 1, 0, NULL, 0, &res, &err) == KVC_OK && res.n_kept == 40, "kept %u",
          res.n_kept);
    CHECK(kvc_retain_match_parts(cs, 2, 0, a, 40) == 39, "the longer prompt hits");
    CHECKED(&f.base);
    CHECKED(&f.swa);
    kvc_unified_free(&f.base);
    kvc_unified_free(&f.swa);
}

/* Pins over several caches: a pin one refuses pins nothing, an unpin one refuses lets go of
 * nothing, an eviction evicts in each (the sum). */
static void test_pin_parts(void) {
    fx fa, fb;
    REQUIRE(fx_init(&fa) == KVC_OK && fx_init(&fb) == KVC_OK, "init");
    kvc_unified *cs[2] = { &fa.c, &fb.c };
    const int32_t a[6] = { 5, 6, 7, 8, 9, 10 }, b[6] = { 5, 6, 7, 1, 2, 3 };
    kvc_err err = { 0, "" };
    kvc_retained res;
    kvc_prefix_handle pins[2];
    for (int k = 0; k < 2; k++) {
        REQUIRE(kvc_reuse_enable(cs[k], 0, &err) == KVC_OK, "enable: %s", err.msg);
        REQUIRE(place(cs[k], 0, k ? b : a, 6, 0) == 1, "placed");
        REQUIRE(kvc_retain_release(cs[k], 0, 0, NULL, 0, &res, &err) == KVC_OK && res.n_kept == 6, "released");
    }
    /* the second cache holds only 3 of a's tokens: refused there, the first's pin let go */
    CHECK(kvc_retain_pin_parts_xy(cs, 2, 0, a, NULL, NULL, NULL, 6, pins, &err) == KVC_E_ARG, "refused");
    CHECK(fa.c.reuse->idx.n_evictable == 6 && fb.c.reuse->idx.n_evictable == 6, "nothing pinned");
    CHECK(kvc_retain_pin_parts_xy(cs, 2, 0, a, NULL, NULL, NULL, 3, pins, &err) == KVC_OK, "pinned: %s", err.msg);
    CHECKED(&fa.c);
    CHECKED(&fb.c);
    CHECK(fa.c.reuse->idx.n_evictable == 0 && fb.c.reuse->idx.n_evictable == 0, "both pinned");
    const kvc_prefix_handle bad[2] = { pins[0], { pins[1].node, pins[1].gen + 1 } };
    CHECK(kvc_retain_unpin_parts(cs, 2, bad, &err) == KVC_E_ARG, "a stale half: refused");
    CHECK(kvc_retain_pin_held(&fa.c, pins[0]) && kvc_retain_pin_held(&fb.c, pins[1]), "both still pinned");
    CHECK(kvc_retain_evict_parts(cs, 2, 100) == 0, "pinned: nothing evicted");
    CHECK(kvc_retain_unpin_parts(cs, 2, pins, &err) == KVC_OK, "unpinned: %s", err.msg);
    CHECK(!kvc_retain_pin_held(&fa.c, pins[0]) && !kvc_retain_pin_held(&fb.c, pins[1]), "both let go");
    CHECK(kvc_retain_evict_parts(cs, 2, 100) == 12, "evicted in each");
    CHECKED(&fa.c);
    CHECKED(&fb.c);
    kvc_unified_free(&fa.c);
    kvc_unified_free(&fb.c);
}

int main(void) {
    test_publish();
    test_window_pair();
    test_release_match_attach();
    test_placement_evicts();
    test_allocation_failures();
    test_pin_parts();
    printf("test_retain: %d checks, %d failed\n", n_checks, n_failed);
    return n_failed != 0;
}
