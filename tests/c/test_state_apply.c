/* The apply phase of a state read works from what the prepare phase validated, not from the
 * blob again: a caller's buffer that changes between the two (another thread writing into a
 * bytearray, a numpy array or an mmap while the read runs without the GIL) must not make the
 * apply read or write out of bounds. The cells restored are the ones that were validated. */
#include "kvc_state.h"
#include "kvc_types.h"
#include "kvc_unified_ops.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"

static void put_u32(uint8_t *p, uint32_t v) {
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
    p[2] = (uint8_t)(v >> 16);
    p[3] = (uint8_t)(v >> 24);
}

typedef struct cache {
    kvc_unified c;
    uint8_t *k, *v;
} cache;

/* 32 cells, 2 sequences, one f32 layer of width 2, V rows. */
static void cache_init(cache *t) {
    const int32_t il = 0;
    const uint32_t w = 2;
    const kvc_unified_params p = {
        .kv_size = 32, .n_seq_max = 2, .n_pad = 32, .n_swa = 0, .swa_type = KVC_SWA_NONE,
        .type_k = KVC_TYPE_F32, .type_v = KVC_TYPE_F32, .v_trans = false, .n_layer = 1,
        .layer_il = &il, .n_embd_k = &w, .n_embd_v = &w,
    };
    kvc_err err = { 0, "" };
    if (kvc_unified_init(&t->c, &p, &err) != KVC_OK) {
        fprintf(stderr, "kvc_unified_init: %s\n", err.msg);
        abort();
    }
    t->k = calloc(32, 8);
    t->v = calloc(32, 8);
    if (!t->k || !t->v) {
        abort();
    }
    kvc_unified_set_layer_buffers(&t->c, 0, t->k, t->v);
}

static void cache_free(cache *t) {
    kvc_unified_free(&t->c);
    free(t->k);
    free(t->v);
}

/* A whole-cache blob of three cells: (5, {0}), (6, {0, 1}), (7, {1}). */
static uint8_t *whole_blob(size_t *len) {
    cache t;
    cache_init(&t);
    const int32_t pos[3] = { 5, 6, 7 };
    const uint32_t off[4] = { 0, 1, 3, 4 };
    const int32_t ids[4] = { 0, 0, 1, 1 };
    const kvc_ubatch ub = { 3, 1, 3, pos, off, ids, NULL, NULL, NULL };
    if (kvc_unified_find_slot(&t.c, &ub) != 1) {
        abort();
    }
    kvc_unified_commit(&t.c);
    const size_t n = kvc_unified_state_size(&t.c, -1);
    uint8_t *blob = malloc(n);
    if (!blob || kvc_unified_state_write(&t.c, -1, blob, n, len) != KVC_OK) {
        abort();
    }
    cache_free(&t);
    return blob;
}

/* Prepare a read of blob, let `mutate` change the blob, apply: the validated cells arrive. */
static void check_mutation(const char *name, void (*mutate)(uint8_t *blob)) {
    size_t len;
    uint8_t *blob = whole_blob(&len);
    cache t;
    cache_init(&t);
    kvc_state_plan plan;
    kvc_err err = { 0, "" };
    int rc = kvc_unified_state_prepare(&t.c, -1, blob, len, &plan, &err);
    CHECK(rc == KVC_OK, "%s: prepare: %s", name, err.msg);
    if (rc == KVC_OK) {
        mutate(blob);
        rc = kvc_unified_state_apply(&t.c, &plan);
        CHECK(rc == KVC_OK, "%s: apply returned %d", name, rc);
        const kvc_cells *cl = &t.c.cells;
        CHECK(cl->pos[0] == 5 && kvc_cells_seq_word(cl, 0, 0) == 1, "%s: cell 0 is (%d, %llx)", name, cl->pos[0],
              (unsigned long long)kvc_cells_seq_word(cl, 0, 0));
        CHECK(cl->pos[1] == 6 && kvc_cells_seq_word(cl, 1, 0) == 3, "%s: cell 1 is (%d, %llx)", name, cl->pos[1],
              (unsigned long long)kvc_cells_seq_word(cl, 1, 0));
        CHECK(cl->pos[2] == 7 && kvc_cells_seq_word(cl, 2, 0) == 2, "%s: cell 2 is (%d, %llx)", name, cl->pos[2],
              (unsigned long long)kvc_cells_seq_word(cl, 2, 0));
        CHECK(cl->used == 3 && cl->seq_pos[0].n == 2 && cl->seq_pos[1].n == 2, "%s: used %u, seq_pos %u / %u",
              name, cl->used, cl->seq_pos[0].n, cl->seq_pos[1].n);
        kvc_state_plan_free(&plan);
    }
    cache_free(&t);
    free(blob);
}

/* Cell records start at byte 4: pos, n_seq_id, ids (cell 0: 12 bytes, cell 1: 16, cell 2: 12). */
static void id_out_of_range(uint8_t *b) { put_u32(b + 4 + 8, 63); }
static void huge_id_count(uint8_t *b) { put_u32(b + 4 + 12 + 4, 0x7fffffffu); }
static void negative_position(uint8_t *b) { put_u32(b + 4, 0xfffffff9u); }

int main(void) {
    check_mutation("a sequence id out of range", id_out_of_range);
    check_mutation("a huge id count", huge_id_count);
    check_mutation("a negative position", negative_position);
    printf("test_state_apply: %d checks, %d failed\n", n_checks, n_failed);
    return n_failed != 0;
}
