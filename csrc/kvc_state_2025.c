/* kvcache — reading a memory state into a unified cache of the seed's semantics (see
 * kvc_state_2025.h). */
#include "kvc_state_2025.h"

#include "kvc_defrag.h"

#include <inttypes.h>
#include <string.h>

/* Validate one cache's memory state in a layout (a cache of the seed's semantics: one stream).
 * With streams, an empty section changes nothing of a single sequence; a whole-cache read has
 * cleared the cache (llama.cpp clears once, before the sections). sec->pos and sec->seq must be
 * released by the caller in every case. */
static int parse_state(const kvc_unified *c, int32_t seq_id, const uint8_t *data, size_t len, unsigned flags,
                       unsigned layout, kvc_section *sec, bool *noop, kvc_err *err) {
    kvc_cursor r = { data, data ? len : 0, 0 };
    const kvc_state_stream ref = { c, 0 };
    kvc_sec_dest d;
    kvc_frame f;
    kvc_state_dest(&ref, seq_id, flags, layout, &d);
    *noop = false;
    int rc = kvc_frame_begin(&r, layout, kvc_unified_n_stream(c), &f, err);
    for (uint32_t s = 0; rc == KVC_OK && s < f.n_stream; s++) {
        if (kvc_frame_take_empty(&r, &f)) {
            *noop = seq_id >= 0;
            sec->end = r.off;
            continue;
        }
        rc = kvc_sec_parse(&r, &d, sec, err);
    }
    return rc;
}

/* Copy the validated K/V data of the blob into cells [dst, dst + cc), converting the V layout
 * when the blob's differs from the cache's. */
static void apply_data(kvc_unified *c, const kvc_state_plan *ps, uint32_t dst) {
    const uint32_t cc = ps->cell_count;
    const uint32_t size = c->cells.size;
    const bool blob_vt = ps->v_trans != 0;
    const bool stream = kvc_state_stream_data(c, cc);
    const uint8_t *p = ps->data + ps->data_off + 8;
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
static void apply_whole(kvc_unified *c, const kvc_state_plan *ps) {
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
        apply_data(c, ps, 0);
    }
}

/* Single sequence, as the reference restores one: remove the destination sequence, then let the
 * slot search place the state's cells as one ubatch of cell_count tokens of seq_id. Returns 1
 * when placed (at c->head), 0 when there is no room, KVC_E_NOMEM; c is changed in every case. */
static int place_cells(kvc_unified *c, const kvc_state_plan *ps) {
    const uint32_t cc = ps->cell_count;
    const int32_t seq_id = ps->seq_id;
    const uint32_t seq_off[2] = { 0, 1 };
    const int32_t seq_ids[1] = { seq_id };
    const kvc_ubatch ub = { cc, cc, 1, ps->pos, seq_off, seq_ids, NULL, NULL, NULL };
    kvc_unified_seq_rm(c, seq_id, -1, -1);
    const int found = kvc_unified_find_slot(c, &ub);
    if (found == 1 && c->head + cc > c->cells.size) {
        return KVC_E_INTERNAL; /* find_slot places a ubatch as one run at head */
    }
    return found;
}

/* The dry run of place_cells: is there room? Nothing observable changes (the recovery arrays may
 * grow, which is what lets the apply's own slot search succeed without allocating). */
static int check_room(kvc_unified *c, const kvc_state_plan *ps, kvc_err *err) {
    const uint32_t cc = ps->cell_count;
    kvc_unified_snapshot snap;
    if (kvc_unified_snapshot_take(c, &snap) != KVC_OK) {
        return kvc_err_set(err, KVC_E_NOMEM, "out of memory restoring %" PRIu32 " cells", cc);
    }
    /* the dry run is undone: it must not settle a pending defrag (move rows) either */
    c->defrag_pending = false;
    const int found = place_cells(c, ps);
    const uint32_t head = c->head;
    kvc_unified_snapshot_restore(c, &snap);
    kvc_unified_snapshot_free(&snap);
    if (found == 1) {
        return KVC_OK;
    }
    if (found == 0) {
        return kvc_err_set(err, KVC_E_STATE,
                           "no room: sequence %" PRId32 " needs %" PRIu32
                           " contiguous free cells, the cache has no such run (%" PRIu32 " cells, %" PRIu32
                           " used)",
                           ps->seq_id, cc, c->cells.size, c->cells.used);
    }
    if (found == KVC_E_INTERNAL) {
        return kvc_err_set(err, found, "slot at %" PRIu32 " for %" PRIu32 " cells exceeds the cache", head, cc);
    }
    return kvc_err_set(err, found, "out of memory restoring %" PRIu32 " cells", cc);
}

int kvc_state_prepare_2025(kvc_unified *c, int32_t seq_id, const uint8_t *data, size_t len, unsigned flags,
                           unsigned layout, kvc_state_plan *plan, kvc_err *err) {
    kvc_section ps;
    memset(&ps, 0, sizeof ps);
    bool noop;
    int rc = parse_state(c, seq_id, data, len, flags, layout, &ps, &noop, err);
    plan->data = data;
    plan->seq_id = seq_id;
    plan->cell_count = ps.cell_count;
    plan->data_off = ps.data_off;
    plan->len = ps.end;
    plan->pos = ps.pos; /* owned by the plan from here */
    plan->seq = ps.seq;
    plan->v_trans = ps.v_trans;
    plan->noop = noop;
    if (rc == KVC_OK && noop) {
        plan->cell_count = 0;
    }
    /* an empty single-sequence part only removes the sequence (contract C1b): always possible */
    if (rc == KVC_OK && seq_id >= 0 && plan->cell_count > 0) {
        rc = check_room(c, plan, err);
    }
    if (rc != KVC_OK) {
        kvc_state_plan_free(plan);
    }
    return rc;
}

int kvc_state_apply_2025(kvc_unified *c, const kvc_state_plan *plan) {
    kvc_unified_defrag_settle(c);
    if (plan->seq_id < 0) {
        apply_whole(c, plan);
        return KVC_OK;
    }
    if (plan->cell_count == 0) {
        kvc_unified_seq_rm(c, plan->seq_id, -1, -1);
        return KVC_OK;
    }
    /* the same search on the same cells as the prepare's dry run: same slot, no allocation */
    const int found = place_cells(c, plan);
    if (found != 1) {
        return found < 0 ? found : KVC_E_INTERNAL;
    }
    kvc_unified_commit(c);
    kvc_unified_slot_drop(c);
    apply_data(c, plan, c->head);
    return KVC_OK;
}
