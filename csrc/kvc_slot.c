/* kvcache — placing ubatches in a unified cache (see kvc_slot.h). */
#include "kvc_slot.h"

#include "kvc_types.h"

#include <string.h>

/* --- the undo log ---------------------------------------------------------------------- */

int kvc_undo_init(kvc_undo *u, uint32_t seq_words) {
    memset(u, 0, sizeof *u);
    u->seq_words = seq_words;
    u->cap_spans = 4;
    u->spans = kvc_malloc_n(u->cap_spans, sizeof *u->spans);
    u->cap_cells = 64;
    u->pos = kvc_malloc_n(u->cap_cells, sizeof *u->pos);
    u->seq = kvc_malloc_n((uint64_t)u->cap_cells * seq_words, sizeof *u->seq);
    if (!u->spans || !u->pos || !u->seq) {
        kvc_undo_free(u);
        return KVC_E_NOMEM;
    }
    return KVC_OK;
}

void kvc_undo_free(kvc_undo *u) {
    kvc_free(u->spans);
    kvc_free(u->pos);
    kvc_free(u->seq);
    memset(u, 0, sizeof *u);
}

/* Make room for one more span of n cells (before anything changes). */
static int kvc_undo_reserve(kvc_undo *u, uint32_t n) {
    if (u->n_spans == u->cap_spans) {
        const uint32_t cap = u->cap_spans * 2;
        kvc_undo_span *r = kvc_realloc_n(u->spans, cap, sizeof *r);
        if (!r) {
            return KVC_E_NOMEM;
        }
        u->spans = r;
        u->cap_spans = cap;
    }
    if ((uint64_t)u->n_cells + n > u->cap_cells) {
        uint64_t cap = u->cap_cells;
        while (cap < (uint64_t)u->n_cells + n) {
            cap *= 2;
        }
        if (cap > UINT32_MAX) {
            return KVC_E_NOMEM;
        }
        int32_t *rp = kvc_realloc_n(u->pos, cap, sizeof *rp);
        if (!rp) {
            return KVC_E_NOMEM;
        }
        u->pos = rp;
        uint64_t *rs = kvc_realloc_n(u->seq, cap * u->seq_words, sizeof *rs);
        if (!rs) {
            return KVC_E_NOMEM;
        }
        u->seq = rs;
        u->cap_cells = (uint32_t)cap;
    }
    return KVC_OK;
}

/* Record cells [i, i + n) as they are now (room was reserved). */
static void kvc_undo_push(kvc_undo *u, const kvc_cells *cells, uint32_t i, uint32_t n) {
    const uint32_t nw = u->seq_words;
    kvc_undo_span *r = &u->spans[u->n_spans++];
    r->i = i;
    r->n = n;
    r->off = u->n_cells;
    memcpy(u->pos + r->off, cells->pos + i, (size_t)n * sizeof *cells->pos);
    if (nw == 1) {
        memcpy(u->seq + r->off, cells->seq + i, (size_t)n * sizeof *cells->seq);
    } else {
        for (uint32_t j = 0; j < n; j++) {
            kvc_seqs_get(cells->seq, cells->size, nw, i + j, u->seq + (size_t)(r->off + j) * nw);
        }
    }
    u->n_cells += n;
}

/* Put span k's cells back as they were; adds the sequences it touched to *touched. */
static void kvc_undo_apply(const kvc_undo *u, uint32_t k, kvc_cells *cells, kvc_seqset *touched) {
    const uint32_t nw = u->seq_words;
    const kvc_undo_span *r = &u->spans[k];
    for (uint32_t j = 0; j < r->n; j++) {
        const uint64_t *was = u->seq + (size_t)(r->off + j) * nw;
        kvc_cells_seq_or_into(cells, r->i + j, touched);
        for (uint32_t w = 0; w < nw; w++) {
            touched->w[w] |= was[w];
        }
        kvc_cells_set_raw(cells, r->i + j, u->pos[r->off + j], was);
    }
}

/* --- slot search ----------------------------------------------------------------------- */

/* The seed's search loop, with runs of used cells skipped 64 at a time. `n_tested` counts the
 * cells the head has travelled over; the search gives up once it reaches the cache size
 * (checked only after a failed window, as the seed does). */
