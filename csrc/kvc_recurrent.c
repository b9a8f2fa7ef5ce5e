#include "kvc_recurrent.h"
#include "kvc_section.h"
#include "kvc_le.h"
#include "kvc_state.h"
#include "kvc_types.h"

#include <stdio.h>
#include <string.h>

/* ---------------------------------------------------------------------------------------
 * cell table helpers
 * --------------------------------------------------------------------------------------- */

/* Cell i's set of sequences (ids outside the table's words are in no cell). */
static inline bool rec_has(const kvc_rec_cells *t, uint32_t i, int32_t s) {
    return s >= 0 && (uint32_t)s < 64 * t->seq_words && kvc_seqs_has(t->seq, t->size, i, s);
}
static inline void rec_add(kvc_rec_cells *t, uint32_t i, int32_t s) { kvc_seqs_add(t->seq, t->size, i, s); }
static inline void rec_del(kvc_rec_cells *t, uint32_t i, int32_t s) { kvc_seqs_del(t->seq, t->size, i, s); }
static inline bool rec_none(const kvc_rec_cells *t, uint32_t i) { return kvc_seqs_none(t->seq, t->size, t->seq_words, i); }
static inline void rec_clear(kvc_rec_cells *t, uint32_t i) { kvc_seqs_put(t->seq, t->size, t->seq_words, i, NULL); }

static int rec_cells_alloc(kvc_rec_cells *t, uint32_t size, uint32_t seq_words) {
    memset(t, 0, sizeof *t);
    t->size = size;
    t->seq_words = seq_words;
    t->pos  = kvc_malloc_n(size, sizeof *t->pos);
    t->src  = kvc_malloc_n(size, sizeof *t->src);
    t->src0 = kvc_malloc_n(size, sizeof *t->src0);
    t->tail = kvc_malloc_n(size, sizeof *t->tail);
    t->rs_idx = kvc_malloc_n(size, sizeof *t->rs_idx);
    t->snap = kvc_malloc_n(size, sizeof *t->snap);
    t->seq  = kvc_malloc_n((uint64_t)seq_words * size, sizeof *t->seq);
    if (!t->pos || !t->src || !t->src0 || !t->tail || !t->rs_idx || !t->snap || !t->seq) {
        return KVC_E_NOMEM;
    }
    return KVC_OK;
}

static void rec_cells_release(kvc_rec_cells *t) {
    kvc_free(t->pos);
    kvc_free(t->src);
    kvc_free(t->src0);
    kvc_free(t->tail);
    kvc_free(t->rs_idx);
    kvc_free(t->snap);
    kvc_free(t->seq);
    memset(t, 0, sizeof *t);
}

/* Every cell new: pos, src, tail -1, no sequence, no pending rollback nor snapshot. Counters
 * and src0 untouched (llama.cpp's clear leaves the staged sources). */
static void rec_cells_wipe(kvc_rec_cells *t) {
    for (uint32_t i = 0; i < t->size; i++) {
        t->pos[i] = -1;
        t->src[i] = -1;
        t->tail[i] = -1;
    }
    memset(t->rs_idx, 0, t->size * sizeof *t->rs_idx);
    memset(t->snap, 0, t->size * sizeof *t->snap);
    memset(t->seq, 0, (size_t)t->seq_words * t->size * sizeof *t->seq);
}

