/* kvcache — reading a memory state into a cache of semantics 2026 (see kvc_state_2026.h). */
#include "kvc_state_2026.h"

#include "kvc_reuse.h"

#include <inttypes.h>
#include <string.h>

/* Elements src[0, n) of el bytes into row at element cells[i] (constant-size moves for 2 and 4). */
static void scatter_elems(uint8_t *row, const int32_t *cells, const uint8_t *src, uint32_t n, size_t el) {
    if (el == 2) {
        for (uint32_t i = 0; i < n; i++) {
            memcpy(row + 2 * (size_t)cells[i], src + 2 * (size_t)i, 2);
        }
    } else if (el == 4) {
        for (uint32_t i = 0; i < n; i++) {
            memcpy(row + 4 * (size_t)cells[i], src + 4 * (size_t)i, 4);
        }
    } else {
        for (uint32_t i = 0; i < n; i++) {
            memcpy(row + el * (size_t)cells[i], src + el * i, el);
        }
    }
}

/* Copy the validated K/V data of section sec into cells[i] of its stream (cells NULL: cell i),
 * converting the V layout when the section's differs from the cache's. */
static void apply_data_2026(kvc_unified *c, const uint8_t *data, const kvc_state_sec *sec, const int32_t *cells) {
    const uint32_t cc = sec->cell_count;
    const size_t size = c->cells.size, base = (size_t)sec->stream * size;
    const size_t el = kvc_state_v_el(c);
    const bool stream = kvc_state_stream_data(c, cc);
    const uint8_t *p = data + sec->data_off + 8;
    for (uint32_t ikv = 0; ikv < c->n_layer; ikv++) {
        const kvc_layer *l = &c->layers[ikv];
        const size_t row = l->k_row_bytes;
        const uint8_t *src = p + 12;
        if (l->k && !cells) {
            kvc_copy(l->k + base * row, src, (size_t)cc * row, stream);
        } else if (l->k) {
            for (uint32_t i = 0; i < cc; i++) {
                kvc_copy(l->k + (base + (size_t)cells[i]) * row, src + (size_t)i * row, row, stream);
            }
        }
        p += 12 + (size_t)cc * row;
    }
    for (uint32_t ikv = 0; ikv < c->n_layer; ikv++) {
        const kvc_layer *l = &c->layers[ikv];
        const size_t row = l->v_row_bytes;
        const uint8_t *src = p + 12;
        if (l->v && (sec->v_trans != 0) != c->v_trans) {
            if (sec->v_trans) {
                kvc_state_v_transpose_in(l->v + base * row, row, src, cc, l->n_embd_v, el, 0, cells);
            } else {
                kvc_state_v_untranspose_in(l->v + base * row, (uint32_t)size, src, row, cc, l->n_embd_v, el, 0, cells);
            }
        } else if (l->v && c->v_trans && !cells) {
            /* per stream n_embd_v rows of size elements; the blob: n_embd_v rows of cc */
            kvc_state_v_rows_in(l->v + base * row, (uint32_t)size, src, cc, l->n_embd_v, el, 0, stream);
        } else if (l->v && c->v_trans) {
            uint8_t *v = l->v + base * row;
            for (uint32_t j = 0; j < l->n_embd_v; j++) {
                const uint8_t *sj = src + (size_t)j * cc * el;
                uint8_t *dj = v + (size_t)j * size * el;
                scatter_elems(dj, cells, sj, cc, el);
            }
        } else if (l->v && !cells) {
            kvc_copy(l->v + base * row, src, (size_t)cc * row, stream);
        } else if (l->v) {
            for (uint32_t i = 0; i < cc; i++) {
                kvc_copy(l->v + (base + (size_t)cells[i]) * row, src + (size_t)i * row, row, stream);
            }
        }
        /* both layouts hold cc * v_row_bytes bytes of data after a 12-byte header */
        p += 12 + (size_t)cc * row;
    }
    if (stream) {
        kvc_stream_fence();
    }
}

/* One section of a single sequence's state, as the reference reads it: remove the destination
 * sequence from its stream, then place the cells as one ubatch of it (find_slot, cont false). */
/* The ubatch a section of cc cells at positions pos is placed as: one group of seq_id. */
typedef struct read_ubatch {
    uint32_t   seq_off[2];
    int32_t    seq_ids[1];
    kvc_ubatch ub;
} read_ubatch;