static bool kvc_unified_search(kvc_unified *c, uint32_t n_tokens) {
    const kvc_cells *cells = &c->cells;
    const uint32_t size = cells->size;
    uint64_t n_tested = 0;
    uint32_t head = c->head;
    bool found;

    for (;;) {
        if ((uint64_t)head + n_tokens > size) {
            n_tested += size - head;
            head = 0;
            continue;
        }
        const uint32_t j = kvc_cells_next_used(cells, head, head + n_tokens);
        if (j == head + n_tokens) {
            found = true;
            break;
        }
        n_tested += (uint64_t)j + 1 - head;
        head = j + 1;
        if (n_tested >= size) {
            found = false;
            break;
        }
        /* the seed steps over used cells one at a time while the window still fits */
        const uint32_t last_fit = size - n_tokens;
        if (head <= last_fit) {
            uint32_t stop = kvc_cells_next_empty(cells, head, last_fit + 1);
            const uint64_t steps = stop - head;
            if (n_tested + steps >= size) {
                head += (uint32_t)(size - n_tested);
                found = false;
                break;
            }
            n_tested += steps;
            head = stop;
        }
    }
    c->head = head;
    return found;
}

int kvc_unified_find_slot(kvc_unified *c, const kvc_ubatch *ub) {
    kvc_cells *cells = &c->cells;
    const uint32_t n_tokens = ub->n_tokens;

    if (n_tokens <= cells->size && kvc_undo_reserve(&c->undo, n_tokens) != KVC_OK) {
        return KVC_E_NOMEM;
    }
    kvc_unified_defrag_settle(c);
    kvc_unified_slot_drop(c);

    /* plenty of free cells before head: search from the beginning, hoping to fill it */
    if ((uint64_t)c->head > (uint64_t)cells->used + 2 * (uint64_t)n_tokens) {
        c->head = 0;
    }
    if (n_tokens > cells->size) {
        return 0;
    }
    if (!kvc_unified_search(c, n_tokens)) {
        return 0;
    }

    const uint32_t head = c->head;
    kvc_undo_push(&c->undo, cells, head, n_tokens);
    for (uint32_t t = 0; t < n_tokens; t++) {
        const uint32_t g = t / ub->n_seq_tokens;
        kvc_cells_pos_set(cells, head + t, ub->pos[t]);
        for (uint32_t k = ub->seq_off[g]; k < ub->seq_off[g + 1]; k++) {
            kvc_cells_seq_add(cells, head + t, ub->seq_ids[k]);
        }
    }

    /* attend only to the part of the cache in use, padded */
    uint32_t n = kvc_pad_u32(cells->used_max_p1, c->n_pad);
    if (n < c->n_pad) {
        n = c->n_pad;
    }
    c->n = n < cells->size ? n : cells->size;
    c->slot.head = head;
    c->slot.n = n_tokens;
    return 1;
}

void kvc_unified_commit(kvc_unified *c) {
    c->undo.n_spans = 0;
    c->undo.n_cells = 0;
}

void kvc_unified_restore(kvc_unified *c) {
    kvc_seqset touched;
    kvc_seqset_clear(&touched);
    kvc_unified_defrag_settle(c);
    kvc_unified_slot_drop(c);
    for (uint32_t k = 0; k < c->undo.n_spans; k++) {
        kvc_undo_apply(&c->undo, k, &c->cells, &touched);
    }
    kvc_cells_rebuild_seq_pos(&c->cells, &touched);
    kvc_unified_commit(c);
}

void kvc_unified_set_full(kvc_unified *c) {
    kvc_unified_slot_drop(c);
    c->n = c->cells.size;
    c->head = 0;
}

/* --- rewind ---------------------------------------------------------------------------- */

void kvc_unified_mark_take(const kvc_unified *c, kvc_unified_mark *m) {
    m->head = c->head;
    m->n = c->n;
    m->slot = c->slot;
    m->n_spans = c->undo.n_spans;
    m->n_cells = c->undo.n_cells;
}

int kvc_unified_rewind(kvc_unified *c, const kvc_unified_mark *m) {
    if (c->undo.n_spans < m->n_spans || c->undo.n_cells < m->n_cells) {
        return KVC_E_ARG;
    }
    kvc_seqset touched;
    kvc_seqset_clear(&touched);
    /* newest first, so that a cell written twice ends as the oldest snapshot had it */
    for (uint32_t k = c->undo.n_spans; k-- > m->n_spans;) {
        kvc_undo_apply(&c->undo, k, &c->cells, &touched);
    }
    kvc_cells_rebuild_seq_pos(&c->cells, &touched);
    c->undo.n_spans = m->n_spans;
    c->undo.n_cells = m->n_cells;
    c->head = m->head;
    c->n = m->n;
    c->slot = m->slot;
    return KVC_OK;
}

/* --- data ------------------------------------------------------------------------------ */