/* dst = src (same size). */
static void rec_cells_copy(kvc_rec_cells *dst, const kvc_rec_cells *src) {
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

/* Empty cell i the way the reference does when its last sequence leaves. */
static inline void rec_cell_drop(kvc_rec_cells *t, uint32_t i) {
    t->pos[i] = -1;
    t->src[i] = -1;
}

static inline uint32_t rec_next_empty(const kvc_rec_cells *t, uint32_t from) {
    /* The reference's wrap-around scan: at most size steps; when nothing is empty the
     * result is where the scan stopped, which may be size itself. */
    uint32_t i = from;
    for (uint32_t k = 0; k < t->size; k++) {
        if (i >= t->size) {
            i -= t->size;
        }
        if (rec_none(t, i)) {
            break;
        }
        i += 1;
    }
    return i;
}

/* ---------------------------------------------------------------------------------------
 * operations on a table (the live one, or the work copy of a transactional operation)
 * --------------------------------------------------------------------------------------- */

/* Sequence s (or every one, s < 0) loses its state: a pending rollback goes with it (kvcache's
 * rule C9: llama.cpp keeps it, and the sequence's next state would start from a snapshot plane). */
static void rec_forget_rollback(kvc_rec_cells *t, int32_t s) {
    if (s < 0) {
        memset(t->rs_idx, 0, t->size * sizeof *t->rs_idx);
    } else {
        t->rs_idx[s] = 0;
    }
}

/* 2026: the rollback seq_rm(s, p0, -1 or past the state) means, as rec_rollback_len. */
static int32_t rec_rollback_len(const kvc_rec_cells *t, int32_t s, int32_t p0, int64_t p1) {
    if (s < 0 || (uint32_t)s >= t->size || t->tail[s] < 0) {
        return 0;
    }
    const int32_t cpos = t->pos[t->tail[s]];
    if (0 < p0 && p0 <= cpos && p1 > cpos) {
        return (int32_t)((int64_t)cpos - p0 + 1);
    }
    return 0;
}

static bool rec_rollback_ok(const kvc_recurrent *c, const kvc_rec_cells *t, int32_t s, int32_t r) {
    if (c->semantics != KVC_REC_2026 || s < 0 || (uint32_t)s >= t->size || t->tail[s] < 0) {
        return false;
    }
    const uint32_t cell = (uint32_t)t->tail[s];
    /* llama.cpp's rule: one pending rollback at a time, at most n_rs_seq back */
    if (t->rs_idx[s] != 0 || r < 1 || (uint32_t)r > c->n_rs_seq) {
        return false;
    }
    /* C9: plane r must hold the state r tokens back, and the state must be s's alone */
    return (uint32_t)r <= t->snap[cell] && kvc_seqs_count(t->seq, t->size, t->seq_words, cell) == 1;
}

static bool rec_seq_rm(const kvc_recurrent *c, kvc_rec_cells *t, int32_t s, int32_t p0, int32_t p1) {
    uint32_t new_head = t->size;
    const kvc_pos_range r = kvc_pos_range_of(p0, p1);
    const bool today = c->semantics == KVC_REC_2026;
    if (s >= 0 && (uint32_t)s >= t->size) {
        return false;
    }
    if (today && r.p0 == 0 && r.p1 == KVC_POS_END) {
        rec_forget_rollback(t, s);
    }
    if (s >= 0) {
        const int32_t tail_id = t->tail[s];
        if (tail_id >= 0) {
            const int32_t cpos = t->pos[tail_id];
            if (today) {
                const int32_t back = rec_rollback_len(t, s, r.p0, r.p1);
                if (back > 0) {
                    if (!rec_rollback_ok(c, t, s, back)) {
                        return false;
                    }
                    t->rs_idx[s] = (uint32_t)back;
                    t->pos[tail_id] = r.p0 - 1;
                    return true;
                }
            }
            /* a state cannot be cut in two (C9: today's llama.cpp says true and keeps it whole) */
            if ((0 < r.p0 && r.p0 <= cpos) || (0 < r.p1 && r.p1 <= cpos)) {
                return false;
            }
            if (kvc_pos_range_has(r, cpos)) {
                t->tail[s] = -1;
                rec_forget_rollback(t, s);
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
            rec_clear(t, i);
        } else if (rec_has(t, i, s)) {
            rec_del(t, i, s);
        } else {
            continue;
        }
        if (rec_none(t, i)) {
            if (t->pos[i] >= 0) {
                t->used--;
            }
            rec_cell_drop(t, i);
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

static void rec_seq_cp(kvc_rec_cells *t, int32_t s_src, int32_t s_dst) {
    if (s_src == s_dst) {
        return;
    }
    if (s_src < 0 || s_dst < 0 || (uint32_t)s_src >= t->size || (uint32_t)s_dst >= t->size) {
        return;
    }
    if (t->tail[s_dst] >= 0) {
        /* dst drops its own state */
        const int32_t cd = t->tail[s_dst];
        rec_del(t, (uint32_t)cd, s_dst);
        t->tail[s_dst] = -1;
        if (rec_none(t, (uint32_t)cd)) {
            rec_cell_drop(t, (uint32_t)cd);
            t->used -= 1;
        }
    }
    /* C9: dst takes src's pending rollback with its state (llama.cpp's dst would read plane 0) */
    t->rs_idx[s_dst] = 0;
    if (t->tail[s_src] >= 0) {
        const int32_t cs = t->tail[s_src];
        rec_add(t, (uint32_t)cs, s_dst);
        t->tail[s_dst] = cs;
        t->rs_idx[s_dst] = t->rs_idx[s_src];
    }
}

static void rec_seq_keep(kvc_rec_cells *t, int32_t s) {
    uint32_t new_head = t->size;
    for (uint32_t i = 0; i < t->size; i++) {
        if ((int64_t)i != s) {
            t->tail[i] = -1;
            t->rs_idx[i] = 0;
        }
        if (!rec_has(t, i, s)) {
            if (t->pos[i] >= 0) {
                t->used--;
            }
            rec_cell_drop(t, i);
            rec_clear(t, i);
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

/* The cell holding s's state when it lies in [p0, p1) (after the reference's clamping and
 * early returns), or -1. */
static int32_t rec_tail_in_range(const kvc_rec_cells *t, int32_t s, int32_t p0, int32_t p1) {
    const kvc_pos_range r = kvc_pos_range_of(p0, p1);
    if (r.p0 == r.p1 || s < 0 || (uint32_t)s >= t->size) {
        return -1;
    }
    const int32_t tl = t->tail[s];
    if (tl < 0 || !rec_has(t, (uint32_t)tl, s) || !kvc_pos_range_has(r, t->pos[tl])) {
        return -1;
    }
    return tl;
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

/* Today's end of find_slot: the first cell of [min, max] no cell copies from becomes the zero
 * state rs_z; every cell of the range stages its source in src0 (rs_z when its state is new) and
 * becomes its own source. The n_seqs cells from min on are the ubatch's: their last ubatch wrote
 * snapshot planes 1 .. min(n_seq_tokens - 1, n_rs_seq) (kvcache's record for rule C9). */
static int rec_stage_sources(const kvc_recurrent *c, kvc_rec_cells *t, uint32_t min, uint32_t max, uint32_t n_seqs,
                             uint32_t n_seq_tokens, kvc_err *err) {
    t->rs_z = -1;
    for (uint32_t i = min; i <= max && t->rs_z < 0; i++) {
        bool referenced = false;
        for (uint32_t j = 0; j < t->size && !referenced; j++) {
            referenced = t->src[j] == (int32_t)i;
        }
        if (!referenced) {
            t->rs_z = (int32_t)i;
        }
    }
    for (uint32_t i = min; i <= max; i++) {
        if (t->src[i] < 0) {
            if (t->rs_z < 0) {
                return kvc_err_set(err, KVC_E_INTERNAL, "find_slot: cell %u starts a new state but every cell "
                                   "of [%u, %u] is another cell's source (llama.cpp aborts)", i, min, max);
            }
            t->src0[i] = t->rs_z;
        } else {
            t->src0[i] = t->src[i];
        }
        t->src[i] = (int32_t)i;
    }
    const uint32_t kept = n_seq_tokens - 1 < c->n_rs_seq ? n_seq_tokens - 1 : c->n_rs_seq;
    for (uint32_t g = 0; g < n_seqs; g++) {
        t->snap[min + g] = kept;
    }
    return KVC_OK;
}

/* The reference's find_slot on table t (a work copy: on error it is left half changed and the
 * caller drops it). Ids are valid and n_seqs >= 1. */
static int rec_find_slot(const kvc_recurrent *c, kvc_rec_cells *t, const kvc_ubatch *ub, kvc_recurrent *warn_to,
                         kvc_err *err) {
    const uint32_t size = t->size;
    const uint32_t n_seqs = ub->n_seqs;
    const uint32_t n_seq_tokens = ub->n_seq_tokens;
    const bool today = c->semantics == KVC_REC_2026;

    /* enough unused cells before head: search from the start, hoping to fill it (today's
     * llama.cpp counts the ubatch's sequences, the mid-2025 one its tokens) */
    if (t->head > t->used + 2 * (today ? n_seqs : ub->n_tokens)) {
        t->head = 0;
    }

    int32_t min = (int32_t)size - 1;
    int32_t max = 0;

    /* sequences that become shared (not first in their group) give up their own state */
    for (uint32_t g = 0; g < n_seqs; g++) {
        for (uint32_t j = ub->seq_off[g] + 1; j < ub->seq_off[g + 1]; j++) {
            const int32_t s = ub->seq_ids[j];
            const int32_t tl = t->tail[s];
            if (tl >= 0) {
                rec_del(t, (uint32_t)tl, s);
                t->tail[s] = -1;
                rec_forget_rollback(t, s);
                if (rec_none(t, (uint32_t)tl)) {
                    rec_cell_drop(t, (uint32_t)tl);
                    t->used -= 1;
                }
            }
        }
    }

    uint32_t next_empty = rec_next_empty(t, t->head);

    /* every group's first sequence gets a cell of its own (copy-on-share) */
    for (uint32_t g = 0; g < n_seqs; g++) {
        const int32_t s = ub->seq_ids[ub->seq_off[g]];
        const int32_t tl = t->tail[s];
        bool has_cell = false;
        if (tl >= 0) {
            if (!rec_has(t, (uint32_t)tl, s)) {
                return kvc_err_set(err, KVC_E_INTERNAL,
                                   "find_slot: the state record of sequence %d points at cell %d, which does "
                                   "not hold it (the reference leaves such a record after seq_rm(-1, ...) "
                                   "without clear(), and when a find_slot lost the sequence's state)", s, tl);
            }
            has_cell = kvc_seqs_count(t->seq, t->size, t->seq_words, (uint32_t)tl) == 1;
        }
        if (!has_cell) {
            if (next_empty >= size || !rec_none(t, next_empty)) {
                return kvc_err_set(err, KVC_E_NOSPACE, "find_slot: no empty cell for the state of sequence %d", s);
            }
            if (tl >= 0) {
                t->pos[next_empty] = t->pos[tl];
                t->src[next_empty] = t->src[tl];
                rec_del(t, (uint32_t)tl, s);
                rec_add(t, next_empty, s);
            }
            t->tail[s] = (int32_t)next_empty;
            if (g + 1 < n_seqs) {
                next_empty = rec_next_empty(t, next_empty + 1);
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
        rec_clear(t, cell);
        for (uint32_t j = ub->seq_off[g]; j < ub->seq_off[g + 1]; j++) {
            const int32_t s = ub->seq_ids[j];
            rec_add(t, cell, s);
            t->tail[s] = (int32_t)cell;
        }
    }

    if (today) {
        const int st = rec_stage_sources(c, t, (uint32_t)min, (uint32_t)max, n_seqs, n_seq_tokens, err);
        if (st != KVC_OK) {
            return st;
        }
    }

    t->head = (uint32_t)min;
    t->n = (uint32_t)(max - min + 1);
    uint32_t used = 0;
    for (uint32_t i = 0; i < size; i++) {
        used += !rec_none(t, i);
    }
    t->used = used;
    return t->n >= n_seqs ? 1 : 0;
}

/* ---------------------------------------------------------------------------------------
 * lifetime
 * --------------------------------------------------------------------------------------- */

int kvc_recurrent_init(kvc_recurrent *c, const kvc_recurrent_params *p, kvc_err *err) {
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
    if (p->semantics != KVC_REC_2025 && p->semantics != KVC_REC_2026) {
        return kvc_err_set(err, KVC_E_ARG, "unknown recurrent semantics %d", p->semantics);
    }
    if (p->n_rs_seq > KVC_REC_MAX_RS_SEQ || (p->n_rs_seq && p->semantics != KVC_REC_2026)) {
        if (p->semantics != KVC_REC_2026) {
            return kvc_err_set(err, KVC_E_ARG, "n_rs_seq = %u: expected 0 (mid-2025 llama.cpp keeps no snapshots)",
                               p->n_rs_seq);
        }
        return kvc_err_set(err, KVC_E_ARG, "n_rs_seq = %u: expected at most %u", p->n_rs_seq, KVC_REC_MAX_RS_SEQ);
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
    c->semantics = p->semantics;
    c->n_rs_seq = p->n_rs_seq;
    c->layers = kvc_calloc(p->n_layer, sizeof *c->layers);
    if (!c->layers || rec_cells_alloc(&c->cells, p->kv_size, kvc_seq_words(p->n_seq_max)) != KVC_OK ||
        rec_cells_alloc(&c->work, p->kv_size, kvc_seq_words(p->n_seq_max)) != KVC_OK) {
        kvc_recurrent_free(c);
        return kvc_err_set(err, KVC_E_NOMEM, "out of memory for a recurrent cache of %u cells", p->kv_size);
    }
    for (uint32_t il = 0; il < p->n_layer; il++) {
        c->layers[il] = kvc_layer_geometry((int32_t)il, p->type_k, p->type_v, p->n_embd_k[il], p->n_embd_v[il]);
    }
    rec_cells_wipe(&c->cells);
    rec_cells_wipe(&c->work);
    c->cells.rs_z = c->work.rs_z = -1;
    for (uint32_t i = 0; i < p->kv_size; i++) {
        c->cells.src0[i] = c->work.src0[i] = -1;
    }
    return KVC_OK;
}

void kvc_recurrent_free(kvc_recurrent *c) {
    rec_cells_release(&c->cells);
    rec_cells_release(&c->work);
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

static void rec_zero_data(kvc_recurrent *c) {
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
    rec_cells_wipe(&c->cells);   /* pending rollbacks included */
    c->cells.head = 0;
    c->cells.used = 0;
    rec_zero_data(c);
}

bool kvc_recurrent_seq_rm(kvc_recurrent *c, int32_t s, int32_t p0, int32_t p1) {
    return rec_seq_rm(c, &c->cells, s, p0, p1);
}

void kvc_recurrent_seq_cp(kvc_recurrent *c, int32_t src, int32_t dst, int32_t p0, int32_t p1) {
    (void)p0; /* a state is copied whole */
    (void)p1;
    rec_seq_cp(&c->cells, src, dst);
}

void kvc_recurrent_seq_keep(kvc_recurrent *c, int32_t s) {
    rec_seq_keep(&c->cells, s);
}

void kvc_recurrent_seq_add(kvc_recurrent *c, int32_t s, int32_t p0, int32_t p1, int32_t shift) {
    if (shift == 0) {
        return;
    }
    const int32_t tl = rec_tail_in_range(&c->cells, s, p0, p1);
    if (tl >= 0) {
        c->cells.pos[tl] = kvc_wrap_add_i32(c->cells.pos[tl], shift);
    }
}

void kvc_recurrent_seq_div(kvc_recurrent *c, int32_t s, int32_t p0, int32_t p1, int32_t d) {
    if (d == 1 || d == 0) {
        return;
    }
    const int32_t tl = rec_tail_in_range(&c->cells, s, p0, p1);
    if (tl >= 0) {
        c->cells.pos[tl] /= d;
    }
}

int32_t kvc_recurrent_seq_pos_min(const kvc_recurrent *c, int32_t s) {
    int64_t r = KVC_POS_END;   /* past every position: a state at KVC_POS_MAX is one */
    for (uint32_t i = 0; i < c->cells.size; i++) {
        if (rec_has(&c->cells, i, s) && c->cells.pos[i] < r) {
            r = c->cells.pos[i];
        }
    }
    return r == KVC_POS_END ? -1 : (int32_t)r;
}

int32_t kvc_recurrent_seq_pos_max(const kvc_recurrent *c, int32_t s) {
    int32_t r = -1;
    for (uint32_t i = 0; i < c->cells.size; i++) {
        if (rec_has(&c->cells, i, s) && c->cells.pos[i] > r) {
            r = c->cells.pos[i];
        }
    }
    return r;
}

int32_t kvc_recurrent_rollback_len(const kvc_recurrent *c, int32_t s, int32_t p0) {
    return c->semantics == KVC_REC_2026 ? rec_rollback_len(&c->cells, s, p0, KVC_POS_END) : 0;
}

bool kvc_recurrent_rollback_ok(const kvc_recurrent *c, int32_t s, int32_t r) {
    return rec_rollback_ok(c, &c->cells, s, r);
}

static void rec_swap_work(kvc_recurrent *c) {
    const kvc_rec_cells t = c->cells;
    c->cells = c->work;
    c->work = t;
}

/* What find_slot refuses before it changes anything: no token, an id outside [0, n_seq_max), a
 * sequence in two groups. */
static int rec_ubatch_check(const kvc_recurrent *c, const kvc_ubatch *ub, kvc_err *err) {
    if (ub->n_seqs == 0) {
        return kvc_err_set(err, KVC_E_ARG, "find_slot: the ubatch has no tokens");
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
                return kvc_err_set(err, KVC_E_ARG, "find_slot: sequence %d is in two token groups of the ubatch",
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
    rec_cells_copy(&c->work, &c->cells);
    const int r = rec_find_slot(c, &c->work, ub, c, err);
    if (r < 0) {
        c->n_warn = 0;
        c->warn[0] = 0;
        return r;
    }
    rec_swap_work(c);
    c->can_unplace = true;
    return r;
}

int kvc_recurrent_unplace(kvc_recurrent *c) {
    if (!c->can_unplace) {
        return KVC_E_ARG;
    }
    rec_swap_work(c);
    c->can_unplace = false;
    c->n_warn = 0;
    c->warn[0] = 0;
    return KVC_OK;
}

int kvc_recurrent_prepare(kvc_recurrent *c, const kvc_ubatch *ubs, uint32_t n_ub, kvc_err *err) {
    /* the ubatches are placed in turn on the work copy, which is then dropped */
    rec_cells_copy(&c->work, &c->cells);
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

int kvc_recurrent_s_copy(kvc_recurrent *c, uint32_t count, int32_t *out) {
    kvc_rec_cells *t = &c->cells;
    if ((uint64_t)t->head + count > t->size) {
        return KVC_E_ARG;
    }
    if (c->semantics == KVC_REC_2026) {
        for (uint32_t i = 0; i < count; i++) {
            const uint32_t cell = t->head + i;
            uint32_t plane = 0;
            const int32_t first = kvc_seqs_next(t->seq, t->size, t->seq_words, cell, -1);
            if (c->n_rs_seq && first >= 0) {
                plane = t->rs_idx[first];
                t->rs_idx[first] = 0;   /* a pending rollback is read once */
            }
            out[i] = (int32_t)(plane * t->size) + t->src0[cell];
        }
        return KVC_OK;
    }
    for (uint32_t i = 0; i < count; i++) {
        const int32_t cell = (int32_t)(t->head + i);
        /* out-of-range sources read the cell itself */
        if (t->src[cell] < 0 || (uint32_t)t->src[cell] >= t->size) {
            t->src[cell] = cell;
        }
        out[i] = t->src[cell];
        /* the copy happens once */
        t->src[cell] = cell;
    }
    return KVC_OK;
}

int kvc_recurrent_s_mask(kvc_recurrent *c, uint32_t count, float *out) {
    kvc_rec_cells *t = &c->cells;
    if (c->semantics == KVC_REC_2026 || (uint64_t)t->head + count > t->size) {
        return KVC_E_ARG;
    }
    for (uint32_t i = 0; i < count; i++) {
        const int32_t cell = (int32_t)(t->head + i);
        out[i] = t->src[cell] >= 0 ? 1.0f : 0.0f;
        /* the state is zeroed once */
        if (t->src[cell] < 0) {
            t->src[cell] = cell;
        }
    }
    return KVC_OK;
}

uint32_t kvc_recurrent_cell_max(const kvc_recurrent *c) {
    for (uint32_t i = c->cells.size; i > 0; i--) {
        if (c->cells.pos[i - 1] >= 0 && !rec_none(&c->cells, i - 1)) {
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

/* ---------------------------------------------------------------------------------------
 * state codec
 * --------------------------------------------------------------------------------------- */

static void rec_layer(const void *cache, uint32_t il, kvc_layer *out) {
    *out = ((const kvc_recurrent *)cache)->layers[il];
}

/* The cache as the shared state writer sees it: a cell is listed when it holds a sequence; a
 * single-sequence state carries no ids (the reader gives it its own); V is never transposed. */
/* The plane holding cell i's current state: a pending rollback's (of the written sequence, or for
 * the whole cache of the cell's first sequence, the one s_copy reads). */
static uint32_t rec_plane(const kvc_state_src *s, uint32_t i) {
    const kvc_rec_cells *t = &((const kvc_recurrent *)s->cache)->cells;
    const int32_t q = s->seq_id >= 0 ? s->seq_id : kvc_seqs_next(t->seq, t->size, t->seq_words, i, -1);
    return q >= 0 ? t->rs_idx[q] : 0;
}

static void rec_src(const kvc_recurrent *c, int32_t seq_id, kvc_state_src *s) {
    s->swa = NULL;
    s->swa_pmax = -1;
    s->size = c->cells.size;
    s->pos = c->cells.pos;
    s->seq = c->cells.seq;
    s->seq_words = c->cells.seq_words;
    s->seq_id = seq_id;
    s->empty_is_no_seq = true;
    s->single_writes_id = false;
    s->type_k = c->type_k;
    s->type_v = c->type_v;
    s->v_trans = false;
    s->v_el = 0;
    s->n_layer = c->n_layer;
    s->n_layer_field = c->n_layer_model;
    s->cache = c;
    s->layer = rec_layer;
    s->ext = NULL;          /* a recurrent memory's cells have no extension */
    s->ext_bytes = 0;
    s->plane = c->n_rs_seq ? rec_plane : NULL;
}

/* The memory state of a recurrent cache has no stream count in any layout (llama.cpp's recurrent
 * memory kept the seed's shape); of a layout only the sequence-blob prefix applies. */
static void rec_framed(const kvc_recurrent *c, int32_t seq_id, unsigned layout, kvc_state_src *src,
                       kvc_state_framed *f) {
    rec_src(c, seq_id, src);
    f->layout = layout & KVC_LAYOUT_FRESH_OUT;
    f->seq_id = seq_id;
    f->prefix = seq_id >= 0 && (layout & KVC_LAYOUT_PREFIX);
    f->n_stream = 1;
    f->streams = src;
}

size_t kvc_recurrent_state_size_lay(const kvc_recurrent *c, int32_t seq_id, unsigned layout) {
    kvc_state_src s;
    kvc_state_framed f;
    rec_framed(c, seq_id, layout, &s, &f);
    return kvc_state_framed_size(&f);
}

size_t kvc_recurrent_state_size(const kvc_recurrent *c, int32_t seq_id) {
    return kvc_recurrent_state_size_lay(c, seq_id, 0);
}

int kvc_recurrent_state_write_range_lay(const kvc_recurrent *c, int32_t seq_id, unsigned layout, uint64_t offset,
                                        uint8_t *out, size_t cap, size_t *written) {
    kvc_state_src s;
    kvc_state_framed f;
    *written = 0;
    rec_framed(c, seq_id, layout, &s, &f);
    const uint64_t total = kvc_state_framed_size(&f);
    if (offset >= total || cap == 0) {
        return KVC_OK;
    }
    return kvc_state_framed_write(&f, offset, out, total - offset < cap ? (size_t)(total - offset) : cap, written);
}

int kvc_recurrent_state_write_range(const kvc_recurrent *c, int32_t seq_id, uint64_t offset, uint8_t *out,
                                    size_t cap, size_t *written) {
    return kvc_recurrent_state_write_range_lay(c, seq_id, 0, offset, out, cap, written);
}

int kvc_recurrent_state_write(const kvc_recurrent *c, int32_t seq_id, uint8_t *out, size_t cap, size_t *written) {
    kvc_state_src s;
    rec_src(c, seq_id, &s);
    const size_t need = kvc_state_src_size(&s);
    if (cap < need) {
        return KVC_E_NOSPACE;
    }
    return kvc_state_src_write(&s, 0, out, need, written);
}

/* The cache as the section parser holds a state to it: a whole cache's cells list their ids,
 * each sequence in one cell; a sequence's state is at most one cell, listing no id; V is never
 * transposed. */
static void rec_dest(const kvc_recurrent *c, int32_t seq_id, kvc_sec_dest *d) {
    memset(d, 0, sizeof *d);
    d->seq_id = seq_id;
    d->size = c->cells.size;
    d->seq_cells_max = 1;
    d->single_n_ids = 0;
    d->n_seq_max = c->n_seq_max;
    d->seq_words = c->cells.seq_words;
    d->seq_in_one_cell = true;
    d->type_k = c->type_k;
    d->type_v = c->type_v;
    d->v_trans = false;
    d->n_layer = c->n_layer;
    d->n_layer_field = c->n_layer_model;
    d->cache = c;
    d->layer = rec_layer;
}

/* Where the parser puts the cells: a whole cache's straight into c->work, wiped (its tails are
 * the cell that lists each sequence), a sequence's one position into *pos1. */
static void rec_dest_into(kvc_recurrent *c, int32_t seq_id, int32_t *pos1, kvc_sec_dest *d) {
    kvc_rec_cells *w = &c->work;
    if (seq_id >= 0) {
        d->into_pos = pos1;
        return;
    }
    rec_cells_wipe(w);
    d->into_pos = w->pos;
    d->into_seq = w->seq;
    d->into_cell_of = w->tail;
}

static int rec_place_one(kvc_recurrent *c, kvc_rec_cells *w, int32_t seq_id, int32_t pos, kvc_err *err);

/* Complete c->work from a validated section (a whole cache's cells are in it already; a
 * sequence's cell is placed in a copy of the live table). The live table is not touched. */
static int place_cells(kvc_recurrent *c, int32_t seq_id, uint32_t cc, int32_t pos, kvc_err *err) {
    kvc_rec_cells *w = &c->work;
    if (seq_id == -1) {
        w->n = c->cells.n; /* clear() keeps n, and today's the staged sources and the zero row */
        w->rs_z = c->cells.rs_z;
        memcpy(w->src0, c->cells.src0, (size_t)w->size * sizeof *w->src0);
        for (uint32_t i = 0; i < cc; i++) {
            w->src[i] = (int32_t)i; /* the restored states are kept as they are */
        }
        w->head = 0;
        w->used = cc;
        return KVC_OK;
    }
    rec_cells_copy(w, &c->cells);
    rec_seq_rm(c, w, seq_id, -1, -1);
    if (cc == 0) {
        return KVC_OK; /* the sequence is just removed */
    }
    return rec_place_one(c, w, seq_id, pos, err);
}

/* Give sequence seq_id (which holds no state in w) a cell of w whose state is kept as it is, at
 * position pos: the reference's find_slot of one token, as its sequence state reader does. */
static int rec_place_one(kvc_recurrent *c, kvc_rec_cells *w, int32_t seq_id, int32_t pos, kvc_err *err) {
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

int kvc_recurrent_state_read(kvc_recurrent *c, int32_t seq_id, const uint8_t *data, size_t len,
                             size_t *consumed, kvc_err *err) {
    return kvc_recurrent_state_read_ex(c, seq_id, data, len, 0, consumed, err);
}

int kvc_recurrent_state_read_lay(kvc_recurrent *c, int32_t seq_id, const uint8_t *data, size_t len,
                                 unsigned flags, unsigned layout, size_t *consumed, kvc_err *err) {
    size_t base = 0;
    *consumed = 0;
    /* the prefix is the one mark of a layout in a recurrent state: DETECT reads it when it is there */
    if (layout & (KVC_LAYOUT_PREFIX | KVC_LAYOUT_DETECT)) {
        const int rc = kvc_state_prefix_take(data, len, seq_id, &base, err);
        if (rc != KVC_OK) {
            return rc;
        }
    }
    if (!base) {
        return kvc_recurrent_state_read_ex(c, seq_id, data, len, flags, consumed, err);
    }
    int rc = kvc_recurrent_state_read_ex(c, seq_id, data + base, len - base, flags, consumed, err);
    if (rc != KVC_OK) {
        kvc_err_wrap(err, rc, "memory state (from byte %zu)", base);
    } else {
        *consumed += base;
    }
    return rc;
}

int kvc_recurrent_state_prepare(kvc_recurrent *c, int32_t seq_id, const uint8_t *data, size_t len, unsigned flags,
                                kvc_rec_plan *plan, kvc_err *err) {
    memset(plan, 0, sizeof *plan);
    if (seq_id < -1 || (seq_id >= 0 && (uint32_t)seq_id >= c->n_seq_max)) {
        return kvc_err_set(err, KVC_E_ARG, "seq_id %d is outside [0, %u) and not -1", seq_id, c->n_seq_max);
    }
    kvc_cursor r = { data, data ? len : 0, 0 };
    kvc_sec_dest d;
    kvc_section sec;
    int32_t pos1 = 0;
    memset(&sec, 0, sizeof sec);
    rec_dest(c, seq_id, &d);
    c->can_unplace = false;   /* the work table is where the read builds its cells */
    rec_dest_into(c, seq_id, &pos1, &d);
    int rc = kvc_sec_parse(&r, &d, &sec, err);
    if (rc == KVC_OK && (flags & KVC_STATE_EXACT)) {
        rc = kvc_state_check_end(r.off, r.len, err);
    }
    if (rc == KVC_OK) {
        rc = place_cells(c, seq_id, sec.cell_count, pos1, err);
    }
    if (rc == KVC_OK) {
        plan->data = data;
        plan->seq_id = seq_id;
        plan->cell_count = sec.cell_count;
        plan->data_off = sec.data_off;
        plan->len = r.off;
    }
    kvc_sec_free(&sec);
    return rc;
}

void kvc_recurrent_state_apply(kvc_recurrent *c, const kvc_rec_plan *plan) {
    /* the K/V data follow the V layout flag and the layer count, each after a 12-byte header */
    rec_swap_work(c);
    c->can_unplace = false;
    if (plan->seq_id == -1) {
        rec_zero_data(c);
    }
    const size_t head = c->cells.head, cc = plan->cell_count;
    const uint8_t *p = plan->data + plan->data_off + 8;
    for (uint32_t il = 0; il < c->n_layer; il++) {
        const kvc_layer *L = &c->layers[il];
        if (cc && L->k) {
            memcpy(L->k + head * L->k_row_bytes, p + 12, cc * L->k_row_bytes);
        }
        p += 12 + cc * L->k_row_bytes;
    }
    for (uint32_t il = 0; il < c->n_layer; il++) {
        const kvc_layer *L = &c->layers[il];
        if (cc && L->v) {
            memcpy(L->v + head * L->v_row_bytes, p + 12, cc * L->v_row_bytes);
        }
        p += 12 + cc * L->v_row_bytes;
    }
}

uint32_t kvc_recurrent_seq_rows(const kvc_recurrent *c, int32_t seq_id, const uint8_t **rows, uint64_t *offs,
                                uint64_t *lens) {
    const int32_t cell = c->cells.tail[seq_id];
    if (cell < 0) {
        return 0;
    }
    /* the state's data section ends it: the V layout flag and the layer count, then each row after
     * a 12-byte header (type, row size), as kvc_recurrent_state_apply reads it */
    uint64_t data = 8;
    for (uint32_t il = 0; il < c->n_layer; il++) {
        data += 24 + (uint64_t)c->layers[il].k_row_bytes + c->layers[il].v_row_bytes;
    }
    uint64_t off = kvc_recurrent_state_size_lay(c, seq_id, 0) - data + 8;
    /* the plane a pending rollback of the sequence reads (the one the state is written from) */
    const size_t row = (size_t)(c->n_rs_seq ? c->cells.rs_idx[seq_id] : 0) * c->cells.size + (size_t)cell;
    for (uint32_t k = 0; k < 2 * c->n_layer; k++) {
        const kvc_layer *L = &c->layers[k % c->n_layer];
        const bool is_k = k < c->n_layer;
        const size_t n = is_k ? L->k_row_bytes : L->v_row_bytes;
        const uint8_t *base = is_k ? L->k : L->v;
        rows[k] = base ? base + row * n : NULL;
        offs[k] = off + 12;
        lens[k] = n;
        off += 12 + n;
    }
    return 1;
}

int kvc_recurrent_state_read_ex(kvc_recurrent *c, int32_t seq_id, const uint8_t *data, size_t len, unsigned flags,
                                size_t *consumed, kvc_err *err) {
    kvc_rec_plan plan;
    *consumed = 0;
    const int rc = kvc_recurrent_state_prepare(c, seq_id, data, len, flags, &plan, err);
    if (rc != KVC_OK) {
        return rc;
    }
    kvc_recurrent_state_apply(c, &plan);
    *consumed = plan.len;
    return KVC_OK;
}

int kvc_recurrent_seq_restore(kvc_recurrent *c, int32_t seq_id, int32_t pos, uint32_t *cell, kvc_err *err) {
    if (seq_id < 0 || (uint32_t)seq_id >= c->n_seq_max || pos < 0) {
        return kvc_err_set(err, KVC_E_ARG, "seq_restore: sequence %d, position %d", seq_id, pos);
    }
    if (kvc_recurrent_seq_pos_max(c, seq_id) >= 0) {
        return kvc_err_set(err, KVC_E_ARG, "sequence %d holds a state already", seq_id);
    }
    rec_cells_copy(&c->work, &c->cells);
    rec_seq_rm(c, &c->work, seq_id, -1, -1);   /* a record left without a cell goes */
    const int r = rec_place_one(c, &c->work, seq_id, pos, err);
    if (r != KVC_OK) {
        return r == KVC_E_STATE ? KVC_E_NOSPACE : r;
    }
    rec_swap_work(c);
    c->can_unplace = true;
    c->n_warn = 0;
    c->warn[0] = 0;
    *cell = c->cells.head;
    return KVC_OK;
}

KVC_SEQ_OPS_DEFINE(kvc_recurrent, kvc_recurrent);
