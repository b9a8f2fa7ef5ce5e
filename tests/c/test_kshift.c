/* Tests of the unified cache's K-shift over its memory (csrc/kvc_kshift.c), of the defrag
 * runs (kvc_unified_defrag_runs) and of update() (csrc/kvc_update.c): every layer rotated as
 * kvc_rope_shift_rows rotates it, rejected calls and failed allocations leave the memory
 * unchanged, layers without memory are skipped, the runs are exactly the moves of the plan, and
 * an update of two caches changes neither when the second one's rotation is refused. */
#include "kvc_defrag.h"
#include "kvc_kshift.h"
#include "kvc_quant.h"
#include "kvc_slot.h"
#include "kvc_update.h"
#include "kvc_unified_ops.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"

#define SIZE 32
#define HEAD 32

static void fill(float *x, size_t n, uint32_t seed) {
    for (size_t i = 0; i < n; i++) {
        seed = seed * 1664525u + 1013904223u;
        x[i] = (float)(seed >> 8) / (float)(1u << 24) * 4.0f - 2.0f;
    }
}

/* A cache of two layers (2 and 1 heads of HEAD) of `type` K, its memory and shifted cells. */
typedef struct fixture {
    kvc_unified c;
    uint8_t *k[2];
    uint8_t *v[2];
    size_t k_bytes[2];
} fixture;

static int fixture_init(fixture *f, int32_t type) {
    const int32_t il[2] = { 0, 1 };
    const uint32_t ek[2] = { 2 * HEAD, HEAD }, ev[2] = { 4, 4 };
    kvc_unified_params p;
    memset(&p, 0, sizeof p);
    p.kv_size = SIZE;
    p.n_seq_max = 2;
    p.n_pad = 32;
    p.type_k = type;
    p.type_v = KVC_TYPE_F32;
    p.n_layer = 2;
    p.layer_il = il;
    p.n_embd_k = ek;
    p.n_embd_v = ev;
    if (kvc_unified_init(&f->c, &p, NULL) != KVC_OK) {
        return -1;
    }
    for (int l = 0; l < 2; l++) {
        const int64_t n = (int64_t)SIZE * ek[l];
        float *x = malloc((size_t)n * sizeof(float));
        f->k_bytes[l] = f->c.layers[l].k_row_bytes * SIZE;
        f->k[l] = malloc(f->k_bytes[l]);
        f->v[l] = calloc(SIZE, f->c.layers[l].v_row_bytes);
        fill(x, (size_t)n, 7u + (uint32_t)l);
        kvc_quantize_row(type, x, f->k[l], n);
        free(x);
        kvc_unified_set_layer_buffers(&f->c, (uint32_t)l, f->k[l], f->v[l]);
    }
    /* cells 0..9 of sequence 0 at positions 0..9, then shift positions 3.. by 5 */
    kvc_ubatch ub;
    memset(&ub, 0, sizeof ub);
    int32_t pos[10];
    uint32_t off[11];
    int32_t ids[10];
    for (int i = 0; i < 10; i++) {
        pos[i] = i;
        off[i] = (uint32_t)i;
        ids[i] = 0;
    }
    off[10] = 10;
    memset(&ub, 0, sizeof ub);
    ub.n_tokens = 10;
    ub.n_seq_tokens = 1;
    ub.n_seqs = 10;
    ub.pos = pos;
    ub.seq_off = off;
    ub.seq_ids = ids;
    if (kvc_unified_find_slot(&f->c, &ub) != 1) {
        return -1;
    }
    kvc_unified_commit(&f->c);
    kvc_unified_seq_add(&f->c, 0, 3, -1, 5);
    return 0;
}

static void fixture_free(fixture *f) {
    for (int l = 0; l < 2; l++) {
        free(f->k[l]);
        free(f->v[l]);
    }
    kvc_unified_free(&f->c);
}

