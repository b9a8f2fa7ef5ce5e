/* kvcache — prefix reuse, the cache's side (kvc_reuse.h). */
#include "kvc_reuse.h"

#include <string.h>

/* The index holds cell i of stream st (on) or not; a cell let go may be free: its word is
 * looked at again by placement. */
static inline void held_set(kvc_reuse *r, uint32_t st, uint32_t i, bool on) {
    uint64_t *w = &r->held[(size_t)st * r->n_words + (i >> 6)];
    const uint64_t bit = (uint64_t)1 << (i & 63);
    if (on) {
        *w |= bit;
    } else {
        *w &= ~bit;
        r->avail[(size_t)st * r->avail_words + (i >> 12)] |= (uint64_t)1 << ((i >> 6) & 63);
    }
}

/* Every word of every stream may hold a free cell. */
static void avail_all(kvc_reuse *r, uint32_t n_stream) {
    memset(r->avail, 0xff, (size_t)n_stream * r->avail_words * sizeof *r->avail);
}

static inline void ghost_push(kvc_reuse *r, uint32_t st, uint32_t g) {
    r->ghost_free[(size_t)st * r->n_ghost + r->n_ghost_free[st]++] = g;
}

/* The index's token moved from id `from` of stream st to id `to` (a cell to a ghost or back):
 * its position and extension go with it. */
static inline void record_move(kvc_reuse *r, uint32_t st, uint32_t from, uint32_t to) {
    if (r->ext) {
        r->ext[kvc_reuse_at(r, st, to)] = r->ext[kvc_reuse_at(r, st, from)];
        r->pos[kvc_reuse_at(r, st, to)] = r->pos[kvc_reuse_at(r, st, from)];
    }
}

/* An id the index let go: a cell no longer held, or a ghost free again. Whether it was a cell. */
static inline bool let_go(kvc_reuse *r, uint32_t size, uint32_t st, uint32_t i) {
    if (i >= size) {
        ghost_push(r, st, i);
        return false;
    }
    held_set(r, st, i, false);
    return true;
}

/* The cells the index's last evict / remove / insert let go are no longer held: how many were
 * cells of the cache (not ghosts). */
static uint32_t drop_freed(kvc_reuse *r, uint32_t size) {
    const uint32_t *cells, *strms;
    const uint32_t n = kvc_prefix_freed(&r->idx, &cells, &strms);
    uint32_t real = 0;
    for (uint32_t k = 0; k < n; k++) {
        real += let_go(r, size, strms[k], cells[k]);
    }
    return real;
}

/* Every ghost id of every stream free. */
static void ghosts_reset(kvc_reuse *r, uint32_t n_stream, uint32_t size) {
    for (uint32_t st = 0; st < n_stream && r->n_ghost; st++) {
        r->n_ghost_free[st] = 0;
        for (uint32_t g = r->n_ghost; g-- > 0;) {
            ghost_push(r, st, size + g);   /* the lowest id on top */
        }
    }
}

/* Free r and everything it holds (a zeroed index frees nothing). */
void kvc_reuse_free(kvc_reuse *r) {
    kvc_prefix_free(&r->idx);
    kvc_free(r->rec);
    kvc_free(r->held);
    kvc_free(r->lock);
    kvc_free(r->avail);
    kvc_free(r->tmp_cell);
    kvc_free(r->tmp_strm);
    kvc_free(r->keep_buf);
    kvc_free(r->ghost_free);
    kvc_free(r->n_ghost_free);
    kvc_free(r->ext);
    kvc_free(r->pos);
    kvc_free(r);
}