static void read_ubatch_init(read_ubatch *r, int32_t seq_id, uint32_t cc, const int32_t *pos) {
    r->seq_off[0] = 0;
    r->seq_off[1] = 1;
    r->seq_ids[0] = seq_id;
    const kvc_ubatch ub = { cc, cc, 1, pos, r->seq_off, r->seq_ids, NULL, NULL, NULL };
    r->ub = ub;
}

int kvc_unified_state_place_2026(kvc_unified *c, int32_t seq_id, uint32_t cc, const int32_t *pos, bool evict) {
    read_ubatch r;
    read_ubatch_init(&r, seq_id, cc, pos);
    kvc_unified_seq_rm(c, seq_id, -1, -1);
    if (cc == 0) {
        return 1;
    }
    return evict ? kvc_unified_find_slot_2026(c, &r.ub, NULL) : kvc_unified_find_slot_2026_ask(c, &r.ub, NULL);
}

int kvc_unified_state_place_2026_at(kvc_unified *c, int32_t seq_id, uint32_t cc, const int32_t *pos,
                                    const int32_t *want) {
    read_ubatch r;
    read_ubatch_init(&r, seq_id, cc, pos);
    if (kvc_unified_stream_cells_c(c, kvc_unified_stream_of(c, seq_id))->seq_pos[seq_id].n != 0) {
        return 0;
    }
    return cc == 0 ? 1 : kvc_unified_find_slot_2026_at(c, &r.ub, want, NULL);
}

void kvc_unified_state_put_ext_2026(kvc_unified *c, uint32_t stream, uint32_t cc, const kvc_cell_ext *ext) {
    /* the saved extensions go back as they were (llama.cpp puts them back after placing) */
    kvc_cells *cells = kvc_unified_stream_cells(c, stream);
    for (uint32_t i = 0; ext && cells->ext && i < cc; i++) {
        cells->ext[c->scatter.idx[i]] = ext[i];
    }
}

/* The cells of stream st no placement takes without evicting: used, or held by the prefix index. */
static uint32_t taken(const kvc_unified *c, uint32_t st) {
    return kvc_unified_stream_cells_c(c, st)->used + (c->reuse ? kvc_reuse_held_free(c, st, UINT64_MAX) : 0);
}

/* The cells of seq_id's stream a placement takes without evicting once seq_id is removed: those
 * neither used nor held by the prefix index, and the cells only seq_id holds that the index does
 * not hold. O(cells of seq_id), the cache untouched. */
static uint32_t free_without(const kvc_unified *c, int32_t seq_id) {
    const uint32_t st = kvc_unified_stream_of(c, seq_id);
    const kvc_cells *tab = kvc_unified_stream_cells_c(c, st);
    const kvc_seq_pos *sp = &tab->seq_pos[seq_id];
    uint32_t gone = 0;
    for (uint32_t k = 0; k < sp->n; k++) {
        const uint32_t i = kvc_seq_key_cell(sp->key[k]);
        gone += kvc_cells_seq_count(tab, i) == 1 && !kvc_reuse_is_held(c, st, i);
    }
    return tab->size - taken(c, st) + gone;
}

/* The placement current before a dry run, which its searches and placements overwrite. */
typedef struct kept_slot {
    kvc_slot    slot;
    kvc_scatter scat;
    int32_t    *idx;
    uint32_t   *strm;
} kept_slot;

static bool slot_keep(const kvc_unified *c, kept_slot *k) {
    k->slot = c->slot;
    k->scat = c->scatter;
    k->idx = kvc_malloc_n(k->slot.n ? k->slot.n : 1, sizeof *k->idx);
    k->strm = kvc_malloc_n(c->n_stream, sizeof *k->strm);
    if (!k->idx || !k->strm) {
        kvc_free(k->idx);
        kvc_free(k->strm);
        return false;
    }
    memcpy(k->idx, k->scat.idx, (size_t)k->slot.n * sizeof *k->idx);
    memcpy(k->strm, k->scat.strm, (size_t)c->n_stream * sizeof *k->strm);
    return true;
}

/* The kept placement current again; k released. */
static void slot_back(kvc_unified *c, kept_slot *k) {
    memcpy(c->scatter.idx, k->idx, (size_t)k->slot.n * sizeof *k->idx);
    memcpy(c->scatter.strm, k->strm, (size_t)c->n_stream * sizeof *k->strm);
    c->scatter.n_groups = k->scat.n_groups;
    c->scatter.n_seq_tokens = k->scat.n_seq_tokens;
    c->slot = k->slot;
    kvc_free(k->idx);
    kvc_free(k->strm);
}