static void test_matches_rows(int32_t type) {
    fixture f;
    if (fixture_init(&f, type) != 0) {
        CHECK(0, "fixture for type %d", (int)type);
        return;
    }
    kvc_rope_params p[2];
    const uint32_t hd[2] = { HEAD, HEAD };
    kvc_rope_params_init(&p[0], HEAD);
    kvc_rope_params_init(&p[1], 16);
    p[1].mode = KVC_ROPE_NEOX;
    p[1].freq_base = 500.0f;

    /* the expectation: each layer's rows through kvc_rope_shift_rows with the cells' shifts */
    int32_t shift[SIZE];
    kvc_unified_k_shift(&f.c, shift);
    CHECK(shift[2] == 0 && shift[3] == 5 && shift[9] == 5 && shift[10] == 0, "shifts");
    uint8_t *want[2];
    for (int l = 0; l < 2; l++) {
        want[l] = malloc(f.k_bytes[l]);
        memcpy(want[l], f.k[l], f.k_bytes[l]);
        CHECK(kvc_rope_shift_rows(type, want[l], SIZE, (uint32_t)(f.c.layers[l].n_embd_k / HEAD), HEAD,
                                  f.c.layers[l].k_row_bytes, shift, &p[l], NULL) == KVC_OK, "reference");
    }
    kvc_err err;
    CHECK(kvc_unified_apply_k_shift(&f.c, p, hd, &err) == KVC_OK, "apply: %s", err.msg);
    for (int l = 0; l < 2; l++) {
        CHECK(memcmp(f.k[l], want[l], f.k_bytes[l]) == 0, "type %d layer %d rotated as the rows", (int)type, l);
        free(want[l]);
    }
    CHECK(f.c.cells.has_shift, "the shifts are not reset by the data pass");
    fixture_free(&f);
}

static void test_rejections_and_nomem_leave_memory(void) {
    fixture f;
    if (fixture_init(&f, KVC_TYPE_Q8_0) != 0) {
        CHECK(0, "fixture");
        return;
    }
    uint8_t *orig[2];
    for (int l = 0; l < 2; l++) {
        orig[l] = malloc(f.k_bytes[l]);
        memcpy(orig[l], f.k[l], f.k_bytes[l]);
    }
    kvc_rope_params p[2];
    kvc_rope_params_init(&p[0], HEAD);
    kvc_rope_params_init(&p[1], HEAD);
    kvc_err err;
    uint32_t hd[2] = { HEAD, 48 };                       /* 32 is not a multiple of 48 */
    err.msg[0] = 0;
    CHECK(kvc_unified_apply_k_shift(&f.c, p, hd, &err) == KVC_E_ARG && strstr(err.msg, "layer 1"), "%s", err.msg);
    hd[1] = 16;                                          /* not a whole q8_0 block */
    CHECK(kvc_unified_apply_k_shift(&f.c, p, hd, &err) == KVC_E_ARG && strstr(err.msg, "block"), "%s", err.msg);
    hd[1] = HEAD;
    p[1].n_rot = 34;                                     /* larger than the head */
    CHECK(kvc_unified_apply_k_shift(&f.c, p, hd, &err) == KVC_E_ARG && strstr(err.msg, "n_rot"), "%s", err.msg);
    p[1].n_rot = HEAD;
    for (int k = 1; k <= 2; k++) {
        kvc_fail_alloc_after = k;
        CHECK(kvc_unified_apply_k_shift(&f.c, p, hd, &err) == KVC_E_NOMEM, "allocation %d", k);
        kvc_fail_alloc_after = 0;
    }
    for (int l = 0; l < 2; l++) {
        CHECK(memcmp(f.k[l], orig[l], f.k_bytes[l]) == 0, "layer %d unchanged", l);
    }
    /* a layer without memory is skipped, the other one rotated */
    kvc_unified_set_layer_buffers(&f.c, 0, NULL, f.v[0]);
    CHECK(kvc_unified_apply_k_shift(&f.c, p, hd, NULL) == KVC_OK, "apply without layer 0 memory");
    CHECK(memcmp(f.k[0], orig[0], f.k_bytes[0]) == 0, "layer 0 untouched");
    CHECK(memcmp(f.k[1], orig[1], f.k_bytes[1]) != 0, "layer 1 rotated");
    kvc_unified_set_layer_buffers(&f.c, 0, f.k[0], f.v[0]);
    for (int l = 0; l < 2; l++) {
        free(orig[l]);
    }
    fixture_free(&f);
}

