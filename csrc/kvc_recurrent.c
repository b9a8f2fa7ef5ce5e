/* kvcache — the recurrent-state cache: construction, the sequence operations, placement and the
 * graph inputs (see kvc_recurrent.h; the state codec is in kvc_recurrent_state.c, what each
 * semantics does its own way in kvc_recurrent_ops.c). */
#include "kvc_recurrent.h"
#include "kvc_state.h"
#include "kvc_types.h"

#include <stdio.h>
#include <string.h>

/* ---------------------------------------------------------------------------------------
 * operations on a table (the live one, or the work copy of a transactional operation)
 * --------------------------------------------------------------------------------------- */

static bool rec_rollback_ok(const kvc_recurrent *c, const kvc_rec_cells *t, int32_t s, int32_t r) {
    if (s < 0 || (uint32_t)s >= t->size || t->tail[s] < 0) {
        return false;
    }
    const uint32_t cell = (uint32_t)t->tail[s];
    /* llama.cpp's rule: one pending rollback at a time, at most n_rs_seq back (a type without
     * snapshots has n_rs_seq 0) */
    if (t->rs_idx[s] != 0 || r < 1 || (uint32_t)r > c->n_rs_seq) {
        return false;
    }
    /* C9: plane r must hold the state r tokens back, and the state must be s's alone */
    return (uint32_t)r <= t->snap[cell] && kvc_seqs_count(t->seq, t->size, t->seq_words, cell) == 1;
}

bool kvc_recurrent_table_seq_rm(const kvc_recurrent *c, kvc_rec_cells *t, int32_t s, int32_t p0, int32_t p1) {
    uint32_t new_head = t->size;
    const kvc_pos_range r = kvc_pos_range_of(p0, p1);
    if (s >= 0 && (uint32_t)s >= t->size) {
        return false;
    }
    if (r.p0 == 0 && r.p1 == KVC_POS_END) {
        kvc_rec_forget_rollback(t, s);
    }
    if (s >= 0) {
        const int32_t tail_id = t->tail[s];
        if (tail_id >= 0) {
            const int32_t cpos = t->pos[tail_id];
            const int32_t back = c->ops->rollback_len(t, s, r.p0, r.p1);
            if (back > 0) {
                if (!rec_rollback_ok(c, t, s, back)) {
                    return false;
                }
                t->rs_idx[s] = (uint32_t)back;
                t->pos[tail_id] = r.p0 - 1;
                return true;
            }
            /* a state cannot be cut in two (C9: today's llama.cpp says true and keeps it whole) */
            if ((0 < r.p0 && r.p0 <= cpos) || (0 < r.p1 && r.p1 <= cpos)) {
                return false;
            }
            if (kvc_pos_range_has(r, cpos)) {
                t->tail[s] = -1;
                kvc_rec_forget_rollback(t, s);
            }
        }
    } else if (r.p0 != r.p1 && (r.p0 != 0 || r.p1 != KVC_POS_END)) {
        /* every sequence: only nothing or everything */
        return false;
    }
    for (uint32_t i = 0; i < t->size; i++) {
        if (!kvc_pos_range_has(r, t->pos[i])) {
            continue;
        }
        if (s < 0) {
            kvc_rec_clear(t, i);
        } else if (kvc_rec_has(t, i, s)) {
            kvc_rec_del(t, i, s);
        } else {
            continue;
        }
        if (kvc_rec_none(t, i)) {
            if (t->pos[i] >= 0) {
                t->used--;
            }
            kvc_rec_cell_drop(t, i);
            if (new_head == t->size) {
                new_head = i;
            }
        }
    }
    if (new_head != t->size && new_head < t->head) {
        t->head = new_head;
    }
    return true;
}

