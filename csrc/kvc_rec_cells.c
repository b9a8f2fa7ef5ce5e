/* kvcache — the recurrent cache's cell table (see kvc_rec_cells.h). */
#include "kvc_rec_cells.h"

#include <string.h>

/* The table's columns, allocated and freed together. */
enum { REC_CELLS_ARRAYS = 7 };
static void cells_arrays(kvc_rec_cells *t, kvc_array a[REC_CELLS_ARRAYS]) {
    const kvc_array all[REC_CELLS_ARRAYS] = {
        KVC_ARRAY(t->pos, t->size),  KVC_ARRAY(t->src, t->size),    KVC_ARRAY(t->src0, t->size),
        KVC_ARRAY(t->tail, t->size), KVC_ARRAY(t->rs_idx, t->size), KVC_ARRAY(t->snap, t->size),
        KVC_ARRAY(t->seq, (uint64_t)t->seq_words * t->size),
    };
    memcpy(a, all, sizeof all);
}

int kvc_rec_cells_alloc(kvc_rec_cells *t, uint32_t size, uint32_t seq_words) {
    memset(t, 0, sizeof *t);
    t->size = size;
    t->seq_words = seq_words;
    kvc_array arrays[REC_CELLS_ARRAYS];
    cells_arrays(t, arrays);
    return kvc_alloc_arrays(arrays, REC_CELLS_ARRAYS);
}

void kvc_rec_cells_release(kvc_rec_cells *t) {
    kvc_array arrays[REC_CELLS_ARRAYS];
    cells_arrays(t, arrays);
    kvc_free_arrays(arrays, REC_CELLS_ARRAYS);
    memset(t, 0, sizeof *t);
}

void kvc_rec_cells_wipe(kvc_rec_cells *t) {
    for (uint32_t i = 0; i < t->size; i++) {
        t->pos[i] = -1;
        t->src[i] = -1;
        t->tail[i] = -1;
    }
    memset(t->rs_idx, 0, t->size * sizeof *t->rs_idx);
    memset(t->snap, 0, t->size * sizeof *t->snap);
    memset(t->seq, 0, (size_t)t->seq_words * t->size * sizeof *t->seq);
}

void kvc_rec_cells_copy(kvc_rec_cells *dst, const kvc_rec_cells *src) {
    const size_t n = src->size;
    memcpy(dst->pos, src->pos, n * sizeof *dst->pos);
    memcpy(dst->src, src->src, n * sizeof *dst->src);
    memcpy(dst->src0, src->src0, n * sizeof *dst->src0);
    memcpy(dst->tail, src->tail, n * sizeof *dst->tail);
    memcpy(dst->rs_idx, src->rs_idx, n * sizeof *dst->rs_idx);
    memcpy(dst->snap, src->snap, n * sizeof *dst->snap);
    memcpy(dst->seq, src->seq, (size_t)src->seq_words * n * sizeof *dst->seq);
    dst->head = src->head;
    dst->n = src->n;
    dst->used = src->used;
    dst->rs_z = src->rs_z;
}

uint32_t kvc_rec_next_empty(const kvc_rec_cells *t, uint32_t from) {
    uint32_t i = from;
    for (uint32_t k = 0; k < t->size; k++) {
        if (i >= t->size) {
            i -= t->size;
        }
        if (kvc_rec_none(t, i)) {
            break;
        }
        i += 1;
    }
    return i;
}

void kvc_rec_forget_rollback(kvc_rec_cells *t, int32_t s) {
    if (s < 0) {
        memset(t->rs_idx, 0, t->size * sizeof *t->rs_idx);
    } else {
        t->rs_idx[s] = 0;
    }
}

void kvc_rec_release_seq(kvc_rec_cells *t, int32_t s) {
    const int32_t tl = t->tail[s];
    if (tl < 0) {
        return;
    }
    kvc_rec_del(t, (uint32_t)tl, s);
    t->tail[s] = -1;
    kvc_rec_forget_rollback(t, s);
    if (kvc_rec_none(t, (uint32_t)tl)) {
        kvc_rec_cell_drop(t, (uint32_t)tl);
        t->used -= 1;
    }
}

void kvc_rec_seq_cp(kvc_rec_cells *t, int32_t s_src, int32_t s_dst) {
    if (s_src == s_dst) {
        return;
    }
    if (s_src < 0 || s_dst < 0 || (uint32_t)s_src >= t->size || (uint32_t)s_dst >= t->size) {
        return;
    }
    /* dst drops its own state; C9: it takes src's pending rollback with src's state (llama.cpp's
     * dst would read plane 0) */
    kvc_rec_release_seq(t, s_dst);
    t->rs_idx[s_dst] = 0;
    if (t->tail[s_src] >= 0) {
        const int32_t cs = t->tail[s_src];
        kvc_rec_add(t, (uint32_t)cs, s_dst);
        t->tail[s_dst] = cs;
        t->rs_idx[s_dst] = t->rs_idx[s_src];
    }
}

void kvc_rec_seq_keep(kvc_rec_cells *t, int32_t s) {
    uint32_t new_head = t->size;
    for (uint32_t i = 0; i < t->size; i++) {
        if ((int64_t)i != s) {
            t->tail[i] = -1;
            t->rs_idx[i] = 0;
        }
        if (!kvc_rec_has(t, i, s)) {
            if (t->pos[i] >= 0) {
                t->used--;
            }
            kvc_rec_cell_drop(t, i);
            kvc_rec_clear(t, i);
            if (new_head == t->size) {
                new_head = i;
            }
        } else {
            kvc_seqs_only(t->seq, t->size, t->seq_words, i, s);
        }
    }
    if (new_head != t->size && new_head < t->head) {
        t->head = new_head;
    }
}

int32_t kvc_rec_tail_in_range(const kvc_rec_cells *t, int32_t s, int32_t p0, int32_t p1) {
    const kvc_pos_range r = kvc_pos_range_of(p0, p1);
    if (r.p0 == r.p1 || s < 0 || (uint32_t)s >= t->size) {
        return -1;
    }
    const int32_t tl = t->tail[s];
    if (tl < 0 || !kvc_rec_has(t, (uint32_t)tl, s) || !kvc_pos_range_has(r, t->pos[tl])) {
        return -1;
    }
    return tl;
}
