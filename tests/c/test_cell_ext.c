/* Tests of the per-cell extension of a cache of semantics 2026 under the sanitizers: a ubatch's
 * 2-D positions and token ids land in its cells (a per-layer-embedding token where it has none),
 * a cell that empties gets the defaults back but one shifted below 0 keeps them, a stream copy
 * carries them; the mask of a 2-D ubatch hides the cells 2-D after a token at its position; the
 * state writes them in the layouts that have them (8 or 12 bytes), reads them back (whole and a
 * sequence) to the same bytes, refuses a layout without them, and a state cut anywhere changes
 * nothing; the seed's semantics and a cache without them refuse what needs them. */
#include "kvc_mask.h"
#include "kvc_state.h"
#include "kvc_types.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "fixture.h"

#define SIZE 32
#define WIDTH 2
#define LAY_12 (KVC_LAYOUT_STREAMS | KVC_LAYOUT_PREFIX | KVC_LAYOUT_SWA_TRIM | KVC_LAYOUT_EXT_XY | KVC_LAYOUT_EXT_TOK)
#define LAY_8 (KVC_LAYOUT_STREAMS | KVC_LAYOUT_EXT_XY)

typedef struct fixture {
    kvc_unified c;
    float k[2 * SIZE * WIDTH], v[2 * SIZE * WIDTH];
} fixture;

static int fixture_init(fixture *f, bool per_seq, bool ple, int32_t semantics) {
    const int32_t il[1] = { 0 };
    const uint32_t w[1] = { WIDTH };
    const kvc_unified_params p = {
        .kv_size = SIZE, .semantics = semantics, .stream_per_seq = per_seq, .n_seq_max = 2, .n_pad = 1,
        .swa_type = KVC_SWA_NONE, .type_k = KVC_TYPE_F32, .type_v = KVC_TYPE_F32, .v_trans = true, .n_layer = 1,
        .layer_il = il, .n_embd_k = w, .n_embd_v = w, .cell_ext = true, .ple = ple, .ple_token = 77,
    };
    return fixture_attach(&f->c, &p, f->k, sizeof f->k, f->v, sizeof f->v);
}

/* n tokens of sequence s at pos[], with 2-D positions and token ids when given. */
static int put(fixture *f, int32_t s, uint32_t n, const int32_t *pos, const int32_t *x, const int32_t *y,
               const int32_t *tok) {
    int32_t ids[SIZE];
    uint32_t off[SIZE + 1];
    for (uint32_t t = 0; t < n; t++) {
        ids[t] = s;
        off[t] = t;
    }
    off[n] = n;
    const kvc_ubatch ub = { .n_tokens = n, .n_seq_tokens = 1, .n_seqs = n, .pos = pos, .seq_off = off,
                            .seq_ids = ids, .pos_x = x, .pos_y = y, .token = tok };
    kvc_err err;
    err.msg[0] = 0;
    return kvc_unified_find_slot_2026(&f->c, &ub, &err);
}

static bool ext_is(const kvc_cells *c, uint32_t i, int32_t x, int32_t y, int32_t tok) {
    return c->ext[i].x == x && c->ext[i].y == y && c->ext[i].tok == tok;
}

static void test_cells(void) {
    fixture f;
    REQUIRE(fixture_init(&f, true, false, KVC_SEM_2026) == KVC_OK, "init");
    const int32_t pos[3] = { 0, 1, 2 }, x[3] = { 4, 5, 6 }, y[3] = { 7, 8, 9 }, tok[3] = { 1, 2, 3 };
    REQUIRE(put(&f, 0, 3, pos, x, y, tok) == 1, "place");
    const kvc_cells *s0 = kvc_unified_stream_cells_c(&f.c, 0), *s1 = kvc_unified_stream_cells_c(&f.c, 1);
    CHECK(ext_is(s0, 0, 4, 7, 1) && ext_is(s0, 2, 6, 9, 3), "stored");
    kvc_err err;
    REQUIRE(kvc_unified_seq_cp_check(&f.c, 0, 1, -1, -1, &err) == KVC_OK, "copy check");
    kvc_unified_seq_cp(&f.c, 0, 1, -1, -1);
    CHECK(ext_is(s1, 0, 4, 7, 1) && ext_is(s1, 1, 5, 8, 2) && ext_is(s1, 2, 6, 9, 3), "copied across streams");
    kvc_unified_seq_rm(&f.c, 0, 1, 2);
    CHECK(ext_is(s0, 1, 0, 0, KVC_TOKEN_NULL) && ext_is(s0, 0, 4, 7, 1), "emptied: defaults");
    kvc_unified_seq_add(&f.c, 1, 0, -1, -1);
    CHECK(s1->pos[0] == -1 && ext_is(s1, 0, 4, 7, 1), "shifted below 0: kept, as llama.cpp");
    const int32_t p2[1] = { 5 };
    REQUIRE(put(&f, 0, 1, p2, NULL, NULL, NULL) == 1, "neither");
    const uint32_t cell = (uint32_t)f.c.scatter.idx[0];
    CHECK(ext_is(s0, cell, 0, 0, KVC_TOKEN_NULL), "a ubatch with neither sets nothing (cell %u)", cell);
    kvc_unified_clear(&f.c);
    CHECK(ext_is(s0, 0, 0, 0, KVC_TOKEN_NULL) && ext_is(s1, 2, 0, 0, KVC_TOKEN_NULL), "cleared");
    kvc_unified_free(&f.c);

    REQUIRE(fixture_init(&f, false, true, KVC_SEM_2026) == KVC_OK, "init ple");
    REQUIRE(put(&f, 0, 2, pos, NULL, NULL, NULL) == 1, "embeddings");
    REQUIRE(put(&f, 0, 1, pos + 2, NULL, NULL, tok) == 1, "tokens");
    CHECK(ext_is(&f.c.cells, 0, 0, 0, 77) && ext_is(&f.c.cells, 1, 0, 0, 77) && ext_is(&f.c.cells, 2, 0, 0, 1),
          "the per-layer-embedding token where the ubatch has none");
    kvc_unified_free(&f.c);
}