/* Record the reference's warning about a state that does not continue where it stopped. */
static void warn_non_consecutive(kvc_recurrent *c, int32_t pos, int32_t last, int32_t s, uint32_t n_new) {
    c->n_warn++;
    const size_t used = strlen(c->warn);
    if (used + 2 >= sizeof c->warn) {
        return;
    }
    char *at = c->warn + used;
    size_t room = sizeof c->warn - used;
    if (used > 0) {
        *at++ = '\n';
        *at = 0;
        room--;
    }
    snprintf(at, room, "non-consecutive token position %d after %d for sequence %d with %u new tokens",
             pos, last, s, n_new);
}

/* The reference's find_slot on table t (a work copy: on error it is left half changed and the
 * caller drops it). Ids are valid and n_seqs >= 1. */
static int rec_find_slot(const kvc_recurrent *c, kvc_rec_cells *t, const kvc_ubatch *ub, kvc_recurrent *warn_to,
                         kvc_err *err) {
    const uint32_t size = t->size;
    const uint32_t n_seqs = ub->n_seqs;
    const uint32_t n_seq_tokens = ub->n_seq_tokens;

    /* enough unused cells before head: search from the start, hoping to fill it */
    if (t->head > t->used + 2 * c->ops->head_reset_count(ub)) {
        t->head = 0;
    }

    int32_t min = (int32_t)size - 1;
    int32_t max = 0;

    /* sequences that become shared (not first in their group) give up their own state */
    for (uint32_t g = 0; g < n_seqs; g++) {
        for (uint32_t j = ub->seq_off[g] + 1; j < ub->seq_off[g + 1]; j++) {
            kvc_rec_release_seq(t, ub->seq_ids[j]);
        }
    }

    uint32_t next_empty = kvc_rec_next_empty(t, t->head);

    /* every group's first sequence gets a cell of its own (copy-on-share) */
    for (uint32_t g = 0; g < n_seqs; g++) {
        const int32_t s = ub->seq_ids[ub->seq_off[g]];
        const int32_t tl = t->tail[s];
        bool has_cell = false;
        if (tl >= 0) {
            if (!kvc_rec_has(t, (uint32_t)tl, s)) {
                return kvc_err_set(err, KVC_E_INTERNAL,
                                   "find_slot: the state record of sequence %d points at cell %d, which does "
                                   "not hold it (the reference leaves such a record after seq_rm(-1, ...) "
                                   "without clear(), and when a find_slot lost the sequence's state)", s, tl);
            }
            has_cell = kvc_seqs_count(t->seq, t->size, t->seq_words, (uint32_t)tl) == 1;
        }
        if (!has_cell) {
            if (next_empty >= size || !kvc_rec_none(t, next_empty)) {
                return kvc_err_set(err, KVC_E_NOSPACE, "find_slot: no empty cell for the state of sequence %d", s);
            }
            if (tl >= 0) {
                t->pos[next_empty] = t->pos[tl];
                t->src[next_empty] = t->src[tl];
                kvc_rec_del(t, (uint32_t)tl, s);
                kvc_rec_add(t, next_empty, s);
            }
            t->tail[s] = (int32_t)next_empty;
            if (g + 1 < n_seqs) {
                next_empty = kvc_rec_next_empty(t, next_empty + 1);
            }
        }
        if (min > t->tail[s]) {
            min = t->tail[s];
        }
        if (max < t->tail[s]) {
            max = t->tail[s];
        }
    }

    /* gather the groups' cells into [min, min + n_seqs), in group order */
    for (uint32_t g = 0; g < n_seqs; g++) {
        const int64_t dst = (int64_t)g + min;
        const int32_t src = t->tail[ub->seq_ids[ub->seq_off[g]]];
        if (dst >= size || src < 0) {
            return kvc_err_set(err, KVC_E_NOSPACE,
                               "find_slot: the %u sequences' cells do not fit from cell %d on", n_seqs, min);
        }
        if (dst != src) {
            const uint32_t d = (uint32_t)dst, r = (uint32_t)src;
            int32_t ti = t->pos[d]; t->pos[d] = t->pos[r]; t->pos[r] = ti;
            ti = t->src[d]; t->src[d] = t->src[r]; t->src[r] = ti;
            for (uint32_t w = 0; w < t->seq_words; w++) {
                uint64_t *plane = t->seq + (size_t)w * size;
                const uint64_t tw = plane[d];
                plane[d] = plane[r];
                plane[r] = tw;
            }
            for (int32_t q = kvc_seqs_next(t->seq, size, t->seq_words, r, -1); q >= 0;
                 q = kvc_seqs_next(t->seq, size, t->seq_words, r, q)) {
                t->tail[q] = (int32_t)r;
            }
            for (int32_t q = kvc_seqs_next(t->seq, size, t->seq_words, d, -1); q >= 0;
                 q = kvc_seqs_next(t->seq, size, t->seq_words, d, q)) {
                t->tail[q] = (int32_t)d;
            }
        }
    }

    /* the cells take the groups' last positions and sequence lists */
    for (uint32_t g = 0; g < n_seqs; g++) {
        const int32_t last_pos = ub->pos[n_seq_tokens * g + n_seq_tokens - 1];
        const uint32_t cell = g + (uint32_t)min;
        const int32_t old = t->pos[cell];
        if (old >= 0 && last_pos != (int32_t)((uint32_t)old + n_seq_tokens)) {
            if (warn_to) {
                warn_non_consecutive(warn_to, last_pos, old, ub->seq_ids[ub->seq_off[g]], n_seq_tokens);
            }
        }
        t->pos[cell] = last_pos;
        kvc_rec_clear(t, cell);
        for (uint32_t j = ub->seq_off[g]; j < ub->seq_off[g + 1]; j++) {
            const int32_t s = ub->seq_ids[j];
            kvc_rec_add(t, cell, s);
            t->tail[s] = (int32_t)cell;
        }
    }

    const int st = c->ops->stage(c, t, (uint32_t)min, (uint32_t)max, ub, err);
    if (st != KVC_OK) {
        return st;
    }

    t->head = (uint32_t)min;
    t->n = (uint32_t)(max - min + 1);
    uint32_t used = 0;
    for (uint32_t i = 0; i < size; i++) {
        used += !kvc_rec_none(t, i);
    }
    t->used = used;
    return t->n >= n_seqs ? 1 : 0;
}