static void test_defrag_runs(void) {
    fixture f;
    if (fixture_init(&f, KVC_TYPE_F32) != 0) {
        CHECK(0, "fixture");
        return;
    }
    /* hand-made plan: cells 6,7 -> 1,2 (one run), 9 -> 4, 8 stays, and an unmoved tail */
    const uint32_t plan[10] = { 0, 10, 10, 10, 10, 10, 1, 2, 8, 4 };
    memcpy(f.c.defrag_ids, plan, sizeof plan);
    f.c.n_defrag_ids = 10;
    f.c.defrag_pending = true;   /* as a defrag_prepare leaves it */
    uint32_t runs[9];
    CHECK(kvc_unified_defrag_runs(&f.c, NULL) == 2, "count");
    memset(runs, 0xff, sizeof runs);
    CHECK(kvc_unified_defrag_runs(&f.c, runs) == 2, "count");
    CHECK(runs[0] == 6 && runs[1] == 1 && runs[2] == 2, "first run");
    CHECK(runs[3] == 9 && runs[4] == 4 && runs[5] == 1 && runs[6] == 0xffffffffu, "second run, no more");
    /* defrag_move moves exactly those rows */
    float *k0 = (float *)f.k[0];
    const size_t w = 2 * HEAD;
    float row6 = k0[6 * w], row7 = k0[7 * w], row9 = k0[9 * w], row8 = k0[8 * w];
    kvc_unified_defrag_move(&f.c);
    CHECK(k0[1 * w] == row6 && k0[2 * w] == row7 && k0[4 * w] == row9 && k0[8 * w] == row8, "moved rows");
    CHECK(!f.c.defrag_pending, "applied");
    k0[1 * w] = -1.0f;
    kvc_unified_defrag_move(&f.c);
    CHECK(k0[1 * w] == -1.0f && kvc_unified_defrag_runs(&f.c, NULL) == 2, "applied once, the plan still readable");
    f.c.n_defrag_ids = 0;
    CHECK(kvc_unified_defrag_runs(&f.c, runs) == 0, "empty plan");
    fixture_free(&f);
}

