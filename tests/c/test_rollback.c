/* Tests of today's recurrent memory (KVC_REC_2026) and its rollback snapshots: the staged
 * sources and the zero row of find_slot, s_copy reading a snapshot plane once, seq_rm of a tail
 * as llama.cpp accepts it, rule C9's refusals (a rollback past the planes the last ubatch wrote,
 * of a shared state, a cut inside a state; a second one pending as llama.cpp), a pending rollback following its state (seq_cp,
 * seq_rm, seq_keep), and a state written from the plane a pending rollback points at. */
#include "kvc_recurrent_ops.h"
#include "kvc_types.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"

enum { SIZE = 4, RS = 4, ROWS = SIZE * (1 + RS) };

static int make(kvc_recurrent *c, uint32_t n_rs_seq, float *k, float *v) {
    const uint32_t w[1] = { 1 };
    kvc_recurrent_params p = { SIZE, SIZE, KVC_TYPE_F32, KVC_TYPE_F32, 1, w, w, KVC_REC_2026, n_rs_seq };
    const int rc = kvc_recurrent_init(c, &p, NULL);
    if (rc == KVC_OK && k) {
        kvc_recurrent_set_layer_buffers(c, 0, (uint8_t *)k, (uint8_t *)v);
    }
    return rc;
}

/* One group of n tokens of sequence s, positions p0 .. p0 + n - 1. */
static int decode(kvc_recurrent *c, int32_t s, int32_t p0, uint32_t n) {
    int32_t pos[32];
    for (uint32_t i = 0; i < n; i++) {
        pos[i] = p0 + (int32_t)i;
    }
    const uint32_t off[2] = { 0, 1 };
    const kvc_ubatch ub = { n, n, 1, pos, off, &s, NULL, NULL, NULL };
    kvc_err err = { 0, "" };
    return kvc_recurrent_find_slot(c, &ub, &err);
}

/* What the graph does after a decode of n tokens: plane p of the cell = the state p tokens back
 * (here the position it stands for, so that a read names the position it came from). */
static void compute(kvc_recurrent *c, int32_t last, uint32_t n) {
    for (uint32_t p = 0; p < n && p <= c->n_rs_seq; p++) {
        const float row = (float)(last - (int32_t)p);
        kvc_recurrent_store_plane(c, 0, p, 1, &row, &row);
    }
}

static void test_params(void) {
    kvc_recurrent c;
    const uint32_t w[1] = { 1 };
    kvc_recurrent_params p = { SIZE, SIZE, KVC_TYPE_F32, KVC_TYPE_F32, 1, w, w, KVC_REC_2025, 1 };
    CHECK(kvc_recurrent_init(&c, &p, NULL) == KVC_E_ARG, "mid-2025 keeps no snapshots");
    p.semantics = KVC_REC_2026;
    p.n_rs_seq = KVC_REC_MAX_RS_SEQ + 1;
    CHECK(kvc_recurrent_init(&c, &p, NULL) == KVC_E_ARG, "too many snapshots");
    p.semantics = 7;
    p.n_rs_seq = 0;
    CHECK(kvc_recurrent_init(&c, &p, NULL) == KVC_E_ARG, "unknown semantics");
}

/* llama.cpp's lfm2_c: 12 tokens, then 4, rollback of 4 — the planes of the 4-token decode
 * reach 3 back only; lfm2_c2: 11 + 5, the same rollback is exact. */
static void test_rollback_after(uint32_t first, uint32_t second, bool accepted) {
    kvc_recurrent c;
    float *k = calloc(ROWS, sizeof(float)), *v = calloc(ROWS, sizeof(float));
    REQUIRE(make(&c, RS, k, v) == KVC_OK, "init");
    const kvc_rec_cells *t = &c.cells;
    int32_t cp[1];
    CHECK(decode(&c, 0, 0, first) == 1, "first decode");
    CHECK(t->rs_z == 0 && t->src0[0] == 0 && t->src[0] == 0, "a new state reads the zero row");
    CHECK(kvc_recurrent_s_copy(&c, 1, cp) == KVC_OK && cp[0] == 0, "s_copy: plane 0");
    compute(&c, (int32_t)first - 1, first);
    CHECK(decode(&c, 0, (int32_t)first, second) == 1, "second decode");
    CHECK(t->src0[0] == 0 && t->snap[0] == (second - 1 < RS ? second - 1 : RS), "snapshot planes of the last ubatch");
    compute(&c, 15, second);
    CHECK(kvc_recurrent_rollback_len(&c, 0, 12) == 4, "a rollback of 4");
    CHECK(kvc_recurrent_seq_rm(&c, 0, 12, -1) == accepted, "%u + %u: rollback %s", first, second,
          accepted ? "accepted" : "refused (C9)");
    if (!accepted) {
        CHECK(t->pos[0] == 15 && t->rs_idx[0] == 0, "refused: nothing changed");
        CHECK(kvc_recurrent_seq_rm(&c, 0, 13, -1), "a rollback of 3 is within the planes");
        CHECK(t->pos[0] == 12 && t->rs_idx[0] == 3, "pending plane 3");
    } else {
        CHECK(t->pos[0] == 11 && t->rs_idx[0] == 4, "pending plane 4, the state of position 11");
        CHECK(!kvc_recurrent_seq_rm(&c, 0, 11, -1), "a second rollback waits for a decode");
    }
    const uint32_t plane = t->rs_idx[0];
    /* the state written now is the plane's (no snapshot is serialised) */
    uint8_t blob[256];
    size_t n = 0;
    CHECK(kvc_recurrent_state_write(&c, 0, blob, sizeof blob, &n) == KVC_OK, "write");
    float got;
    memcpy(&got, blob + n - 4, 4);
    CHECK(got == (float)(15 - (int32_t)plane), "the written state is position %d's", 15 - (int32_t)plane);
    CHECK(kvc_recurrent_s_copy(&c, 1, cp) == KVC_OK && cp[0] == (int32_t)(plane * SIZE), "s_copy reads plane %u",
          plane);
    CHECK(t->rs_idx[0] == 0, "once");
    CHECK(kvc_recurrent_s_copy(&c, 1, cp) == KVC_OK && cp[0] == 0, "then plane 0");
    kvc_recurrent_free(&c);
    free(k);
    free(v);
}