static int reuse_new(kvc_unified *c, uint32_t cap, uint32_t n_ghost, kvc_err *err) {
    if (!c->ops->prefix_reuse) {
        return kvc_err_set(err, KVC_E_ARG, "prefix reuse needs a cache of today's semantics (\"2026\")");
    }
    if (c->reuse) {
        return kvc_reuse_mode_check(c, n_ghost != 0, err);   /* its cap: kvc_reuse_set_cap */
    }
    const uint32_t size = c->cells.size, ns = c->n_stream;
    if ((uint64_t)size + n_ghost > ((uint64_t)1 << 31) / (ns ? ns : 1)) {
        return kvc_err_set(err, KVC_E_ARG, "the prefix index of %u streams of %u cells and %u remembered tokens is "
                           "too large", ns, size, n_ghost);
    }
    kvc_reuse *r = kvc_calloc(1, sizeof *r);
    if (!r) {
        return kvc_err_set(err, KVC_E_NOMEM, "out of memory for the prefix index");
    }
    r->n_words = c->cells.n_words;
    r->n_lock = c->n_seq_max;
    /* the arrays read per cell come from kvc_table_calloc (resident, on huge pages) */
    r->held = kvc_table_calloc((uint64_t)ns * r->n_words, sizeof *r->held);
    r->lock = kvc_calloc(c->n_seq_max, sizeof *r->lock);
    r->rec = kvc_table_calloc((uint64_t)ns * size, sizeof *r->rec);
    r->avail_words = (r->n_words + 63) / 64;
    r->avail = kvc_malloc_n((uint64_t)ns * r->avail_words + 1, sizeof *r->avail);
    r->tmp_cell = kvc_table_calloc((uint64_t)ns * (size + n_ghost), sizeof *r->tmp_cell);
    r->tmp_strm = kvc_table_calloc((uint64_t)ns * (size + n_ghost), sizeof *r->tmp_strm);
    r->n_ghost = n_ghost;
    if (n_ghost) {
        r->ghost_free = kvc_malloc_n((uint64_t)ns * n_ghost, sizeof *r->ghost_free);
        r->n_ghost_free = kvc_calloc(ns, sizeof *r->n_ghost_free);
    }
    if (kvc_unified_has_ext(c)) {
        r->ext = kvc_table_calloc((uint64_t)ns * (size + n_ghost), sizeof *r->ext);   /* a ghost keeps its token's */
        r->pos = kvc_table_calloc((uint64_t)ns * (size + n_ghost), sizeof *r->pos);
    }
    int rc = (r->held && r->lock && r->rec && r->avail && r->tmp_cell && r->tmp_strm &&
              (!n_ghost || (r->ghost_free && r->n_ghost_free)) && (!kvc_unified_has_ext(c) || (r->ext && r->pos)))
                 ? KVC_OK
                 : kvc_err_set(err, KVC_E_NOMEM, "out of memory for the prefix index");
    if (rc == KVC_OK) {
        rc = kvc_prefix_init(&r->idx, ns, size + n_ghost, cap, err);
    }
    if (rc == KVC_OK) {
        ghosts_reset(r, ns, size);
        avail_all(r, ns);
    }
    for (size_t i = 0; rc == KVC_OK && i < (size_t)ns * size; i++) {
        r->rec[i] = (kvc_reuse_cell){ 0, KVC_TOKEN_NULL };
    }
    if (rc != KVC_OK) {
        kvc_reuse_free(r);
        return rc;
    }
    c->reuse = r;
    return KVC_OK;
}

int kvc_reuse_mode_check(const kvc_unified *c, bool window, kvc_err *err) {
    if (c->reuse && (c->reuse->n_ghost != 0) != window) {
        return kvc_err_set(err, KVC_E_ARG, "prefix reuse is on already in another mode");
    }
    return KVC_OK;
}

void kvc_reuse_set_cap(kvc_unified *c, uint32_t cap) {
    kvc_reuse *r = c->reuse;
    kvc_prefix_set_cap(&r->idx, cap);
    if (cap && r->idx.n_held > cap) {
        (void)kvc_reuse_evict(c, r->idx.n_held - cap);
    }
}

int kvc_reuse_enable(kvc_unified *c, uint32_t cap, kvc_err *err) {
    const bool was_on = c->reuse != NULL;
    const int rc = reuse_new(c, cap, 0, err);
    if (rc == KVC_OK && was_on) {
        kvc_reuse_set_cap(c, cap);
    }
    return rc;
}

