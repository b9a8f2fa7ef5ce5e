/* kvcache — the two recurrent cache types (see kvc_recurrent_ops.h). */
#include "kvc_recurrent_ops.h"

/* --- construction ---------------------------------------------------------------------------- */

static int rec_check_2025(const kvc_recurrent_params *p, kvc_err *err) {
    if (p->n_rs_seq) {
        return kvc_err_set(err, KVC_E_ARG, "n_rs_seq = %u: expected 0 (mid-2025 llama.cpp keeps no snapshots)",
                           p->n_rs_seq);
    }
    return KVC_OK;
}

static int rec_check_2026(const kvc_recurrent_params *p, kvc_err *err) {
    if (p->n_rs_seq > KVC_REC_MAX_RS_SEQ) {
        return kvc_err_set(err, KVC_E_ARG, "n_rs_seq = %u: expected at most %u", p->n_rs_seq, KVC_REC_MAX_RS_SEQ);
    }
    return KVC_OK;
}

/* --- find_slot --------------------------------------------------------------------------------- */

/* Whether find_slot searches from cell 0: head lies further than twice this past `used`. */
static uint32_t rec_head_reset_tokens(const kvc_ubatch *ub) { return ub->n_tokens; }
static uint32_t rec_head_reset_seqs(const kvc_ubatch *ub) { return ub->n_seqs; }

/* Mid-2025's find_slot ends with the cells placed: s_copy / s_mask read `src` itself. */
static int rec_stage_none(const kvc_recurrent *c, kvc_rec_cells *t, uint32_t min, uint32_t max,
                          const kvc_ubatch *ub, kvc_err *err) {
    (void)c, (void)t, (void)min, (void)max, (void)ub, (void)err;
    return KVC_OK;
}

/* Today's end of find_slot: the first cell of [min, max] no cell copies from becomes the zero
 * state rs_z; every cell of the range stages its source in src0 (rs_z when its state is new) and
 * becomes its own source. The n_seqs cells from min on are the ubatch's: their last ubatch wrote
 * snapshot planes 1 .. min(n_seq_tokens - 1, n_rs_seq) (kvcache's record for rule C9). */
static int rec_stage_sources(const kvc_recurrent *c, kvc_rec_cells *t, uint32_t min, uint32_t max,
                             const kvc_ubatch *ub, kvc_err *err) {
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
    const uint32_t kept = ub->n_seq_tokens - 1 < c->n_rs_seq ? ub->n_seq_tokens - 1 : c->n_rs_seq;
    for (uint32_t g = 0; g < ub->n_seqs; g++) {
        t->snap[min + g] = kept;
    }
    return KVC_OK;
}

/* --- rollback ---------------------------------------------------------------------------------- */

/* Mid-2025's seq_rm never rolls back: a cut inside a state is refused. */
static int32_t rec_rollback_none(const kvc_rec_cells *t, int32_t s, int32_t p0, int64_t p1) {
    (void)t, (void)s, (void)p0, (void)p1;
    return 0;
}

/* Today's: seq_rm(s, p0, p1) with 0 < p0 <= the state's position < p1 rolls it back to p0 - 1. */
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

/* --- the graph inputs (the range is checked by kvc_recurrent_s_copy / _s_mask) ----------------- */

/* Mid-2025: the cell to copy from, `src` updated in place (the copy happens once). */
static int rec_s_copy_2025(kvc_recurrent *c, uint32_t count, int32_t *out) {
    kvc_rec_cells *t = &c->cells;
    for (uint32_t i = 0; i < count; i++) {
        const int32_t cell = (int32_t)(t->head + i);
        /* out-of-range sources read the cell itself */
        if (t->src[cell] < 0 || (uint32_t)t->src[cell] >= t->size) {
            t->src[cell] = cell;
        }
        out[i] = t->src[cell];
        t->src[cell] = cell;
    }
    return KVC_OK;
}

static int rec_s_mask_2025(kvc_recurrent *c, uint32_t count, float *out) {
    kvc_rec_cells *t = &c->cells;
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

/* Today: the row to read, in the plane a pending rollback of the cell's first sequence names
 * (read once). */
static int rec_s_copy_2026(kvc_recurrent *c, uint32_t count, int32_t *out) {
    kvc_rec_cells *t = &c->cells;
    for (uint32_t i = 0; i < count; i++) {
        const uint32_t cell = t->head + i;
        uint32_t plane = 0;
        const int32_t first = kvc_seqs_next(t->seq, t->size, t->seq_words, cell, -1);
        if (c->n_rs_seq && first >= 0) {
            plane = t->rs_idx[first];
            t->rs_idx[first] = 0;
        }
        out[i] = (int32_t)(plane * t->size) + t->src0[cell];
    }
    return KVC_OK;
}

/* Today's graph has no s_mask: it zeroes row rs_z instead. */
static int rec_s_mask_refused(kvc_recurrent *c, uint32_t count, float *out) {
    (void)c, (void)count, (void)out;
    return KVC_E_ARG;
}

/* --- the types --------------------------------------------------------------------------------- */

const kvc_recurrent_ops kvc_recurrent_2025_ops = {
    .semantics = KVC_REC_2025,
    .check = rec_check_2025,
    .head_reset_count = rec_head_reset_tokens,
    .stage = rec_stage_none,
    .rollback_len = rec_rollback_none,
    .s_copy = rec_s_copy_2025,
    .s_mask = rec_s_mask_2025,
    .checkpoints = false,
};

const kvc_recurrent_ops kvc_recurrent_2026_ops = {
    .semantics = KVC_REC_2026,
    .check = rec_check_2026,
    .head_reset_count = rec_head_reset_seqs,
    .stage = rec_stage_sources,
    .rollback_len = rec_rollback_len,
    .s_copy = rec_s_copy_2026,
    .s_mask = rec_s_mask_refused,
    .checkpoints = true,
};

const kvc_recurrent_ops *kvc_recurrent_ops_of(int32_t semantics) {
    switch (semantics) {
    case KVC_REC_2025:
        return &kvc_recurrent_2025_ops;
    case KVC_REC_2026:
        return &kvc_recurrent_2026_ops;
    default:
        return NULL;
    }
}

int kvc_recurrent_init(kvc_recurrent *c, const kvc_recurrent_params *p, kvc_err *err) {
    return kvc_recurrent_construct(c, p, kvc_recurrent_ops_of(p->semantics), err);
}
