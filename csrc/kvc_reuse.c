/* kvcache — prefix reuse, the cache's side (kvc_reuse.h). */
#include "kvc_reuse.h"

#include <string.h>

static inline void held_set(kvc_reuse *r, uint32_t st, uint32_t i, bool on) {
    uint64_t *w = &r->held[(size_t)st * r->n_words + (i >> 6)];
    const uint64_t bit = (uint64_t)1 << (i & 63);
    *w = on ? (*w | bit) : (*w & ~bit);
}

/* The cells the index's last evict / remove / insert let go are no longer held. */
static void drop_freed(kvc_reuse *r) {
    const uint32_t *cells, *strms;
    const uint32_t n = kvc_prefix_freed(&r->idx, &cells, &strms);
    for (uint32_t k = 0; k < n; k++) {
        held_set(r, strms[k], cells[k], false);
    }
}

/* Free r and everything it holds (a zeroed index frees nothing). */
static void reuse_free(kvc_reuse *r) {
    kvc_prefix_free(&r->idx);
    kvc_free(r->born);
    kvc_free(r->tok);
    kvc_free(r->held);
    kvc_free(r->lock);
    kvc_free(r->tmp_cell);
    kvc_free(r->tmp_strm);
    kvc_free(r);
}

int kvc_reuse_enable(kvc_unified *c, uint32_t cap, kvc_err *err) {
    if (c->semantics != KVC_SEM_2026) {
        return kvc_err_set(err, KVC_E_ARG, "prefix reuse needs a cache of today's semantics (\"2026\")");
    }
    if (kvc_unified_has_ext(c)) {
        return kvc_err_set(err, KVC_E_ARG, "prefix reuse is not available for a cache whose cells carry 2-D "
                           "positions or per-layer-embedding tokens (cell_ext)");
    }
    if (c->reuse) {
        kvc_prefix_set_cap(&c->reuse->idx, cap);
        return KVC_OK;
    }
    const uint32_t size = c->cells.size, ns = c->n_stream;
    kvc_reuse *r = kvc_calloc(1, sizeof *r);
    if (!r) {
        return kvc_err_set(err, KVC_E_NOMEM, "out of memory for the prefix index");
    }
    r->n_words = c->cells.n_words;
    r->n_lock = c->n_seq_max;
    r->held = kvc_calloc((size_t)ns * r->n_words, sizeof *r->held);
    r->lock = kvc_calloc(c->n_seq_max, sizeof *r->lock);
    r->tok = kvc_malloc_n((uint64_t)ns * size, sizeof *r->tok);
    r->born = kvc_calloc((size_t)ns * size, sizeof *r->born);
    r->tmp_cell = kvc_malloc_n((uint64_t)ns * size, sizeof *r->tmp_cell);
    r->tmp_strm = kvc_malloc_n((uint64_t)ns * size, sizeof *r->tmp_strm);
    int rc = (r->held && r->lock && r->tok && r->born && r->tmp_cell && r->tmp_strm) ? KVC_OK
                                                                 : kvc_err_set(err, KVC_E_NOMEM, "out of memory for the prefix index");
    if (rc == KVC_OK) {
        rc = kvc_prefix_init(&r->idx, ns, size, cap, err);
    }
    for (size_t i = 0; rc == KVC_OK && i < (size_t)ns * size; i++) {
        r->tok[i] = KVC_TOKEN_NULL;
    }
    if (rc != KVC_OK) {
        reuse_free(r);
        return rc;
    }
    c->reuse = r;
    return KVC_OK;
}

void kvc_reuse_disable(kvc_unified *c) {
    if (c->reuse) {
        reuse_free(c->reuse);
        c->reuse = NULL;
    }
}