int kvc_reuse_enable_window(kvc_unified *c, uint32_t n_ghost, kvc_err *err) {
    return reuse_new(c, 0, n_ghost ? n_ghost : 1, err);
}

uint32_t kvc_reuse_ghost_take(kvc_unified *c, uint32_t st) {
    kvc_reuse *r = c->reuse;
    if (!r || !r->n_ghost || r->n_ghost_free[st] == 0) {
        return UINT32_MAX;
    }
    return r->ghost_free[(size_t)st * r->n_ghost + --r->n_ghost_free[st]];
}

void kvc_reuse_ghost_give(kvc_unified *c, uint32_t st, uint32_t g) { ghost_push(c->reuse, st, g); }

uint32_t kvc_reuse_n_cells(const kvc_unified *c) {
    const kvc_reuse *r = c->reuse;
    if (!r) {
        return 0;
    }
    uint32_t ghosts = 0;
    for (uint32_t st = 0; st < c->n_stream && r->n_ghost; st++) {
        ghosts += r->n_ghost - r->n_ghost_free[st];
    }
    return kvc_prefix_n_held(&r->idx) - ghosts;
}

void kvc_reuse_fill_ghost(kvc_unified *c, uint32_t st, uint32_t g, uint32_t i) {
    kvc_reuse *r = c->reuse;
    if (kvc_prefix_move_cell(&r->idx, st, g, i, NULL) == KVC_OK) {
        record_move(r, st, g, i);
        held_set(r, st, i, true);
        ghost_push(r, st, g);
    }
}

bool kvc_reuse_free_ghosts(kvc_unified *c, uint32_t st, uint32_t n) {
    kvc_reuse *r = c->reuse;
    while (r->n_ghost_free[st] < n && kvc_prefix_evict(&r->idx, n - r->n_ghost_free[st]) > 0) {
        drop_freed(r, c->cells.size);
    }
    return r->n_ghost_free[st] >= n;
}

void kvc_reuse_overwrite_held(kvc_unified *c, uint32_t st, uint32_t i) {
    kvc_reuse *r = c->reuse;
    const uint32_t g = kvc_reuse_ghost_take(c, st);
    if (g == UINT32_MAX || kvc_prefix_move_cell(&r->idx, st, i, g, NULL) != KVC_OK) {
        if (g != UINT32_MAX) {
            ghost_push(r, st, g);
        }
        kvc_reuse_forget_cell(c, st, i);   /* no ghost free: the prompt is forgotten from here */
        return;
    }
    record_move(r, st, i, g);
    held_set(r, st, i, false);
}

/* n elements of el bytes of src in a new allocation (NULL for a NULL src or no memory: *ok). */
static void *dup_n(const void *src, uint64_t n, uint64_t el, bool *ok) {
    if (!src) {
        return NULL;
    }
    void *p = kvc_malloc_n(n ? n : 1, el);
    if (p) {
        memcpy(p, src, (size_t)(n * el));
    }
    *ok &= p != NULL;
    return p;
}