static void test_update(void) {
    fixture a, b;
    if (fixture_init(&a, KVC_TYPE_F32) != 0 || fixture_init(&b, KVC_TYPE_F16) != 0) {
        CHECK(0, "fixtures");
        return;
    }
    kvc_rope_params good[2], bad[2];
    const uint32_t hd[2] = { HEAD, HEAD };
    kvc_rope_params_init(&good[0], HEAD);
    kvc_rope_params_init(&good[1], HEAD);
    bad[0] = good[0];
    bad[1] = good[1];
    bad[1].n_rot = 3;   /* odd: refused */
    int32_t shift_a[SIZE], shift_b[SIZE];
    kvc_update_opts opts[2] = { { good, hd, 65536, shift_a, false }, { bad, hd, 65536, shift_b, false } };
    kvc_update_result res[2];
    kvc_unified *both[2] = { &a.c, &b.c };
    uint8_t *ka = malloc(a.k_bytes[0]), *want = malloc(a.k_bytes[0]);
    memcpy(ka, a.k[0], a.k_bytes[0]);
    kvc_err err = { 0, "" };

    CHECK(kvc_unified_update_parts(both, 2, opts, res, &err) == KVC_E_ARG, "the second rotation is refused");
    CHECK(strstr(err.msg, "layer 1") != NULL, "%s", err.msg);
    CHECK(memcmp(a.k[0], ka, a.k_bytes[0]) == 0 && a.c.cells.has_shift && b.c.cells.has_shift, "nothing changed");
    kvc_unified *twice[2] = { &a.c, &a.c };
    CHECK(kvc_unified_update_parts(twice, 2, opts, res, NULL) == KVC_E_ARG, "the same cache twice");

    /* the expectation for a: its rows rotated by the shifts */
    int32_t shift[SIZE];
    kvc_unified_k_shift(&a.c, shift);
    memcpy(want, a.k[0], a.k_bytes[0]);
    kvc_rope_shift_rows(KVC_TYPE_F32, want, SIZE, 2, HEAD, a.c.layers[0].k_row_bytes, shift, &good[0], NULL);
    opts[1].rope = NULL;   /* b: no RoPE, the shifts are dropped */
    a.c.do_defrag = true;
    CHECK(kvc_unified_update_parts(both, 2, opts, res, &err) == KVC_OK, "%s", err.msg);
    CHECK(res[0].shifted && res[0].rotated && !res[0].defragged && res[0].need_reserve, "a rotated");
    CHECK(memcmp(a.k[0], want, a.k_bytes[0]) == 0, "a's keys rotated by its shifts");
    CHECK(memcmp(shift_a, shift, sizeof shift) == 0, "the shifts handed back");
    CHECK(res[1].shifted && !res[1].rotated && !res[1].need_reserve, "b dropped its shifts");
    CHECK(!a.c.cells.has_shift && !b.c.cells.has_shift && !a.c.do_defrag, "reset; the defrag had nothing to do");

    /* a defrag: a hole at cell 2, the last cell fills it */
    kvc_unified_seq_rm(&a.c, 0, 2, 5);
    a.c.do_defrag = true;
    kvc_update_opts plain = { NULL, NULL, 65536, NULL, false };
    CHECK(kvc_unified_update(&a.c, &plain, &res[0], &err) == KVC_OK, "%s", err.msg);
    CHECK(!res[0].shifted && res[0].defragged && res[0].moved && res[0].need_reserve, "defragged");
    CHECK(kvc_unified_defrag_runs(&a.c, NULL) > 0 && a.c.cells.used_max_p1 == a.c.cells.used && a.c.cells.used == 9 && !a.c.defrag_pending, "compact");

    /* without memory the owner does the work: need_reserve for a shift alone */
    kvc_unified_set_layer_buffers(&b.c, 0, NULL, NULL);
    kvc_unified_set_layer_buffers(&b.c, 1, NULL, NULL);
    kvc_unified_seq_add(&b.c, 0, 0, -1, 1);
    CHECK(kvc_unified_update(&b.c, &plain, &res[1], &err) == KVC_OK, "%s", err.msg);
    CHECK(res[1].shifted && !res[1].rotated && res[1].need_reserve, "metadata only: the owner rotates");
    kvc_unified_set_layer_buffers(&b.c, 0, b.k[0], b.v[0]);
    kvc_unified_set_layer_buffers(&b.c, 1, b.k[1], b.v[1]);
    free(ka);
    free(want);
    fixture_free(&a);
    fixture_free(&b);
}

int main(void) {
    const int32_t types[] = { KVC_TYPE_F32, KVC_TYPE_F16, KVC_TYPE_BF16, KVC_TYPE_Q8_0, KVC_TYPE_Q4_0,
                              KVC_TYPE_Q4_1, KVC_TYPE_Q5_0, KVC_TYPE_Q5_1, KVC_TYPE_IQ4_NL };
    for (size_t i = 0; i < sizeof types / sizeof types[0]; i++) {
        test_matches_rows(types[i]);
    }
    test_rejections_and_nomem_leave_memory();
    test_defrag_runs();
    test_update();
    printf("test_kshift: %d checks, %d failed\n", n_checks, n_failed);
    return n_failed != 0;
}