static void test_mask(void) {
    fixture f;
    REQUIRE(fixture_init(&f, false, false, KVC_SEM_2026) == KVC_OK, "init");
    /* an image at position 1: a 2 x 2 grid after a text token */
    const int32_t pos[5] = { 0, 1, 1, 1, 1 }, x[5] = { 0, 0, 1, 0, 1 }, y[5] = { 0, 0, 0, 1, 1 };
    REQUIRE(put(&f, 0, 5, pos, x, y, NULL) == 1, "place");
    int32_t ids[5] = { 0, 0, 0, 0, 0 };
    uint32_t off[6] = { 0, 1, 2, 3, 4, 5 };
    const kvc_ubatch ub = { .n_tokens = 5, .n_seq_tokens = 1, .n_seqs = 5, .pos = pos, .seq_off = off,
                            .seq_ids = ids, .pos_x = x, .pos_y = y };
    const uint32_t n_kv = kvc_unified_stream_n_kv(&f.c, 0);
    uint8_t *m = malloc((size_t)5 * n_kv);
    REQUIRE(m, "alloc");
    kvc_err err;
    REQUIRE(kvc_unified_kq_mask_2026(&f.c, &ub, true, false, KVC_MASK_BOOL, m, &err) == KVC_OK, "mask");
    for (uint32_t t = 0; t < 5; t++) {
        for (uint32_t j = 0; j < 5; j++) {
            CHECK(m[t * n_kv + j] == (j <= t), "token %u cell %u: %u", t, j, m[t * n_kv + j]);
        }
    }
    REQUIRE(kvc_unified_kq_mask_2026(&f.c, &ub, false, false, KVC_MASK_BOOL, m, &err) == KVC_OK, "non-causal");
    CHECK(m[0 * n_kv + 4] == 1 && m[1 * n_kv + 4] == 1, "non-causal: all seen");
    free(m);
    kvc_unified_free(&f.c);
}

static uint8_t *write_state(kvc_unified *c, int32_t s, unsigned lay, size_t *n) {
    *n = kvc_unified_state_size_lay(c, s, lay);
    uint8_t *b = malloc(*n ? *n : 1);
    size_t w = 0;
    if (b && kvc_unified_state_write_range_lay(c, s, lay, 0, b, *n, &w) != KVC_OK) {
        free(b);
        return NULL;
    }
    return b;
}

/* Read the first cut bytes of a whole state (the code). */
static int read_cut(kvc_unified *const *one, const uint8_t *data, size_t cut, unsigned lay, kvc_err *err) {
    size_t used = 0;
    return kvc_unified_state_read_parts_lay(one, 1, -1, data, cut, 0, lay, &used, NULL, err);
}