kvc_reuse *kvc_reuse_copy(const kvc_unified *c) {
    const kvc_reuse *r = c->reuse;
    kvc_reuse *d = kvc_calloc(1, sizeof *d);
    if (!d) {
        return NULL;
    }
    const uint64_t ns = c->n_stream, ids = ns * (c->cells.size + r->n_ghost);
    bool ok = true;
    *d = *r;
    d->idx = (kvc_prefix){ 0 };
    d->held = dup_n(r->held, ns * r->n_words, sizeof *r->held, &ok);
    d->lock = dup_n(r->lock, r->n_lock, sizeof *r->lock, &ok);
    d->rec = dup_n(r->rec, ns * c->cells.size, sizeof *r->rec, &ok);
    d->avail = dup_n(r->avail, ns * r->avail_words + 1, sizeof *r->avail, &ok);
    d->tmp_cell = kvc_malloc_n(ids, sizeof *d->tmp_cell);   /* scratch: nothing to copy */
    d->tmp_strm = kvc_malloc_n(ids, sizeof *d->tmp_strm);
    d->keep_buf = NULL;   /* the copy grows its own */
    d->keep_cap = 0;
    d->ghost_free = dup_n(r->ghost_free, ns * r->n_ghost, sizeof *r->ghost_free, &ok);
    d->n_ghost_free = dup_n(r->n_ghost_free, ns, sizeof *r->n_ghost_free, &ok);
    d->ext = dup_n(r->ext, ids, sizeof *r->ext, &ok);
    d->pos = dup_n(r->pos, ids, sizeof *r->pos, &ok);
    ok = ok && d->tmp_cell && d->tmp_strm && kvc_prefix_copy(&d->idx, &r->idx) == KVC_OK;
    if (!ok) {
        kvc_reuse_free(d);
        return NULL;
    }
    return d;
}