/* ---------------------------------------------------------------------------------------
 * lifetime
 * --------------------------------------------------------------------------------------- */

int kvc_recurrent_construct(kvc_recurrent *c, const kvc_recurrent_params *p, const kvc_recurrent_ops *ops,
                            kvc_err *err) {
    memset(c, 0, sizeof *c);
    if (kvc_n_seq_max_check(p->n_seq_max, err) != KVC_OK) {
        return KVC_E_ARG;
    }
    if (p->kv_size < p->n_seq_max || p->kv_size > (uint32_t)INT32_MAX) {
        return kvc_err_set(err, KVC_E_ARG, "kv_size = %u must lie in [n_seq_max = %u, 2**31)", p->kv_size,
                           p->n_seq_max);
    }
    if (p->n_layer == 0) {
        return kvc_err_set(err, KVC_E_ARG, "n_layer must be at least 1");
    }
    if (!ops) {
        return kvc_err_set(err, KVC_E_ARG, "unknown recurrent semantics %d", p->semantics);
    }
    if (ops->check(p, err) != KVC_OK) {
        return KVC_E_ARG;
    }
    if ((uint64_t)p->kv_size * (1u + (uint64_t)p->n_rs_seq) > (uint64_t)INT32_MAX) {
        return kvc_err_set(err, KVC_E_ARG, "kv_size = %u with n_rs_seq = %u snapshots: %llu rows, expected fewer "
                           "than 2**31", p->kv_size, p->n_rs_seq,
                           (unsigned long long)p->kv_size * (1u + (unsigned long long)p->n_rs_seq));
    }
    const kvc_type_info *tk = kvc_type_get(p->type_k);
    const kvc_type_info *tv = kvc_type_get(p->type_v);
    if (!tk || !tv) {
        return kvc_err_set(err, KVC_E_ARG, "unsupported %s type id %d", tk ? "V" : "K", tk ? p->type_v : p->type_k);
    }
    for (uint32_t il = 0; il < p->n_layer; il++) {
        if (p->n_embd_k[il] % tk->blck_size || p->n_embd_v[il] % tv->blck_size) {
            return kvc_err_set(err, KVC_E_ARG, "layer %u: row widths (K %u, V %u) must be multiples of the "
                               "block sizes of %s (%u) and %s (%u)", il, p->n_embd_k[il], p->n_embd_v[il],
                               tk->name, tk->blck_size, tv->name, tv->blck_size);
        }
    }
    const int rc = kvc_state_check_sizes(p->kv_size, p->n_seq_max, p->type_k, p->type_v, p->n_layer, p->n_embd_k,
                                         p->n_embd_v, err);
    if (rc != KVC_OK) {
        return rc;
    }
    c->n_seq_max = p->n_seq_max;
    c->type_k = p->type_k;
    c->type_v = p->type_v;
    c->n_layer = p->n_layer;
    c->n_layer_model = p->n_layer;
    c->ops = ops;
    c->n_rs_seq = p->n_rs_seq;
    c->layers = kvc_calloc(p->n_layer, sizeof *c->layers);
    if (!c->layers || kvc_rec_cells_alloc(&c->cells, p->kv_size, kvc_seq_words(p->n_seq_max)) != KVC_OK ||
        kvc_rec_cells_alloc(&c->work, p->kv_size, kvc_seq_words(p->n_seq_max)) != KVC_OK) {
        kvc_recurrent_free(c);
        return kvc_err_set(err, KVC_E_NOMEM, "out of memory for a recurrent cache of %u cells", p->kv_size);
    }
    for (uint32_t il = 0; il < p->n_layer; il++) {
        c->layers[il] = kvc_layer_geometry((int32_t)il, p->type_k, p->type_v, p->n_embd_k[il], p->n_embd_v[il]);
    }
    kvc_rec_cells_wipe(&c->cells);
    kvc_rec_cells_wipe(&c->work);
    c->cells.rs_z = c->work.rs_z = -1;
    for (uint32_t i = 0; i < p->kv_size; i++) {
        c->cells.src0[i] = c->work.src0[i] = -1;
    }
    return KVC_OK;
}