static void test_state(unsigned lay, bool per_seq) {
    fixture a, b;
    REQUIRE(fixture_init(&a, per_seq, false, KVC_SEM_2026) == KVC_OK && fixture_init(&b, per_seq, false,
                                                                                      KVC_SEM_2026) == KVC_OK,
            "init");
    const int32_t pos[4] = { 0, 1, 1, 2 }, x[4] = { -1, 2, 3, 4 }, y[4] = { 5, 6, 7, 8 }, tok[4] = { 9, 10, 11, 12 };
    REQUIRE(put(&a, 0, 4, pos, x, y, tok) == 1 && put(&a, 1, 2, pos, NULL, NULL, tok) == 1, "place");
    size_t n = 0, n_seq = 0, n_back = 0;
    uint8_t *whole = write_state(&a.c, -1, lay, &n), *seq = write_state(&a.c, 0, lay, &n_seq);
    REQUIRE(whole && seq, "write");
    const size_t n_plain = kvc_unified_state_size_lay(&a.c, -1, lay & ~(unsigned)(KVC_LAYOUT_EXT_XY |
                                                                                 KVC_LAYOUT_EXT_TOK));
    CHECK(n_plain == 0, "no layout without the extension for a cache with it");
    kvc_err err;
    size_t used = 0;
    unsigned found = 0;
    kvc_unified *one[1] = { &b.c };
    /* every cut is refused and changes nothing */
    REQUIRE(put(&b, 1, 1, pos, x, y, tok) == 1, "something in b");
    uint8_t *before = write_state(&b.c, -1, lay, &n_back);
    for (size_t cut = 0; cut < n; cut++) {
        CHECK(read_cut(one, whole, cut, lay, &err) == KVC_E_STATE, "cut at %zu", cut);
    }
    size_t n_after = 0;
    uint8_t *after = write_state(&b.c, -1, lay, &n_after);
    CHECK(after && n_after == n_back && memcmp(before, after, n_back) == 0, "nothing changed");
    free(before);
    free(after);
    CHECK(kvc_unified_state_read_parts_lay(one, 1, -1, whole, n, 0, lay, &used, &found, &err) == KVC_OK &&
          used == n, "read whole: %s", err.msg);
    uint8_t *back = write_state(&b.c, -1, lay, &n_back);
    CHECK(back && n_back == n && memcmp(back, whole, n) == 0, "written back the same");
    free(back);
    /* found from the bytes */
    CHECK(kvc_unified_state_read_parts_lay(one, 1, -1, whole, n, 0, KVC_LAYOUT_DETECT | KVC_LAYOUT_STREAMS |
                                           KVC_LAYOUT_PREFIX, &used, &found, &err) == KVC_OK &&
          (found & ~(unsigned)(KVC_LAYOUT_PREFIX | KVC_LAYOUT_SWA_TRIM)) == (lay & ~(unsigned)(KVC_LAYOUT_PREFIX |
                                                                                             KVC_LAYOUT_SWA_TRIM)),
          "detected %x (%s)", found, err.msg);
    /* a sequence's state read back into its sequence: placed anew, the same extensions */
    CHECK(kvc_unified_state_read_parts_lay(one, 1, 0, seq, n_seq, 0, lay, &used, &found, &err) == KVC_OK,
          "read seq: %s", err.msg);
    back = write_state(&b.c, 0, lay, &n_back);
    CHECK(back && n_back == n_seq && memcmp(back, seq, n_seq) == 0, "sequence written back the same");
    free(back);
    free(whole);
    free(seq);
    kvc_unified_free(&a.c);
    kvc_unified_free(&b.c);
}

static void test_refusals(void) {
    fixture f;
    CHECK(fixture_init(&f, false, false, KVC_SEM_2025) == KVC_E_ARG, "the seed's semantics has no extension");
    const int32_t il[1] = { 0 };
    const uint32_t w[1] = { WIDTH };
    const kvc_unified_params p = {
        .kv_size = SIZE, .semantics = KVC_SEM_2026, .n_seq_max = 2, .n_pad = 1, .swa_type = KVC_SWA_NONE,
        .type_k = KVC_TYPE_F32, .type_v = KVC_TYPE_F32, .v_trans = true, .n_layer = 1, .layer_il = il,
        .n_embd_k = w, .n_embd_v = w,
    };
    REQUIRE(fixture_attach(&f.c, &p, f.k, sizeof f.k, f.v, sizeof f.v) == KVC_OK, "plain");
    const int32_t pos[1] = { 0 }, x[1] = { 1 };
    CHECK(put(&f, 0, 1, pos, x, x, NULL) == KVC_E_ARG && f.c.cells.used == 0, "2-D needs the extension");
    CHECK(put(&f, 0, 1, pos, NULL, NULL, x) == 1, "token ids alone are taken");
    kvc_unified_free(&f.c);
}

int main(void) {
    test_cells();
    test_mask();
    test_state(LAY_12, false);
    test_state(LAY_12, true);
    test_state(LAY_8, false);
    test_state(LAY_8 | KVC_LAYOUT_PREFIX, true);
    test_refusals();
    printf("test_cell_ext: %d checks, %d failed\n", n_checks, n_failed);
    return n_failed != 0;
}
