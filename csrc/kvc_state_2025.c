/* kvcache — reading a memory state into a unified cache of the seed's semantics (see
 * kvc_state_2025.h). */
#include "kvc_state_2025.h"

#include "kvc_defrag.h"

#include <inttypes.h>
#include <string.h>

/* Copy the validated K/V data of the blob into cells [dst, dst + cc), converting the V layout
 * when the blob's differs from the cache's. */
static void apply_data(kvc_unified *c, const uint8_t *data, const kvc_state_sec *sec, uint32_t dst) {
    const uint32_t cc = sec->cell_count;
    const uint32_t size = c->cells.size;
    const bool blob_vt = sec->v_trans != 0;
    const bool stream = kvc_state_stream_data(c, cc);
    const uint8_t *p = data + sec->data_off + 8;
    for (uint32_t ikv = 0; ikv < c->n_layer; ikv++) {
        const kvc_layer *l = &c->layers[ikv];
        if (l->k && cc) {
            kvc_copy(l->k + (size_t)dst * l->k_row_bytes, p + 12, (size_t)cc * l->k_row_bytes, stream);
        }
        p += 12 + (size_t)cc * l->k_row_bytes;
    }
    const size_t el = kvc_state_v_el(c);
    for (uint32_t ikv = 0; ikv < c->n_layer; ikv++) {
        const kvc_layer *l = &c->layers[ikv];
        const uint8_t *src = p + 12;
        if (l->v && cc) {
            if (blob_vt && c->v_trans) {
                kvc_state_v_rows_in(l->v, size, src, cc, l->n_embd_v, el, dst, stream);
            } else if (blob_vt) {
                kvc_state_v_transpose_in(l->v, l->v_row_bytes, src, cc, l->n_embd_v, el, dst, NULL);
            } else if (c->v_trans) {
                kvc_state_v_untranspose_in(l->v, size, src, l->v_row_bytes, cc, l->n_embd_v, el, dst, NULL);
            } else {
                kvc_copy(l->v + (size_t)dst * l->v_row_bytes, src, (size_t)cc * l->v_row_bytes, stream);
            }
        }
        /* both layouts hold cc * v_row_bytes bytes of data after a 12-byte header */
        p += 12 + (size_t)cc * l->v_row_bytes;
    }
    if (stream) {
        kvc_stream_fence();
    }
}

/* Whole cache: clear, cell k of the state into cell k, head 0 (the reference's order). The data
 * of cells [0, cell_count) is overwritten below, so only the rest is zeroed. */
static void apply_whole(kvc_unified *c, const kvc_state_plan *plan) {
    static const kvc_state_sec none = { 0 };
    const kvc_state_sec *ps = plan->n_sec ? kvc_state_plan_secs(plan) : &none;
    /* the cache is replaced: a placement or an undo log from before would refer to cells that
     * now hold the state's (a restore() would empty them) */
    kvc_unified_slot_drop(c);
    kvc_unified_commit(c);
    kvc_cells_reset(&c->cells);
    c->head = 0;
    kvc_unified_zero_cells(c, 0, ps->cell_count, c->cells.size);
    const uint32_t nw = c->cells.seq_words;
    kvc_seqset touched;
    kvc_seqset_clear(&touched);
    for (uint32_t i = 0; i < ps->cell_count; i++) {
        const uint64_t *set = ps->seq + (size_t)i * nw;
        kvc_cells_set_raw(&c->cells, i, ps->pos[i], set);
        for (uint32_t w = 0; w < nw; w++) {
            touched.w[w] |= set[w];
        }
    }
    kvc_cells_rebuild_seq_pos(&c->cells, &touched);
    c->head = 0;
    if (ps->cell_count) {
        apply_data(c, plan->data, ps, 0);
    }
}

/* Single sequence, as the reference restores one: remove the destination sequence, then let the
 * slot search place the state's cells as one ubatch of cell_count tokens of seq_id. Returns 1
 * when placed (at *head, c->head), 0 when there is no room, KVC_E_NOMEM; c is changed in every
 * case. dry (a sequence that holds no cell, whose removal changes nothing): the placement undone
 * at once (kvc_unified_find_slot_2025_dry), c unchanged. */