/* kvc_unified_state_try_place_2026 of one section into a sequence that holds no cell: the read's
 * removal changes nothing, and its placement takes the cells the search finds (it changes nothing
 * the search reads), so the dry run is the search alone: O(the cells searched), no copy of the
 * stream. The placement the cache had stays current. */
static int search_empty(kvc_unified *c, int32_t seq_id, const kvc_state_sec *sec, bool evict, int32_t *cells,
                        uint32_t *failed, uint32_t *used) {
    const uint32_t st = kvc_unified_stream_of(c, seq_id);
    *failed = 0;
    if (sec->cell_count == 0) {
        *used = taken(c, st);
        return 1;
    }
    kept_slot kept;
    if (!slot_keep(c, &kept)) {
        return KVC_E_NOMEM;
    }
    read_ubatch r;
    read_ubatch_init(&r, seq_id, sec->cell_count, sec->pos);
    const int found = kvc_unified_search_2026(c, &r.ub, evict, cells, NULL);
    *used = taken(c, st);
    slot_back(c, &kept);
    return found;
}

int kvc_unified_state_try_place_2026(kvc_unified *c, int32_t seq_id, const kvc_state_sec *secs, uint32_t n_sec,
                                     bool evict, int32_t *cells, uint32_t *failed, uint32_t *used) {
    const uint32_t st = kvc_unified_stream_of(c, seq_id);
    if (!cells && n_sec > 0) {
        /* every section fits in the cells free without the sequence (each is placed after the
         * removal of the one before, and a placement only adds free cells: a sliding window's
         * overwrites free cells of other sequences): room, answered without the dry run's copy of
         * the stream (the search takes free cells wherever the window lets it take others too) */
        const uint32_t room = free_without(c, seq_id);
        uint32_t k = 0;
        while (k < n_sec && secs[k].cell_count <= room) {
            k++;
        }
        if (k == n_sec) {
            *failed = n_sec - 1;
            *used = c->cells.size - room + secs[n_sec - 1].cell_count;
            return 1;
        }
    }
    if (n_sec == 1 && kvc_unified_stream_cells_c(c, st)->seq_pos[seq_id].n == 0) {
        return search_empty(c, seq_id, &secs[0], evict, cells, failed, used);
    }
    kvc_cells saved;
    kept_slot kept;
    const uint32_t head = kvc_unified_stream_head_c(c, st);
    /* with prefix reuse, what the dry run's placements change besides the cells: the sequence's
     * lock on the prefix it is attached to (the removal lets it go, so that placement may evict
     * that prefix as the read itself would) and the records of the cells placed */
    kvc_reuse *reuse = c->reuse;
    const size_t size = c->cells.size;
    const kvc_prefix_handle lock = reuse ? reuse->lock[seq_id] : (kvc_prefix_handle){ 0, 0 };
    kvc_reuse_cell *rec = reuse ? kvc_malloc_n(size, sizeof *rec) : NULL;
    if ((reuse && !rec) || !slot_keep(c, &kept)) {
        kvc_free(rec);
        return KVC_E_NOMEM;
    }
    if (kvc_cells_snapshot(&saved, kvc_unified_stream_cells(c, st)) != KVC_OK) {
        slot_back(c, &kept);
        kvc_free(rec);
        return KVC_E_NOMEM;
    }
    if (reuse) {
        memcpy(rec, reuse->rec + (size_t)st * size, size * sizeof *rec);
    }
    /* without evicting, a section that needs eviction is not placed: the next one's removal of
     * the sequence leaves the cells as if it had been, so each is asked of the same cells */
    int found = 1, evicting = 0;
    uint32_t k;
    for (k = 0; k < n_sec && (found == 1 || found == KVC_ROOM_EVICTING); k++) {
        found = kvc_unified_state_place_2026(c, seq_id, secs[k].cell_count, secs[k].pos, evict);
        evicting |= found == KVC_ROOM_EVICTING;
    }
    if (found == 1 && evicting) {
        found = KVC_ROOM_EVICTING;
    }
    if (found == 1 && cells && n_sec > 0) {
        memcpy(cells, c->scatter.idx, (size_t)secs[n_sec - 1].cell_count * sizeof *cells);
    }
    *failed = k - 1;
    /* the cells no placement takes without evicting: used, or held by the prefix index */
    *used = taken(c, st);
    kvc_cells_copy(kvc_unified_stream_cells(c, st), &saved);
    *kvc_unified_stream_head(c, st) = head;
    slot_back(c, &kept);
    if (reuse) {
        /* the sequence holds its cells again: its records and its lock back (unless the dry run
         * evicted the prefix: then the index let the cells go, and they are the sequence's alone) */
        memcpy(reuse->rec + (size_t)st * size, rec, size * sizeof *rec);
        if (lock.node && reuse->lock[seq_id].node == 0 && kvc_prefix_handle_valid(&reuse->idx, lock) &&
            kvc_prefix_lock(&reuse->idx, lock, NULL) == KVC_OK) {
            reuse->lock[seq_id] = lock;
        }
    }
    kvc_cells_free(&saved);
    kvc_free(rec);
    return found;
}

