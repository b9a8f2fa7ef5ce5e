/* Prefix reuse on a 2026 cache (kvc_reuse.h, kvc_retain.h): release, match, attach; placement
 * skipping held cells and evicting them when it needs room, never a live sequence's; seq_add
 * making the index forget; allocation failures in enable and release (nothing changed);
 * kvc_reuse_check after every step. */
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

/* Place tokens[p0 .. p0 + n) of sequence s at positions p0.. (one group); 1 placed, 0 no room. */
static int place(kvc_unified *c, int32_t s, const int32_t *tokens, uint32_t n, int32_t p0) {
    int32_t pos[SIZE], ids[SIZE];
    uint32_t off[SIZE + 1];
    for (uint32_t t = 0; t < n; t++) {
        pos[t] = p0 + (int32_t)t;
        ids[t] = s;
        off[t] = t;
    }
    off[n] = n;
    const kvc_ubatch ub = { .n_tokens = n, .n_seq_tokens = n, .n_seqs = 1, .pos = pos, .seq_off = off,
                            .seq_ids = ids, .token = tokens + p0 };
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

int main(void) {
    test_release_match_attach();
    test_placement_evicts();
    test_allocation_failures();
    printf("test_retain: %d checks, %d failed\n", n_checks, n_failed);
    return n_failed != 0;
}
