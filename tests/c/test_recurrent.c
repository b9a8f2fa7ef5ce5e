/* Tests of the recurrent cache (csrc/kvc_recurrent.c) on a scripted workload whose every step is
 * worked out by hand from llama.cpp's rules: a cell per sequence's state, copy-on-share when a
 * sequence shared with another gets tokens of its own (s_copy then reads the shared state),
 * s_mask zeroing new states once, the warning for a state that does not continue where it
 * stopped, seq_rm refusing to cut a state, shifts and divisions of a state's position, states
 * written and read back, seq_keep. The script runs with three sequence ids from one word of the
 * set and with ids spread over several words (130 and 256 sequences): the same answers. */
#include "kvc_recurrent_ops.h"
#include "kvc_types.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"

static int make(kvc_recurrent *c, uint32_t n_seq_max, uint32_t kv_size, float *k, float *v) {
    const uint32_t w[1] = { 2 };
    kvc_recurrent_params p = { kv_size, n_seq_max, KVC_TYPE_F32, KVC_TYPE_F32, 1, w, w, KVC_REC_2025, 0 };
    const int rc = kvc_recurrent_init(c, &p, NULL);
    if (rc == KVC_OK && k) {
        kvc_recurrent_set_layer_buffers(c, 0, (uint8_t *)k, (uint8_t *)v);
    }
    return rc;
}

/* find_slot of groups of n_seq_tokens tokens: group g holds the ids ids[off[g] .. off[g+1]). */
static int place(kvc_recurrent *c, uint32_t n_seqs, uint32_t n_seq_tokens, const int32_t *pos, const uint32_t *off,
                 const int32_t *ids) {
    const kvc_ubatch ub = { n_seqs * n_seq_tokens, n_seq_tokens, n_seqs, pos, off, ids, NULL, NULL, NULL };
    kvc_err err = { 0, "" };
    return kvc_recurrent_find_slot(c, &ub, &err);
}

static bool holds(const kvc_recurrent *c, uint32_t i, int32_t s) {
    return kvc_seqs_has(c->cells.seq, c->cells.size, i, s);
}