/* The index forgets cells[i] of strms[i] (held ones), and what it kept after them. */
static void forget(kvc_reuse *r, const uint32_t *cells, const uint32_t *strms, uint32_t n) {
    if (n == 0) {
        return;
    }
    for (uint32_t k = 0; k < n; k++) {
        held_set(r, strms[k], cells[k], false);
    }
    kvc_prefix_remove_cells(&r->idx, cells, strms, n);
    drop_freed(r);
    /* a lock on a node that went is gone too */
    for (uint32_t s = 0; s < r->n_lock; s++) {
        if (r->lock[s].node && !kvc_prefix_handle_valid(&r->idx, r->lock[s])) {
            r->lock[s].node = r->lock[s].gen = 0;
        }
    }
}

void kvc_reuse_forget_cell(kvc_unified *c, uint32_t st, uint32_t i) {
    kvc_reuse *r = c->reuse;
    if (!r || !kvc_reuse_is_held(c, st, i)) {
        return;
    }
    forget(r, &i, &st, 1);
}

void kvc_reuse_forget_stream(kvc_unified *c, uint32_t st) {
    kvc_reuse *r = c->reuse;
    if (!r) {
        return;
    }
    /* a word of cells at a time, on the stack: the scratch arrays may hold the caller's match */
    uint32_t cells[64], strms[64];
    const uint64_t *w = r->held + (size_t)st * r->n_words;
    for (uint32_t k = 0; k < r->n_words; k++) {
        uint32_t n = 0;
        for (uint64_t m = w[k]; m; m &= m - 1) {
            cells[n] = (k << 6) + kvc_ctz64(m);
            strms[n] = st;
            n++;
        }
        forget(r, cells, strms, n);
    }
}

void kvc_reuse_clear(kvc_unified *c) {
    kvc_reuse *r = c->reuse;
    if (!r) {
        return;
    }
    kvc_prefix_clear(&r->idx);
    memset(r->held, 0, (size_t)c->n_stream * r->n_words * sizeof *r->held);
    memset(r->lock, 0, c->n_seq_max * sizeof *r->lock);
    for (size_t i = 0; i < (size_t)c->n_stream * c->cells.size; i++) {
        r->tok[i] = KVC_TOKEN_NULL;
        r->born[i] = 0;
    }
}

void kvc_reuse_copy_cells(kvc_unified *c, uint32_t src, uint32_t st, uint32_t i) {
    kvc_reuse *r = c->reuse;
    if (!r) {
        return;
    }
    const size_t size = c->cells.size;
    if (i == UINT32_MAX) {
        memcpy(r->tok + st * size, r->tok + src * size, size * sizeof *r->tok);
        memcpy(r->born + st * size, r->born + src * size, size * sizeof *r->born);
    } else {
        r->tok[st * size + i] = r->tok[src * size + i];
        r->born[st * size + i] = r->born[src * size + i];
    }
}

void kvc_reuse_moved(kvc_unified *c, uint32_t st, uint32_t i) {
    kvc_reuse *r = c->reuse;
    if (!r) {
        return;
    }
    kvc_reuse_forget_cell(c, st, i);
    r->tok[(size_t)st * c->cells.size + i] = KVC_TOKEN_NULL;
    r->born[(size_t)st * c->cells.size + i] = KVC_REUSE_MOVED;
}

uint32_t kvc_reuse_evict(kvc_unified *c, uint32_t n) {
    kvc_reuse *r = c->reuse;
    if (!r || n == 0) {
        return 0;
    }
    const uint32_t got = kvc_prefix_evict(&r->idx, n);
    drop_freed(r);
    return got;
}

/* Cells of stream st neither used nor held. */
static uint32_t n_free(const kvc_unified *c, uint32_t st) {
    const kvc_cells *cells = kvc_unified_stream_cells_c(c, st);
    const uint64_t *held = c->reuse->held + (size_t)st * c->reuse->n_words;
    uint32_t busy = 0;
    for (uint32_t w = 0; w < cells->n_words; w++) {
        busy += kvc_popcount64(cells->used_bits[w] | held[w]);
    }
    return cells->size - busy;
}