void kvc_recurrent_free(kvc_recurrent *c) {
    kvc_rec_cells_release(&c->cells);
    kvc_rec_cells_release(&c->work);
    kvc_free(c->layers);
    c->layers = NULL;
    c->n_layer = 0;
}

int kvc_recurrent_set_model_layers(kvc_recurrent *c, uint32_t n_layer_model, const uint32_t *model_il,
                                   kvc_err *err) {
    for (uint32_t k = 0; k < c->n_layer; k++) {
        if (model_il[k] >= n_layer_model || (k && model_il[k] <= model_il[k - 1])) {
            return kvc_err_set(err, KVC_E_ARG, "recurrent layer %u is the model's layer %u: expected ascending "
                               "layers below %u", k, model_il[k], n_layer_model);
        }
    }
    for (uint32_t k = 0; k < c->n_layer; k++) {
        c->layers[k].il = (int32_t)model_il[k];
    }
    c->n_layer_model = n_layer_model;
    return KVC_OK;
}

void kvc_recurrent_set_layer_buffers(kvc_recurrent *c, uint32_t il, uint8_t *k, uint8_t *v) {
    if (il < c->n_layer) {
        c->layers[il].k = k;
        c->layers[il].v = v;
    }
}

/* ---------------------------------------------------------------------------------------
 * operations
 * --------------------------------------------------------------------------------------- */