static void script(uint32_t n_seq_max, uint32_t kv_size, int32_t A, int32_t B, int32_t C) {
    kvc_recurrent c, d;
    float *k = calloc((size_t)kv_size * 2, sizeof(float)), *v = calloc((size_t)kv_size * 2, sizeof(float));
    REQUIRE(make(&c, n_seq_max, kv_size, k, v) == KVC_OK, "init");
    const kvc_rec_cells *t = &c.cells;

    /* A and B, two tokens each: cells 0 and 1, at their last positions */
    {
        const int32_t pos[4] = { 0, 1, 0, 1 }, ids[2] = { A, B };
        const uint32_t off[3] = { 0, 1, 2 };
        CHECK(place(&c, 2, 2, pos, off, ids) == 1, "%u: placed", n_seq_max);
    }
    CHECK(t->pos[0] == 1 && t->pos[1] == 1 && t->pos[2] == -1 && holds(&c, 0, A) && holds(&c, 1, B), "two cells");
    CHECK(t->tail[A] == 0 && t->tail[B] == 1 && t->head == 0 && t->n == 2 && t->used == 2, "records");
    float mask[2];
    int32_t copy[2];
    CHECK(kvc_recurrent_s_mask(&c, 2, mask) == KVC_OK && mask[0] == 0.0f && mask[1] == 0.0f, "new states start at zero");
    CHECK(kvc_recurrent_s_copy(&c, 2, copy) == KVC_OK && copy[0] == 0 && copy[1] == 1, "each state from its cell");
    CHECK(kvc_recurrent_s_mask(&c, 2, mask) == KVC_OK && mask[0] == 1.0f, "zeroed once");
    const float rows[4] = { 1, 2, 3, 4 };
    CHECK(kvc_recurrent_store(&c, 0, 2, rows, rows) == KVC_OK && k[2] == 3.0f && v[3] == 4.0f, "rows at head");
    CHECK(kvc_recurrent_store(&c, 0, kv_size + 1, rows, rows) == KVC_E_ARG, "past the last cell");

    /* C shares A's state, then gets a token of its own: copy-on-share into cell 2 */
    kvc_recurrent_seq_cp(&c, A, C, -1, -1);
    CHECK(holds(&c, 0, A) && holds(&c, 0, C) && t->tail[C] == 0, "shared");
    {
        const int32_t pos[1] = { 2 }, ids[1] = { C };
        const uint32_t off[2] = { 0, 1 };
        CHECK(place(&c, 1, 1, pos, off, ids) == 1 && c.n_warn == 0, "C continues at 2");
    }
    CHECK(t->tail[C] == 2 && holds(&c, 2, C) && !holds(&c, 0, C) && t->pos[2] == 2 && t->head == 2 && t->used == 3,
          "C in a cell of its own");
    CHECK(kvc_recurrent_s_copy(&c, 1, copy) == KVC_OK && copy[0] == 0, "C's state copied from A's cell");
    CHECK(kvc_recurrent_s_copy(&c, 1, copy) == KVC_OK && copy[0] == 2, "once");

    /* A jumps from position 1 to 5: placed, with the reference's warning */
    {
        const int32_t pos[1] = { 5 }, ids[1] = { A };
        const uint32_t off[2] = { 0, 1 };
        CHECK(place(&c, 1, 1, pos, off, ids) == 1 && c.n_warn == 1 && strstr(c.warn, "non-consecutive token position 5 after 1"),
              "warned: %s", c.warn);
    }
    CHECK(t->pos[0] == 5 && t->head == 0 && t->n == 1, "A stays in cell 0");

    /* removals: B whole; a range inside A's state would cut it */
    CHECK(kvc_recurrent_seq_rm(&c, B, -1, -1) && t->tail[B] == -1 && t->pos[1] == -1 && t->used == 2, "B removed");
    CHECK(!kvc_recurrent_seq_rm(&c, A, 2, 4) && t->pos[0] == 5, "a cut refused, nothing changes");
    CHECK(!kvc_recurrent_seq_rm(&c, -1, 0, 3), "all sequences: only nothing or everything");
    CHECK(kvc_recurrent_seq_pos_min(&c, B) == -1 && kvc_recurrent_seq_pos_max(&c, A) == 5, "ranges");

    /* C: shifted, then divided */
    kvc_recurrent_seq_add(&c, C, 0, -1, 3);
    CHECK(t->pos[2] == 5, "C shifted");
    kvc_recurrent_seq_div(&c, C, 0, 10, 2);
    CHECK(t->pos[2] == 2, "C divided");
    kvc_recurrent_seq_add(&c, C, 3, -1, 100);
    CHECK(t->pos[2] == 2, "outside the range: unchanged");

    /* the whole state, read into a fresh cache: the states in order from cell 0 */
    const size_t n = kvc_recurrent_state_size(&c, -1);
    uint8_t *blob = malloc(n);
    size_t written = 0, consumed = 0;
    kvc_err err = { 0, "" };
    CHECK(kvc_recurrent_state_write(&c, -1, blob, n, &written) == KVC_OK && written == n, "write");
    REQUIRE(make(&d, n_seq_max, kv_size, NULL, NULL) == KVC_OK, "init d");
    CHECK(kvc_recurrent_state_read(&d, -1, blob, n, &consumed, &err) == KVC_OK && consumed == n, "read: %s", err.msg);
    CHECK(d.cells.tail[A] == 0 && d.cells.tail[C] == 1 && d.cells.pos[0] == 5 && d.cells.pos[1] == 2 && d.cells.used == 2 &&
              d.cells.src[0] == 0 && d.cells.src[1] == 1 && kvc_seqs_has(d.cells.seq, kv_size, 1, C),
          "restored");
    free(blob);
    /* one sequence's state into another id */
    const size_t n1 = kvc_recurrent_state_size(&c, C);
    blob = malloc(n1);
    CHECK(kvc_recurrent_state_write(&c, C, blob, n1, &written) == KVC_OK, "write C");
    CHECK(kvc_recurrent_state_read(&d, B, blob, n1, &consumed, &err) == KVC_OK, "read into B: %s", err.msg);
    CHECK(kvc_recurrent_seq_pos_max(&d, B) == 2 && d.cells.used == 3, "B has C's state");
    CHECK(kvc_recurrent_state_read(&d, (int32_t)n_seq_max, blob, n1, &consumed, &err) == KVC_E_ARG, "no such sequence");
    free(blob);

    /* keep A only */
    kvc_recurrent_seq_keep(&c, A);
    CHECK(holds(&c, 0, A) && t->pos[2] == -1 && t->tail[C] == -1 && t->used == 1, "kept");
    kvc_recurrent_free(&d);
    kvc_recurrent_free(&c);
    free(k);
    free(v);
}

static void test_rejections(void) {
    kvc_recurrent c;
    kvc_err err = { 0, "" };
    const uint32_t w[1] = { 2 };
    kvc_recurrent_params p = { 4, KVC_MAX_SEQ + 1, KVC_TYPE_F32, KVC_TYPE_F32, 1, w, w, KVC_REC_2025, 0 };
    CHECK(kvc_recurrent_init(&c, &p, &err) == KVC_E_ARG, "past the bound: %s", err.msg);
    p.n_seq_max = 0;      /* no sequence at all: refused as the unified cache refuses it */
    CHECK(kvc_recurrent_init(&c, &p, &err) == KVC_E_ARG && strstr(err.msg, "n_seq_max (0)"), "none: %s", err.msg);
    p.n_seq_max = 8;
    CHECK(kvc_recurrent_init(&c, &p, &err) == KVC_E_ARG, "fewer cells than sequences");
    p.kv_size = 8;
    REQUIRE(kvc_recurrent_init(&c, &p, &err) == KVC_OK, "init");
    /* one sequence in two groups, or an id out of range: refused, nothing changes */
    const int32_t pos[2] = { 0, 0 }, twice[2] = { 3, 3 }, far[2] = { 3, 8 };
    const uint32_t off[3] = { 0, 1, 2 };
    CHECK(place(&c, 2, 1, pos, off, far) == KVC_E_ARG && c.cells.used == 0, "id 8 of 8");
    CHECK(place(&c, 2, 1, pos, off, twice) == KVC_E_ARG && c.cells.used == 0 && c.cells.tail[3] == -1,
          "a sequence in two groups");
    kvc_recurrent_free(&c);
}

int main(void) {
    script(3, 4, 0, 1, 2);
    script(130, 130, 0, 64, 129);
    script(256, 256, 255, 64, 3);
    test_rejections();
    printf("test_recurrent: %d checks, %d failed\n", n_checks, n_failed);
    return n_failed != 0;
}
