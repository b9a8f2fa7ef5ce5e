/* Tests of undoing find_slot calls exactly (kvc_unified_mark_take / kvc_unified_rewind) and of
 * the two-step K-shift (kvc_unified_k_shift_prepare / _run): after a rewind the cells, their
 * index structures, head, n and the undo log are as at the mark, also when the stack grew
 * in between and when a find_slot failed for lack of memory; a rewind past a commit is refused
 * without a change; a prepared K-shift that is not run changes nothing. */
#include "kvc_kshift.h"
#include "kvc_slot.h"
#include "kvc_unified_ops.h"

#include <stdio.h>
#include <string.h>

#include "check.h"

#define SIZE 128

static int make(kvc_unified *c) {
    const int32_t il[1] = { 0 };
    const uint32_t ek[1] = { 8 }, ev[1] = { 8 };
    kvc_unified_params p;
    memset(&p, 0, sizeof p);
    p.kv_size = SIZE;
    p.n_seq_max = 4;
    p.n_pad = 32;
    p.type_k = KVC_TYPE_F16;
    p.type_v = KVC_TYPE_F16;
    p.n_layer = 1;
    p.layer_il = il;
    p.n_embd_k = ek;
    p.n_embd_v = ev;
    return kvc_unified_init(c, &p, NULL);
}

/* Place n tokens of sequence s (and t when t >= 0) at positions p0.. */
static int place(kvc_unified *c, uint32_t n, int32_t p0, int32_t s, int32_t t) {
    int32_t pos[64];
    uint32_t off[65];
    int32_t ids[128];
    uint32_t k = 0;
    for (uint32_t i = 0; i < n; i++) {
        pos[i] = p0 + (int32_t)i;
        off[i] = k;
        ids[k++] = s;
        if (t >= 0) {
            ids[k++] = t;
        }
    }
    off[n] = k;
    const kvc_ubatch ub = { n, 1, n, pos, off, ids, NULL, NULL, NULL };
    return kvc_unified_find_slot(c, &ub);
}

typedef struct seen {
    int32_t pos[SIZE], shift[SIZE];
    uint64_t seq[SIZE];
    uint32_t used, used_max_p1, head, n, n_spans, n_cells;
    int32_t lo[4], hi[4];
} seen;

static void look(const kvc_unified *c, seen *v) {
    memcpy(v->pos, c->cells.pos, sizeof v->pos);
    memcpy(v->shift, c->cells.shift, sizeof v->shift);
    for (uint32_t i = 0; i < SIZE; i++) {
        v->seq[i] = kvc_cells_seq_word(&c->cells, i, 0);
    }
    v->used = c->cells.used;
    v->used_max_p1 = c->cells.used_max_p1;
    v->head = c->head;
    v->n = c->n;
    v->n_spans = c->undo.n_spans;
    v->n_cells = c->undo.n_cells;
    for (int s = 0; s < 4; s++) {
        v->lo[s] = kvc_unified_seq_pos_min(c, s);
        v->hi[s] = kvc_unified_seq_pos_max(c, s);
    }
}

static int same(const seen *a, const seen *b) { return memcmp(a, b, sizeof *a) == 0; }

static void test_rewind(void) {
    kvc_unified c;
    seen at_mark, now;
    kvc_unified_mark m;
    CHECK(make(&c) == KVC_OK, "init");
    for (int i = 0; i < 6; i++) {
        CHECK(place(&c, 5, 10 * i, i % 3, i % 2 ? 3 : -1) == 1, "setup slot %d", i);
    }
    kvc_unified_seq_rm(&c, 1, 10, 15);     /* a hole the next slots can reuse */
    CHECK(place(&c, 2, 100, 0, -1) == 1, "uncommitted slot before the mark");
    look(&c, &at_mark);
    kvc_unified_mark_take(&c, &m);

    /* enough slots to grow the undo log past its first capacity */
    for (int i = 0; i < 12; i++) {
        CHECK(place(&c, 7, 200 + 10 * i, i % 4, -1) == 1, "slot %d after the mark", i);
    }
    CHECK(place(&c, 64, 500, 2, -1) == 0, "a slot with no room");
    kvc_fail_alloc_after = 1;
    CHECK(place(&c, 3, 600, 1, -1) == KVC_E_NOMEM || c.undo.n_spans < c.undo.cap_spans, "a slot without memory");
    kvc_fail_alloc_after = 0;
    CHECK(kvc_unified_rewind(&c, &m) == KVC_OK, "rewind");
    look(&c, &now);
    CHECK(same(&now, &at_mark), "state after the rewind differs from the mark");

    /* the slot taken before the mark is still undone by restore */
    kvc_unified_restore(&c);
    CHECK(c.cells.pos[c.head] == -1 || c.cells.used == at_mark.used - 2, "restore after the rewind");

    /* a commit since the mark: refused, nothing changes */
    look(&c, &at_mark);
    kvc_unified_mark_take(&c, &m);
    CHECK(place(&c, 2, 700, 0, -1) == 1, "slot");
    CHECK(place(&c, 2, 710, 0, -1) == 1, "slot");
    kvc_unified_mark_take(&c, &m);
    kvc_unified_commit(&c);
    look(&c, &at_mark);
    CHECK(kvc_unified_rewind(&c, &m) == KVC_E_ARG, "rewind past a commit");
    look(&c, &now);
    CHECK(same(&now, &at_mark), "a refused rewind changed the cache");
    kvc_unified_free(&c);
}

static void test_kshift_prepare_without_run(void) {
    kvc_unified c;
    kvc_rope_params p;
    const uint32_t hd[1] = { 8 };
    kvc_kshift_work w;
    uint16_t k[SIZE * 8], v[SIZE * 8], k0[SIZE * 8];
    CHECK(make(&c) == KVC_OK, "init");
    for (int i = 0; i < SIZE * 8; i++) {
        k[i] = (uint16_t)(0x3c00 + i % 977);
        v[i] = 0;
    }
    memcpy(k0, k, sizeof k);
    kvc_unified_set_layer_buffers(&c, 0, (uint8_t *)k, (uint8_t *)v);
    CHECK(place(&c, 16, 0, 0, -1) == 1, "slot");
    kvc_unified_seq_add(&c, 0, 0, -1, 3);
    kvc_rope_params_init(&p, 8);
    for (int n = 1; n <= 3; n++) {
        kvc_fail_alloc_after = n;
        const int rc = kvc_unified_k_shift_prepare(&c, &p, hd, &w, NULL);
        kvc_fail_alloc_after = 0;
        CHECK(rc == KVC_E_NOMEM || rc == KVC_OK, "prepare %d: %d", n, rc);
        if (rc == KVC_OK) {
            kvc_kshift_work_free(&w);
        }
        CHECK(memcmp(k, k0, sizeof k) == 0, "a prepare changed K");
    }
    CHECK(kvc_unified_k_shift_prepare(&c, &p, hd, &w, NULL) == KVC_OK, "prepare");
    CHECK(kvc_unified_k_shift_run(&c, &p, hd, &w, NULL) == KVC_OK, "run");
    CHECK(w.shift == NULL && w.scratch == NULL, "run releases the work");
    CHECK(memcmp(k, k0, sizeof k) != 0, "run rotated nothing");
    kvc_unified_free(&c);
}

int main(void) {
    test_rewind();
    test_kshift_prepare_without_run();
    printf("test_rewind: %d checks, %d failed\n", n_checks, n_failed);
    return n_failed ? 1 : 0;
}