/* Rows of each layer's memory: the states and their snapshot planes. */
static size_t rec_rows(const kvc_recurrent *c) {
    return (size_t)c->cells.size * (1u + (size_t)c->n_rs_seq);
}

void kvc_recurrent_zero_data(kvc_recurrent *c) {
    const size_t size = rec_rows(c);
    for (uint32_t il = 0; il < c->n_layer; il++) {
        const kvc_layer *L = &c->layers[il];
        if (L->k) {
            memset(L->k, 0, size * L->k_row_bytes);
        }
        if (L->v) {
            memset(L->v, 0, size * L->v_row_bytes);
        }
    }
}

void kvc_recurrent_clear(kvc_recurrent *c) {
    kvc_rec_cells_wipe(&c->cells);   /* pending rollbacks included */
    c->cells.head = 0;
    c->cells.used = 0;
    kvc_recurrent_zero_data(c);
}

bool kvc_recurrent_seq_rm(kvc_recurrent *c, int32_t s, int32_t p0, int32_t p1) {
    return kvc_recurrent_table_seq_rm(c, &c->cells, s, p0, p1);
}

void kvc_recurrent_seq_cp(kvc_recurrent *c, int32_t src, int32_t dst, int32_t p0, int32_t p1) {
    (void)p0; /* a state is copied whole */
    (void)p1;
    kvc_rec_seq_cp(&c->cells, src, dst);
}

void kvc_recurrent_seq_keep(kvc_recurrent *c, int32_t s) {
    kvc_rec_seq_keep(&c->cells, s);
}

void kvc_recurrent_seq_add(kvc_recurrent *c, int32_t s, int32_t p0, int32_t p1, int32_t shift) {
    if (shift == 0) {
        return;
    }
    const int32_t tl = kvc_rec_tail_in_range(&c->cells, s, p0, p1);
    if (tl >= 0) {
        /* int64 so that a huge shift cannot overflow: a position pushed past KVC_POS_MAX stays
         * there, as an attention cell's does (a state in range has a position >= 0, so the sum
         * stays above INT32_MIN) */
        const int64_t p = (int64_t)c->cells.pos[tl] + shift;
        c->cells.pos[tl] = (int32_t)(p > KVC_POS_MAX ? KVC_POS_MAX : p);
    }
}

void kvc_recurrent_seq_div(kvc_recurrent *c, int32_t s, int32_t p0, int32_t p1, int32_t d) {
    if (d == 1 || d == 0) {
        return;
    }
    const int32_t tl = kvc_rec_tail_in_range(&c->cells, s, p0, p1);
    if (tl >= 0) {
        c->cells.pos[tl] /= d;
    }
}

int32_t kvc_recurrent_seq_pos_min(const kvc_recurrent *c, int32_t s) {
    int64_t r = KVC_POS_END;   /* past every position: a state at KVC_POS_MAX is one */
    for (uint32_t i = 0; i < c->cells.size; i++) {
        if (kvc_rec_has(&c->cells, i, s) && c->cells.pos[i] < r) {
            r = c->cells.pos[i];
        }
    }
    return r == KVC_POS_END ? -1 : (int32_t)r;
}

int32_t kvc_recurrent_seq_pos_max(const kvc_recurrent *c, int32_t s) {
    int32_t r = -1;
    for (uint32_t i = 0; i < c->cells.size; i++) {
        if (kvc_rec_has(&c->cells, i, s) && c->cells.pos[i] > r) {
            r = c->cells.pos[i];
        }
    }
    return r;
}

int32_t kvc_recurrent_rollback_len(const kvc_recurrent *c, int32_t s, int32_t p0) {
    return c->ops->rollback_len(&c->cells, s, p0, KVC_POS_END);
}

bool kvc_recurrent_rollback_ok(const kvc_recurrent *c, int32_t s, int32_t r) {
    return rec_rollback_ok(c, &c->cells, s, r);
}