void kvc_reuse_disable(kvc_unified *c) {
    if (c->reuse) {
        kvc_reuse_free(c->reuse);
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
    drop_freed(r, r->idx.n_cells - r->n_ghost);
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
    avail_all(r, c->n_stream);
    memset(r->lock, 0, c->n_seq_max * sizeof *r->lock);
    ghosts_reset(r, c->n_stream, c->cells.size);
    for (size_t i = 0; i < (size_t)c->n_stream * c->cells.size; i++) {
        r->rec[i] = (kvc_reuse_cell){ 0, KVC_TOKEN_NULL };
    }
}

void kvc_reuse_copy_cells(kvc_unified *c, uint32_t src, uint32_t st, uint32_t i) {
    kvc_reuse *r = c->reuse;
    if (!r) {
        return;
    }
    const size_t size = c->cells.size;
    if (i == UINT32_MAX) {
        memcpy(r->rec + st * size, r->rec + src * size, size * sizeof *r->rec);
        if (r->ext) {   /* the cells' records, not the ghosts' (the index's own) */
            memcpy(r->ext + kvc_reuse_at(r, st, 0), r->ext + kvc_reuse_at(r, src, 0), size * sizeof *r->ext);
            memcpy(r->pos + kvc_reuse_at(r, st, 0), r->pos + kvc_reuse_at(r, src, 0), size * sizeof *r->pos);
        }
    } else {
        r->rec[st * size + i] = r->rec[src * size + i];
        if (r->ext) {
            r->ext[kvc_reuse_at(r, st, i)] = r->ext[kvc_reuse_at(r, src, i)];
            r->pos[kvc_reuse_at(r, st, i)] = r->pos[kvc_reuse_at(r, src, i)];
        }
    }
}

void kvc_reuse_moved(kvc_unified *c, uint32_t st, uint32_t i) {
    kvc_reuse *r = c->reuse;
    if (!r) {
        return;
    }
    kvc_reuse_forget_cell(c, st, i);
    r->rec[(size_t)st * c->cells.size + i] = (kvc_reuse_cell){ KVC_REUSE_MOVED, KVC_TOKEN_NULL };
}

uint32_t kvc_reuse_evict(kvc_unified *c, uint32_t n) {
    kvc_reuse *r = c->reuse;
    if (!r || n == 0) {
        return 0;
    }
    /* cells of the cache: ghosts evicted on the way do not count */
    uint32_t real = 0;
    while (real < n && kvc_prefix_evict(&r->idx, n - real) > 0) {
        real += drop_freed(r, c->cells.size);
    }
    return real;
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

/* Window mode: cells the index holds in stream st for no live sequence become ghosts (the
 * index keeps their tokens) until `have` reaches n. The prompts an attached sequence protects
 * may hold every cell of a small SWA cache, while the sequence itself needs only its window. */
static bool demote(kvc_unified *c, uint32_t st, uint32_t n, uint32_t have) {
    kvc_reuse *r = c->reuse;
    const kvc_cells *tab = kvc_unified_stream_cells_c(c, st);
    bool any = false;
    for (uint32_t w = 0; w < r->n_words && have < n; w++) {
        for (uint64_t m = r->held[(size_t)st * r->n_words + w] & ~tab->used_bits[w]; m && have < n; m &= m - 1) {
            const uint32_t i = (w << 6) + kvc_ctz64(m);
            if (kvc_reuse_is_held(c, st, i)) {   /* a forget on the way may have let it go */
                kvc_reuse_overwrite_held(c, st, i);
                have++;
                any = true;
            }
        }
    }
    return any;
}

uint32_t kvc_reuse_held_free(const kvc_unified *c, uint32_t st, uint64_t need) {
    const kvc_cells *cells = kvc_unified_stream_cells_c(c, st);
    uint64_t k = 0;
    for (uint32_t w = 0; w < cells->n_words && k < need; w++) {
        k += kvc_popcount64(kvc_reuse_held_word(c, st, w) & ~cells->used_bits[w]);
    }
    return (uint32_t)(k < need ? k : need);
}

/* The cells of stream st a placement can take without evicting: those neither used nor held
 * (n_known_free, counted when UINT32_MAX); outside window mode, the `usable` cells the search
 * found when it knows them and they are more (a sliding window's search also takes the used cells
 * their sequences' windows left, which no eviction is needed for). */
static uint32_t takeable(const kvc_unified *c, uint32_t st, uint32_t n_known_free, uint32_t usable) {
    const uint32_t have = n_known_free != UINT32_MAX ? n_known_free : n_free(c, st);
    return c->reuse->n_ghost == 0 && usable != UINT32_MAX && usable > have ? usable : have;
}

/* Whether evicting could give stream st room for n cells when `have` can be taken without it
 * (takeable): the evictable cells of the stream, less those live sequences hold too (evicting
 * those frees nothing; pinned or locked held cells are not evicted).
 * Window mode: whether the `usable` cells a search could take (UINT32_MAX: not known, then true),
 * with every held cell no live sequence holds (evicted, or demoted to a ghost), reach n. */
static bool room_possible(const kvc_unified *c, uint32_t st, uint32_t n, uint32_t have, uint32_t usable,
                          const kvc_reuse_dry *d) {
    const kvc_reuse *r = c->reuse;
    if (r->n_ghost) {
        return usable == UINT32_MAX || usable >= n || (uint64_t)usable + kvc_reuse_held_free(c, st, n - usable) >= n;
    }
    if (have >= n) {
        return true;
    }
    const kvc_prefix_dry none = { KVC_PREFIX_DRY_START, 0 };
    const kvc_prefix_dry *ev = d ? &d->ev : &none;
    const uint64_t evictable = kvc_prefix_dry_n_evictable(&r->idx, ev);
    if ((uint64_t)have + evictable < n) {
        return false;
    }
    /* of the evictable cells, those of the stream that no live sequence holds too. With one
     * stream (not a dry run), those live sequences hold are held cells they hold, at most the
     * held cells less those no sequence holds: the cells neither used nor takeable, at least
     * (then the walk below is not needed) */
    const kvc_cells *tab = kvc_unified_stream_cells_c(c, st);
    if (c->n_stream == 1 && !d) {
        const uint64_t held = kvc_prefix_n_held(&r->idx), busy = (uint64_t)tab->used + have;
        const uint64_t held_used = held + busy > tab->size ? held + busy - tab->size : 0;
        if ((uint64_t)have + evictable >= (uint64_t)n + held_used) {
            return true;
        }
    }
    return (uint64_t)have + kvc_prefix_dry_evictable_in(&r->idx, ev, st, tab->size, tab->used_bits,
                                                        (uint64_t)n - have) >= n;
}

bool kvc_reuse_room_possible(const kvc_unified *c, uint32_t st, uint32_t n, uint32_t n_known_free,
                             uint32_t n_usable) {
    return c->reuse && room_possible(c, st, n, takeable(c, st, n_known_free, n_usable), n_usable, NULL);
}

static bool make_room(kvc_unified *c, uint32_t st, uint32_t n, uint32_t n_known_free, uint32_t n_usable,
                      uint32_t *have_out) {
    kvc_reuse *r = c->reuse;
    bool any = false;
    uint32_t have = takeable(c, st, n_known_free, n_usable);
    if (!room_possible(c, st, n, have, n_usable, NULL)) {
        /* every evictable cell would not make room: the placement fails, and it evicts nothing
         * (the prefixes stay for the requests that can use them) */
        if (have_out) {
            *have_out = have;
        }
        return false;
    }
    while (have < n && kvc_prefix_n_evictable(&r->idx) > 0) {
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
            if (let_go(r, c->cells.size, strms[j], cells[j]) && strms[j] == st &&
                kvc_cells_is_empty_bit(tab, cells[j])) {
                have++;
            }
        }
    }
    if (have < n && r->n_ghost) {
        any |= demote(c, st, n, have);
    }
    if (have_out) {
        *have_out = have;
    }
    return any;
}

bool kvc_reuse_dry_exact(const kvc_unified *c) {
    return c->reuse && c->reuse->n_ghost == 0 && c->swa_type == KVC_SWA_NONE;
}

void kvc_reuse_dry_begin(kvc_reuse_dry *d) {
    const kvc_reuse_dry z = { { KVC_PREFIX_DRY_START, 0 }, NULL, NULL, 0, 0, false };
    *d = z;
}

/* What a dry eviction's cells do: each shown free (recorded first), those of stream st the table
 * has empty counted as room, as make_room counts them. */
typedef struct dry_freeing {
    kvc_unified   *c;
    kvc_reuse_dry *d;
    uint32_t       st, have;
} dry_freeing;

static void dry_free_cell(void *ctx, uint32_t cell, uint32_t strm) {
    dry_freeing *x = ctx;
    kvc_reuse_dry *d = x->d;
    if (d->nomem) {
        return;
    }
    if (d->n == d->cap) {
        const uint32_t cap = d->cap ? 2 * d->cap : 256;
        uint32_t *c2 = kvc_realloc_n(d->cell, cap, sizeof *c2);
        if (c2) {
            d->cell = c2;
        }
        uint32_t *s2 = kvc_realloc_n(d->strm, cap, sizeof *s2);
        if (s2) {
            d->strm = s2;
        }
        if (!c2 || !s2) {
            d->nomem = true;
            return;
        }
        d->cap = cap;
    }
    d->cell[d->n] = cell;
    d->strm[d->n++] = strm;
    held_set(x->c->reuse, strm, cell, false);
    x->have += strm == x->st && kvc_cells_is_empty_bit(kvc_unified_stream_cells_c(x->c, x->st), cell);
}

int kvc_reuse_dry_make_room(kvc_unified *c, kvc_reuse_dry *d, uint32_t st, uint32_t n, uint32_t n_known_free,
                            uint32_t n_usable) {
    kvc_reuse *r = c->reuse;
    dry_freeing x = { c, d, st, takeable(c, st, n_known_free, n_usable) };
    if (!room_possible(c, st, n, x.have, n_usable, d)) {
        return 0;
    }
    bool any = false;
    while (x.have < n && kvc_prefix_dry_n_evictable(&r->idx, &d->ev) > 0) {
        if (kvc_prefix_dry_evict(&r->idx, &d->ev, n - x.have, dry_free_cell, &x) == 0) {
            break;
        }
        if (d->nomem) {
            return KVC_E_NOMEM;
        }
        any = true;
    }
    return any ? 1 : 0;
}

void kvc_reuse_dry_end(kvc_unified *c, kvc_reuse_dry *d) {
    for (uint32_t k = 0; k < d->n; k++) {
        held_set(c->reuse, d->strm[k], d->cell[k], true);
    }
    kvc_free(d->cell);
    kvc_free(d->strm);
    kvc_reuse_dry_begin(d);
}

bool kvc_reuse_make_room(kvc_unified *c, uint32_t st, uint32_t n, uint32_t n_known_free, uint32_t n_usable) {
    return c->reuse ? make_room(c, st, n, n_known_free, n_usable, NULL) : false;
}

bool kvc_reuse_make_room_count(kvc_unified *c, uint32_t st, uint32_t n, uint32_t n_free, uint32_t *have) {
    return make_room(c, st, n, n_free, UINT32_MAX, have);
}

void *kvc_reuse_keep_scratch(kvc_reuse *r, size_t bytes) {
    if (bytes > r->keep_cap) {
        void *p = kvc_malloc(bytes);
        if (!p) {
            return NULL;
        }
        kvc_free(r->keep_buf);
        r->keep_buf = p;
        r->keep_cap = bytes;
    }
    return r->keep_buf;
}

uint64_t *kvc_reuse_avail(kvc_unified *c, uint32_t st) {
    kvc_reuse *r = c->reuse;
    uint64_t *avail = r->avail + (size_t)st * r->avail_words;
    kvc_cells_take_emptied(kvc_unified_stream_cells(c, st), avail);
    return avail;
}

/* Sequence s's lock goes when s holds no cell any more. */
static void unlock_if_empty(kvc_unified *c, kvc_reuse *r, int32_t s) {
    kvc_prefix_handle *h = &r->lock[s];
    if (h->node != 0 && kvc_unified_stream_cells_c(c, kvc_unified_stream_of(c, s))->seq_pos[s].n == 0) {
        (void)kvc_prefix_unlock(&r->idx, *h, NULL);
        h->node = h->gen = 0;
    }
}

void kvc_reuse_sync(kvc_unified *c) {
    kvc_reuse *r = c->reuse;
    if (!r) {
        return;
    }
    /* most calls follow an operation that released no node holding a lock (an eviction takes
     * only nodes without one): then only the locks of sequences left without cells change, and
     * the handles (scattered over the node pool) are not read */
    const uint64_t seen = r->synced;
    r->synced = r->idx.n_lock_released;
    for (uint32_t s = 0; s < c->n_seq_max; s++) {
        kvc_prefix_handle *h = &r->lock[s];
        if (h->node == 0) {
            continue;
        }
        if (r->idx.n_lock_released != seen && !kvc_prefix_handle_valid(&r->idx, *h)) {
            h->node = h->gen = 0;   /* the prefix left the index: its lock went with it */
        } else {
            unlock_if_empty(c, r, (int32_t)s);
        }
    }
}

void kvc_reuse_sync_seq(kvc_unified *c, int32_t s) {
    kvc_reuse *r = c->reuse;
    if (!r) {
        return;
    }
    if (s < 0 || r->idx.n_lock_released != r->synced) {
        kvc_reuse_sync(c);
        return;
    }
    /* no node holding a lock went since the last sync, which left every lock with a sequence
     * holding cells: only s's can change */
    unlock_if_empty(c, r, s);
}

void kvc_reuse_note_insert(kvc_unified *c, const uint32_t *cells, const uint32_t *streams, uint32_t from,
                           uint32_t to) {
    kvc_reuse *r = c->reuse;
    drop_freed(r, c->cells.size);   /* evicted to stay under the cap */
    for (uint32_t k = from; k < to; k++) {
        if (cells[k] < c->cells.size) {
            held_set(r, streams[k], cells[k], true);
        }
    }
}

int kvc_reuse_check(const kvc_unified *c, kvc_err *err) {
    const kvc_reuse *r = c->reuse;
    if (!r) {
        return KVC_OK;
    }
    int rc = kvc_prefix_check(&r->idx, err);
    for (uint32_t st = 0; rc == KVC_OK && st < c->n_stream; st++) {
        rc = kvc_cells_check(kvc_unified_stream_cells_c(c, st), err);
    }
    if (rc != KVC_OK) {
        return rc;
    }
    /* every word with a cell neither used nor held is one placement looks at */
    for (uint32_t st = 0; st < c->n_stream; st++) {
        const kvc_cells *tab = kvc_unified_stream_cells_c(c, st);
        const uint64_t *avail = r->avail + (size_t)st * r->avail_words;
        for (uint32_t w = 0; w < r->n_words; w++) {
            const uint32_t left = c->cells.size - (w << 6);
            const uint64_t in = left >= 64 ? ~(uint64_t)0 : ((uint64_t)1 << left) - 1;
            const uint64_t bit = (uint64_t)1 << (w & 63);
            if ((~(tab->used_bits[w] | r->held[(size_t)st * r->n_words + w]) & in) &&
                !((avail[w >> 6] | tab->emptied[w >> 6]) & bit)) {
                return kvc_err_set(err, KVC_E_INTERNAL, "word %u of stream %u has a free cell placement does not "
                                   "look at", w, st);
            }
        }
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
                const int32_t at = kvc_reuse_pos_of(c, st, i, pl->depth);
                if (!kvc_cells_is_empty(tab, i) && tab->pos[i] != at) {
                    return kvc_err_set(err, KVC_E_INTERNAL, "cell %u of stream %u is held for position %d but "
                                       "holds position %d", i, st, at, tab->pos[i]);
                }
                const kvc_cell_ext *e = r->ext ? &r->ext[kvc_reuse_at(r, st, i)] : NULL;
                if (e && !kvc_cells_is_empty(tab, i) && !kvc_reuse_ext_is(c, &tab->ext[i], e->x, e->y, e->tok)) {
                    return kvc_err_set(err, KVC_E_INTERNAL, "cell %u of stream %u holds another extension than the "
                                       "index keeps for it", i, st);
                }
            }
        }
    }
    /* every ghost id is either free (once) or held by the index */
    uint32_t n_ghosts = 0;
    for (uint32_t st = 0; st < c->n_stream && r->n_ghost; st++) {
        const uint32_t *fr = r->ghost_free + (size_t)st * r->n_ghost;
        uint32_t in_idx = 0;
        for (uint32_t g = 0; g < r->n_ghost; g++) {
            in_idx += r->idx.place[(size_t)st * r->idx.n_cells + c->cells.size + g].node != 0;
        }
        for (uint32_t k = 0; k < r->n_ghost_free[st]; k++) {
            if (fr[k] < c->cells.size || fr[k] >= c->cells.size + r->n_ghost ||
                r->idx.place[(size_t)st * r->idx.n_cells + fr[k]].node != 0) {
                return kvc_err_set(err, KVC_E_INTERNAL, "stream %u: free ghost %u is held or out of range", st, fr[k]);
            }
        }
        if (in_idx + r->n_ghost_free[st] != r->n_ghost) {
            return kvc_err_set(err, KVC_E_INTERNAL, "stream %u: %u ghosts held, %u free, of %u", st, in_idx,
                               r->n_ghost_free[st], r->n_ghost);
        }
        n_ghosts += in_idx;
    }
    if (n_bits + n_ghosts != kvc_prefix_n_held(&r->idx)) {
        return kvc_err_set(err, KVC_E_INTERNAL, "%u held bits and %u ghosts, the index holds %u cells", n_bits,
                           n_ghosts, kvc_prefix_n_held(&r->idx));
    }
    for (uint32_t s = 0; s < c->n_seq_max; s++) {
        const kvc_prefix_handle h = r->lock[s];
        if (h.node && (!kvc_prefix_handle_valid(&r->idx, h) || kvc_unified_seq_pos_max(c, (int32_t)s) < 0)) {
            return kvc_err_set(err, KVC_E_INTERNAL, "sequence %u keeps a lock it should have let go", s);
        }
    }
    return KVC_OK;
}