void kvc_unified_slot_cells(const kvc_unified *c, int32_t *out) {
    for (uint32_t t = 0; t < c->slot.n; t++) {
        out[t] = (int32_t)kvc_unified_slot_cell(c, t);
    }
}

int kvc_unified_store(kvc_unified *c, uint32_t ikv, uint32_t n_tokens, const void *k, const void *v) {
    if (c->slot.n == 0 || n_tokens != c->slot.n || ikv >= c->n_layer) {
        return KVC_E_ARG;
    }
    kvc_unified_defrag_settle(c);
    const kvc_layer *ly = &c->layers[ikv];
    /* the placement is a run of cells: the rows go in at once */
    const size_t head = kvc_unified_slot_cell(c, 0), size = c->cells.size;
    if (k && ly->k) {
        memcpy(ly->k + head * ly->k_row_bytes, k, n_tokens * ly->k_row_bytes);
    }
    if (!v || !ly->v) {
        return KVC_OK;
    }
    if (!c->v_trans) {
        memcpy(ly->v + head * ly->v_row_bytes, v, n_tokens * ly->v_row_bytes);
        return KVC_OK;
    }
    /* transposed: element e of token t goes to row e, column head + t */
    const size_t el = kvc_type_get(c->type_v)->type_size;
    const uint8_t *src = v;
    for (uint32_t e = 0; e < ly->n_embd_v; e++) {
        uint8_t *dst = ly->v + ((size_t)e * size + head) * el;
        for (uint32_t t = 0; t < n_tokens; t++) {
            memcpy(dst + (size_t)t * el, src + ((size_t)t * ly->n_embd_v + e) * el, el);
        }
    }
    return KVC_OK;
}

/* --- snapshots ------------------------------------------------------------------------- */

int kvc_unified_snapshot_take(const kvc_unified *c, kvc_unified_snapshot *s) {
    memset(s, 0, sizeof *s);
    if (kvc_cells_init(&s->cells, c->cells.size, c->cells.n_seq_max) != KVC_OK) {
        return KVC_E_NOMEM;
    }
    kvc_cells_copy(&s->cells, &c->cells);
    const kvc_undo *u = &c->undo;
    s->undo.spans = kvc_malloc_n(u->n_spans ? u->n_spans : 1, sizeof *s->undo.spans);
    s->undo.pos = kvc_malloc_n(u->n_cells ? u->n_cells : 1, sizeof *s->undo.pos);
    s->undo.seq = kvc_malloc_n((uint64_t)(u->n_cells ? u->n_cells : 1) * u->seq_words, sizeof *s->undo.seq);
    if (!s->undo.spans || !s->undo.pos || !s->undo.seq) {
        kvc_unified_snapshot_free(s);
        return KVC_E_NOMEM;
    }
    memcpy(s->undo.spans, u->spans, u->n_spans * sizeof *u->spans);
    memcpy(s->undo.pos, u->pos, u->n_cells * sizeof *u->pos);
    memcpy(s->undo.seq, u->seq, (size_t)u->n_cells * u->seq_words * sizeof *u->seq);
    s->undo.seq_words = u->seq_words;
    s->undo.n_spans = s->undo.cap_spans = u->n_spans;
    s->undo.n_cells = s->undo.cap_cells = u->n_cells;
    s->head = c->head;
    s->n = c->n;
    s->slot = c->slot;
    s->do_defrag = c->do_defrag;
    s->defrag_pending = c->defrag_pending;
    return KVC_OK;
}

void kvc_unified_snapshot_restore(kvc_unified *c, const kvc_unified_snapshot *s) {
    /* the cache's own arrays are at least as large as the snapshot's (they only grow) */
    kvc_cells_copy(&c->cells, &s->cells);
    kvc_undo *u = &c->undo;
    memcpy(u->spans, s->undo.spans, s->undo.n_spans * sizeof *u->spans);
    memcpy(u->pos, s->undo.pos, s->undo.n_cells * sizeof *u->pos);
    memcpy(u->seq, s->undo.seq, (size_t)s->undo.n_cells * u->seq_words * sizeof *u->seq);
    u->n_spans = s->undo.n_spans;
    u->n_cells = s->undo.n_cells;
    c->head = s->head;
    c->n = s->n;
    c->slot = s->slot;
    c->do_defrag = s->do_defrag;
    c->defrag_pending = s->defrag_pending;
}

void kvc_unified_snapshot_free(kvc_unified_snapshot *s) {
    kvc_cells_free(&s->cells);
    kvc_free(s->undo.spans);
    kvc_free(s->undo.pos);
    kvc_free(s->undo.seq);
    memset(s, 0, sizeof *s);
}