void kvc_recurrent_swap_work(kvc_recurrent *c) {
    const kvc_rec_cells t = c->cells;
    c->cells = c->work;
    c->work = t;
}

/* What find_slot refuses before it changes anything: no token, an id outside [0, n_seq_max), a
 * sequence in two groups. */
static int rec_ubatch_check(const kvc_recurrent *c, const kvc_ubatch *ub, kvc_err *err) {
    if (ub->n_seqs == 0) {
        return kvc_err_set(err, KVC_E_ARG, "the ubatch has no tokens");
    }
    const int st = kvc_ubatch_check(ub, c->n_seq_max, err);
    if (st != KVC_OK) {
        return st;
    }
    /* a state is one cell: a sequence cannot be in two groups of one step */
    kvc_seqset seen;
    kvc_seqset_clear(&seen);
    for (uint32_t g = 0; g < ub->n_seqs; g++) {
        for (uint32_t j = ub->seq_off[g]; j < ub->seq_off[g + 1]; j++) {
            if (kvc_seqset_has(&seen, ub->seq_ids[j])) {
                return kvc_err_set(err, KVC_E_ARG, "sequence %d is in two token groups of the ubatch",
                                   ub->seq_ids[j]);
            }
        }
        for (uint32_t j = ub->seq_off[g]; j < ub->seq_off[g + 1]; j++) {
            kvc_seqset_add(&seen, ub->seq_ids[j]);
        }
    }
    return KVC_OK;
}

int kvc_recurrent_find_slot(kvc_recurrent *c, const kvc_ubatch *ub, kvc_err *err) {
    c->n_warn = 0;
    c->warn[0] = 0;
    const int st = rec_ubatch_check(c, ub, err);
    if (st != KVC_OK) {
        return st;
    }
    kvc_rec_cells_copy(&c->work, &c->cells);
    const int r = rec_find_slot(c, &c->work, ub, c, err);
    if (r < 0) {
        c->n_warn = 0;
        c->warn[0] = 0;
        return r;
    }
    kvc_recurrent_swap_work(c);
    c->can_unplace = true;
    return r;
}

int kvc_recurrent_unplace(kvc_recurrent *c) {
    if (!c->can_unplace) {
        return KVC_E_ARG;
    }
    kvc_recurrent_swap_work(c);
    c->can_unplace = false;
    c->n_warn = 0;
    c->warn[0] = 0;
    return KVC_OK;
}

int kvc_recurrent_prepare(kvc_recurrent *c, const kvc_ubatch *ubs, uint32_t n_ub, kvc_err *err) {
    /* the ubatches are placed in turn on the work copy, which is then dropped */
    kvc_rec_cells_copy(&c->work, &c->cells);
    c->can_unplace = false;
    for (uint32_t u = 0; u < n_ub; u++) {
        int r = rec_ubatch_check(c, &ubs[u], err);
        if (r != KVC_OK) {
            return r;
        }
        r = rec_find_slot(c, &c->work, &ubs[u], NULL, err);
        if (r != 1) {
            return r;
        }
    }
    return 1;
}

void kvc_recurrent_commit(kvc_recurrent *c) { (void)c; }

void kvc_recurrent_restore(kvc_recurrent *c) { (void)c; }

void kvc_recurrent_set_full(kvc_recurrent *c) {
    c->cells.n = c->cells.size;
    c->cells.head = 0;
}

/* the range is every type's; what the inputs are is the type's own */
int kvc_recurrent_s_copy(kvc_recurrent *c, uint32_t count, int32_t *out) {
    if ((uint64_t)c->cells.head + count > c->cells.size) {
        return KVC_E_ARG;
    }
    return c->ops->s_copy(c, count, out);
}

int kvc_recurrent_s_mask(kvc_recurrent *c, uint32_t count, float *out) {
    if ((uint64_t)c->cells.head + count > c->cells.size) {
        return KVC_E_ARG;
    }
    return c->ops->s_mask(c, count, out);
}