/* The dry run of a single sequence's sections: is there room for each in turn? */
static int check_room_2026(kvc_unified *c, const kvc_state_plan *plan, bool evict, kvc_err *err) {
    uint32_t failed = 0, used = 0;
    const kvc_state_sec *secs = kvc_state_plan_secs(plan);
    const int found = kvc_unified_state_try_place_2026(c, plan->seq_id, secs, plan->n_sec, evict, NULL, &failed,
                                                       &used);
    if (found == 1 || found == KVC_ROOM_EVICTING) {
        return found == 1 ? KVC_OK : KVC_ROOM_EVICTING;
    }
    if (found < 0) {
        return kvc_err_set(err, found, "out of memory restoring sequence %" PRId32, plan->seq_id);
    }
    return kvc_err_set(err, KVC_E_STATE,
                       "no room: sequence %" PRId32 " needs %" PRIu32 " free cells in stream %" PRIu32
                       " (%" PRIu32 " cells, %" PRIu32 " used or held by the prefix index without the sequence)",
                       plan->seq_id, secs[failed].cell_count, kvc_unified_stream_of(c, plan->seq_id),
                       c->cells.size, used);
}

int kvc_state_prepare_2026(kvc_unified *c, int32_t seq_id, const uint8_t *data, size_t len, unsigned flags,
                           unsigned layout, kvc_state_plan *plan, kvc_err *err) {
    return kvc_state_plan_prepare(c, seq_id, data, len, flags, layout, check_room_2026, plan, err);
}

int kvc_state_apply_2026(kvc_unified *c, const kvc_state_plan *plan) {
    const kvc_state_sec *secs = kvc_state_plan_secs(plan);
    if (plan->seq_id < 0) {
        /* clear (every stream, heads 0; queued stream copies stay), then cell k of section s into
         * cell k of stream s; of the K/V data only what no section overwrites is zeroed (the
         * K/V bytes end as llama.cpp's clear and read leave them) */
        kvc_unified_clear_cells(c);
        uint32_t filled[KVC_MAX_SEQ] = { 0 };
        for (uint32_t k = 0; k < plan->n_sec; k++) {
            filled[secs[k].stream] = secs[k].cell_count;
        }
        for (uint32_t s = 0; s < c->n_stream; s++) {
            kvc_unified_zero_cells(c, s, filled[s], c->cells.size);
        }
        const uint32_t nw = c->cells.seq_words;
        for (uint32_t k = 0; k < plan->n_sec; k++) {
            const kvc_state_sec *sec = &secs[k];
            kvc_cells *cells = kvc_unified_stream_cells(c, sec->stream);
            kvc_seqset touched;
            kvc_seqset_clear(&touched);
            for (uint32_t i = 0; i < sec->cell_count; i++) {
                const uint64_t *set = sec->seq + (size_t)i * nw;
                kvc_cells_set_raw(cells, i, sec->pos[i], set);
                if (sec->ext) {
                    cells->ext[i] = sec->ext[i];
                }
                for (uint32_t w = 0; w < nw; w++) {
                    touched.w[w] |= set[w];
                }
            }
            kvc_cells_rebuild_seq_pos(cells, &touched);
            if (sec->cell_count) {
                apply_data_2026(c, plan->data, sec, NULL);
            }
        }
        return KVC_OK;
    }
    /* the same steps on the same cells as the prepare's dry run: the same cells, room found */
    for (uint32_t k = 0; k < plan->n_sec; k++) {
        const kvc_state_sec *sec = &secs[k];
        if (kvc_unified_state_place_2026(c, plan->seq_id, sec->cell_count, sec->pos, true) == 1 && sec->cell_count) {
            apply_data_2026(c, plan->data, sec, c->scatter.idx);
            kvc_unified_state_put_ext_2026(c, sec->stream, sec->cell_count, sec->ext);
        }
    }
    kvc_unified_slot_drop(c);
    return KVC_OK;
}