static void test_rules(void) {
    kvc_recurrent c;
    REQUIRE(make(&c, RS, NULL, NULL) == KVC_OK, "init");
    const kvc_rec_cells *t = &c.cells;
    CHECK(decode(&c, 0, 0, 8) == 1, "decode");
    CHECK(!kvc_recurrent_seq_rm(&c, 0, 0, 3), "C9: a range from 0 ending inside the state is refused");
    CHECK(t->pos[0] == 7 && t->tail[0] == 0, "and changes nothing");
    CHECK(kvc_recurrent_seq_rm(&c, 0, 20, -1) && t->pos[0] == 7, "a range past the state: nothing");
    CHECK(!kvc_recurrent_seq_rm(&c, 0, 2, -1), "a rollback of 6 > n_rs_seq");
    CHECK(!kvc_recurrent_seq_rm(&c, 0, 2, 5), "C9: a cut inside the state is refused");
    /* shared: refused (C9) */
    kvc_recurrent_seq_cp(&c, 0, 1, -1, -1);
    CHECK(!kvc_recurrent_rollback_ok(&c, 1, 2) && !kvc_recurrent_seq_rm(&c, 1, 6, -1), "a shared state: refused");
    CHECK(t->pos[0] == 7, "unchanged");
    kvc_recurrent_seq_rm(&c, 1, -1, -1);
    CHECK(kvc_recurrent_seq_rm(&c, 0, 6, -1) && t->rs_idx[0] == 2, "alone: accepted");
    /* the pending rollback follows the state */
    kvc_recurrent_seq_cp(&c, 0, 2, -1, -1);
    CHECK(t->rs_idx[2] == 2, "seq_cp: dst takes the pending plane");
    kvc_recurrent_seq_keep(&c, 0);
    CHECK(t->rs_idx[2] == 0 && t->rs_idx[0] == 2, "seq_keep: the others' go");
    kvc_recurrent_seq_rm(&c, 0, -1, -1);
    CHECK(t->rs_idx[0] == 0 && t->tail[0] == -1, "removed: no pending rollback left");
    CHECK(decode(&c, 0, 0, 1) == 1 && t->snap[0] == 0, "one token: no snapshot");
    CHECK(decode(&c, 0, 1, 1) == 1 && !kvc_recurrent_seq_rm(&c, 0, 1, -1), "one token back after one: refused");
    float m[1];
    CHECK(kvc_recurrent_s_mask(&c, 1, m) == KVC_E_ARG, "today: no s_mask");
    kvc_recurrent_free(&c);
}

static void test_no_snapshots(void) {
    kvc_recurrent c;
    REQUIRE(make(&c, 0, NULL, NULL) == KVC_OK, "init");
    CHECK(decode(&c, 0, 0, 8) == 1, "decode");
    CHECK(!kvc_recurrent_seq_rm(&c, 0, 7, -1), "n_rs_seq 0: every rollback refused");
    int32_t cp[1];
    CHECK(kvc_recurrent_s_copy(&c, 1, cp) == KVC_OK && cp[0] == 0, "s_copy = src0");
    CHECK(kvc_recurrent_s_copy(&c, 1, cp) == KVC_OK && cp[0] == 0, "s_copy does not move the sources");
    kvc_recurrent_free(&c);
}

/* What the hybrid memory needs of its recurrent part: a dry run over several ubatches that leaves
 * the cache as it was, and the undo of the last placement. */
static void test_prepare_unplace(void) {
    kvc_recurrent c;
    REQUIRE(make(&c, RS, NULL, NULL) == KVC_OK, "init");
    const kvc_rec_cells *t = &c.cells;
    CHECK(kvc_recurrent_unplace(&c) == KVC_E_ARG, "nothing to undo");
    CHECK(decode(&c, 0, 0, 3) == 1, "decode");
    int32_t pos[2] = { 3, 4 }, s = 0;
    const uint32_t off[2] = { 0, 1 };
    const kvc_ubatch ubs[2] = { { 1, 1, 1, pos, off, &s, NULL, NULL, NULL }, { 1, 1, 1, pos + 1, off, &s, NULL, NULL, NULL } };
    kvc_err err = { 0, "" };
    CHECK(kvc_recurrent_prepare(&c, ubs, 2, &err) == 1 && t->pos[0] == 2 && t->snap[0] == 2, "a dry run");
    CHECK(kvc_recurrent_unplace(&c) == KVC_E_ARG, "a dry run leaves nothing to undo");
    CHECK(decode(&c, 0, 3, 1) == 1 && t->pos[0] == 3 && t->snap[0] == 0, "placed");
    CHECK(kvc_recurrent_unplace(&c) == KVC_OK && t->pos[0] == 2 && t->snap[0] == 2, "undone");
    CHECK(kvc_recurrent_unplace(&c) == KVC_E_ARG, "once");
    kvc_recurrent_free(&c);
}

int main(void) {
    test_prepare_unplace();
    test_params();
    test_rollback_after(12, 4, false);
    test_rollback_after(11, 5, true);
    test_rules();
    test_no_snapshots();
    printf("test_rollback: %d checks, %d failed\n", n_checks, n_failed);
    return n_failed != 0;
}