uint32_t kvc_recurrent_cell_max(const kvc_recurrent *c) {
    for (uint32_t i = c->cells.size; i > 0; i--) {
        if (c->cells.pos[i - 1] >= 0 && !kvc_rec_none(&c->cells, i - 1)) {
            return i;
        }
    }
    return 0;
}

int kvc_recurrent_store_plane(kvc_recurrent *c, uint32_t il, uint32_t plane, uint32_t n_rows, const void *k,
                              const void *v) {
    if (il >= c->n_layer || plane > c->n_rs_seq || (uint64_t)c->cells.head + n_rows > c->cells.size) {
        return KVC_E_ARG;
    }
    const kvc_layer *L = &c->layers[il];
    const size_t row0 = (size_t)plane * c->cells.size + c->cells.head;
    if (k && L->k) {
        memcpy(L->k + row0 * L->k_row_bytes, k, (size_t)n_rows * L->k_row_bytes);
    }
    if (v && L->v) {
        memcpy(L->v + row0 * L->v_row_bytes, v, (size_t)n_rows * L->v_row_bytes);
    }
    return KVC_OK;
}

int kvc_recurrent_store(kvc_recurrent *c, uint32_t il, uint32_t n_rows, const void *k, const void *v) {
    return kvc_recurrent_store_plane(c, il, 0, n_rows, k, v);
}

/* Give sequence seq_id (which holds no state in w) a cell of w whose state is kept as it is, at
 * position pos: the reference's find_slot of one token, as its sequence state reader does. */
int kvc_recurrent_place_one(kvc_recurrent *c, kvc_rec_cells *w, int32_t seq_id, int32_t pos, kvc_err *err) {
    const uint32_t seq_off[2] = { 0, 1 };
    kvc_ubatch ub;
    memset(&ub, 0, sizeof ub);
    ub.n_tokens = 1;
    ub.n_seq_tokens = 1;
    ub.n_seqs = 1;
    ub.pos = &pos;
    ub.seq_off = seq_off;
    ub.seq_ids = &seq_id;
    kvc_err ferr;
    ferr.msg[0] = 0;
    const int fr = rec_find_slot(c, w, &ub, NULL, &ferr);
    if (fr != 1) {
        return kvc_err_set(err, KVC_E_STATE, "no cell available for the state of sequence %d%s%s", seq_id,
                           fr < 0 ? ": " : "", fr < 0 ? ferr.msg : "");
    }
    w->src[w->head] = (int32_t)w->head;
    return KVC_OK;
}

int kvc_recurrent_seq_restore(kvc_recurrent *c, int32_t seq_id, int32_t pos, uint32_t *cell, kvc_err *err) {
    if (seq_id < 0 || (uint32_t)seq_id >= c->n_seq_max || pos < 0) {
        return kvc_err_set(err, KVC_E_ARG, "seq_restore: sequence %d, position %d", seq_id, pos);
    }
    if (kvc_recurrent_seq_pos_max(c, seq_id) >= 0) {
        return kvc_err_set(err, KVC_E_ARG, "sequence %d holds a state already", seq_id);
    }
    kvc_rec_cells_copy(&c->work, &c->cells);
    kvc_recurrent_table_seq_rm(c, &c->work, seq_id, -1, -1);   /* a record left without a cell goes */
    const int r = kvc_recurrent_place_one(c, &c->work, seq_id, pos, err);
    if (r != KVC_OK) {
        return r == KVC_E_STATE ? KVC_E_NOSPACE : r;
    }
    kvc_recurrent_swap_work(c);
    c->can_unplace = true;
    c->n_warn = 0;
    c->warn[0] = 0;
    *cell = c->cells.head;
    return KVC_OK;
}

KVC_SEQ_OPS_DEFINE(kvc_recurrent, kvc_recurrent);