bool kvc_reuse_make_room(kvc_unified *c, uint32_t st, uint32_t n) {
    kvc_reuse *r = c->reuse;
    if (!r || kvc_prefix_n_evictable(&r->idx) == 0) {
        return false;
    }
    bool any = false;
    for (uint32_t have = n_free(c, st); have < n;) {
        const uint32_t got = kvc_prefix_evict(&r->idx, n - have);
        if (got == 0) {
            break;
        }
        any = true;
        /* the cells freed in this stream that no sequence holds are room now */
        const uint32_t *cells, *strms;
        const uint32_t k = kvc_prefix_freed(&r->idx, &cells, &strms);
        const kvc_cells *tab = kvc_unified_stream_cells_c(c, st);
        for (uint32_t j = 0; j < k; j++) {
            held_set(r, strms[j], cells[j], false);
            have += strms[j] == st && kvc_cells_is_empty(tab, cells[j]);
        }
    }
    return any;
}

void kvc_reuse_sync(kvc_unified *c) {
    kvc_reuse *r = c->reuse;
    if (!r) {
        return;
    }
    for (uint32_t s = 0; s < c->n_seq_max; s++) {
        kvc_prefix_handle *h = &r->lock[s];
        if (h->node == 0) {
            continue;
        }
        if (!kvc_prefix_handle_valid(&r->idx, *h)) {
            h->node = h->gen = 0;   /* the prefix left the index: its lock went with it */
        } else if (kvc_unified_seq_pos_max(c, (int32_t)s) < 0) {
            (void)kvc_prefix_unlock(&r->idx, *h, NULL);
            h->node = h->gen = 0;
        }
    }
}

void kvc_reuse_note_insert(kvc_unified *c, const uint32_t *cells, const uint32_t *streams, uint32_t from,
                           uint32_t to) {
    kvc_reuse *r = c->reuse;
    drop_freed(r);   /* evicted to stay under the cap */
    for (uint32_t k = from; k < to; k++) {
        held_set(r, streams[k], cells[k], true);
    }
}

int kvc_reuse_check(const kvc_unified *c, kvc_err *err) {
    const kvc_reuse *r = c->reuse;
    if (!r) {
        return KVC_OK;
    }
    int rc = kvc_prefix_check(&r->idx, err);
    if (rc != KVC_OK) {
        return rc;
    }
    uint32_t n_bits = 0;
    for (uint32_t st = 0; st < c->n_stream; st++) {
        for (uint32_t i = 0; i < c->cells.size; i++) {
            const bool held = kvc_reuse_is_held(c, st, i);
            const bool in_idx = r->idx.place[(size_t)st * r->idx.n_cells + i].node != 0;
            if (held != in_idx) {
                return kvc_err_set(err, KVC_E_INTERNAL, "cell %u of stream %u: held bit %d, index %d", i, st,
                                   (int)held, (int)in_idx);
            }
            if (held) {
                n_bits++;
                /* a held cell that a sequence also holds sits at the token's position */
                const kvc_cells *tab = kvc_unified_stream_cells_c(c, st);
                const kvc_prefix_place *pl = &r->idx.place[(size_t)st * r->idx.n_cells + i];
                if (!kvc_cells_is_empty(tab, i) && (uint32_t)tab->pos[i] != pl->depth) {
                    return kvc_err_set(err, KVC_E_INTERNAL, "cell %u of stream %u is held for position %u but "
                                       "holds position %d", i, st, pl->depth, tab->pos[i]);
                }
            }
        }
    }
    if (n_bits != kvc_prefix_n_held(&r->idx)) {
        return kvc_err_set(err, KVC_E_INTERNAL, "%u held bits, the index holds %u cells", n_bits,
                           kvc_prefix_n_held(&r->idx));
    }
    for (uint32_t s = 0; s < c->n_seq_max; s++) {
        const kvc_prefix_handle h = r->lock[s];
        if (h.node && (!kvc_prefix_handle_valid(&r->idx, h) || kvc_unified_seq_pos_max(c, (int32_t)s) < 0)) {
            return kvc_err_set(err, KVC_E_INTERNAL, "sequence %u keeps a lock it should have let go", s);
        }
    }
    return KVC_OK;
}