static int place_cells(kvc_unified *c, int32_t seq_id, const kvc_state_sec *ps, bool dry, uint32_t *head) {
    const uint32_t cc = ps->cell_count;
    const uint32_t seq_off[2] = { 0, 1 };
    const int32_t seq_ids[1] = { seq_id };
    const kvc_ubatch ub = { cc, cc, 1, ps->pos, seq_off, seq_ids, NULL, NULL, NULL };
    int found;
    if (dry) {
        found = kvc_unified_find_slot_2025_dry(c, &ub, NULL, head);
    } else {
        kvc_unified_seq_rm(c, seq_id, -1, -1);
        found = kvc_unified_find_slot(c, &ub);
        *head = c->head;
    }
    if (found == 1 && *head + cc > c->cells.size) {
        return KVC_E_INTERNAL; /* find_slot places a ubatch as one run at head */
    }
    return found;
}

/* The dry run of place_cells: is there room? Nothing observable changes (the recovery arrays may
 * grow, which is what lets the apply's own slot search succeed without allocating). An empty
 * section only removes the sequence (contract C1b): always possible. */
static int check_room(kvc_unified *c, const kvc_state_plan *plan, bool evict, kvc_err *err) {
    (void)evict;   /* the seed's cache has no prefix index */
    const kvc_state_sec *ps = kvc_state_plan_secs(plan);
    const uint32_t cc = ps->cell_count;
    kvc_unified_snapshot snap;
    if (cc == 0) {
        return KVC_OK;
    }
    int found;
    uint32_t head = 0;
    if (kvc_unified_seq_pos_max(c, plan->seq_id) < 0) {
        found = place_cells(c, plan->seq_id, ps, true, &head);   /* no copy of the cache */
    } else {
        if (kvc_unified_snapshot_take(c, &snap) != KVC_OK) {
            return kvc_err_set(err, KVC_E_NOMEM, "out of memory restoring %" PRIu32 " cells", cc);
        }
        /* the dry run is undone: it must not settle a pending defrag (move rows) either */
        c->defrag_pending = false;
        found = place_cells(c, plan->seq_id, ps, false, &head);
        kvc_unified_snapshot_restore(c, &snap);
        kvc_unified_snapshot_free(&snap);
    }
    if (found == 1) {
        return KVC_OK;
    }
    if (found == 0) {
        return kvc_err_set(err, KVC_E_STATE,
                           "no room: sequence %" PRId32 " needs %" PRIu32
                           " contiguous free cells, the cache has no such run (%" PRIu32 " cells, %" PRIu32
                           " used)",
                           plan->seq_id, cc, c->cells.size, c->cells.used);
    }
    if (found == KVC_E_INTERNAL) {
        return kvc_err_set(err, found, "slot at %" PRIu32 " for %" PRIu32 " cells exceeds the cache", head, cc);
    }
    return kvc_err_set(err, found, "out of memory restoring %" PRIu32 " cells", cc);
}

int kvc_state_prepare_2025(kvc_unified *c, int32_t seq_id, const uint8_t *data, size_t len, unsigned flags,
                           unsigned layout, kvc_state_plan *plan, kvc_err *err) {
    return kvc_state_plan_prepare(c, seq_id, data, len, flags, layout, check_room, plan, err);
}

int kvc_state_apply_2025(kvc_unified *c, const kvc_state_plan *plan) {
    kvc_unified_defrag_settle(c);
    if (plan->seq_id < 0) {
        apply_whole(c, plan);
        return KVC_OK;
    }
    const kvc_state_sec *sec = kvc_state_plan_secs(plan);
    if (plan->n_sec == 0 || sec->cell_count == 0) {
        kvc_unified_seq_rm(c, plan->seq_id, -1, -1);
        return KVC_OK;
    }
    /* the same search on the same cells as the prepare's dry run: same slot, no allocation */
    uint32_t head;
    const int found = place_cells(c, plan->seq_id, sec, false, &head);
    if (found != 1) {
        return found < 0 ? found : KVC_E_INTERNAL;
    }
    kvc_unified_commit(c);
    kvc_unified_slot_drop(c);
    apply_data(c, plan->data, sec, c->head);
    return KVC_OK;
}
