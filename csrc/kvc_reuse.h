/* kvcache — prefix reuse, the cache's side of the prefix index (kvc_prefix.h): which cells of a
 * today's-semantics unified cache the index holds, and the rules every cache operation follows
 * for them. The requests' side (handing a finished sequence's cells to the index, attaching a
 * match to a new sequence, pins) is kvc_retain.h.
 *
 * A cell the index holds keeps the K/V of token depth of a prompt, computed at position depth.
 * While a live sequence holds the cell too, it is an ordinary cell of the table; once none does,
 * the table shows it empty (no mask, no state, no `used` count sees it) but placement does not
 * take it: only eviction gives it back. So the index holds a cell exactly as long as its K/V stay
 * what the index says:
 * - placement skips held cells (kvc_reuse_held_word), and when it finds no room it evicts the
 *   least recently used unprotected prefixes and searches again (kvc_reuse_make_room);
 * - an operation that changes the position of a held cell (seq_add, seq_div) or overwrites its
 *   K/V (a stream copy into its stream, a whole state read, clear) makes the index forget it
 *   first (and whatever the index kept after it in the same prompts);
 * - a sequence attached to a prefix holds a lock on it (kvc_reuse.lock) until it has no cell
 *   left, whichever operation emptied it (kvc_reuse_sync).
 * The cache's lock serializes these as every other operation. */
#ifndef KVC_REUSE_H
#define KVC_REUSE_H

#include "kvc_prefix.h"
#include "kvc_unified_types.h"

#ifdef __cplusplus
extern "C" {
#endif

#define KVC_REUSE_MOVED UINT64_MAX

/* What the cache recorded of a cell when a placement filled it (one record, so that a cell read
 * or written at placement and release costs one cache line, not two). */
typedef struct kvc_reuse_cell {
    uint64_t born;   /* the placement that computed it (serial), or KVC_REUSE_MOVED: its position
                      * changed since, so its K/V belong to another context and are never kept */
    int32_t  tok;    /* the token id it was last placed with (KVC_TOKEN_NULL: placed without one,
                      * or before reuse was on) */
} kvc_reuse_cell;

typedef struct kvc_reuse {
    kvc_prefix         idx;       /* the index over (stream, cell) */
    uint64_t          *held;      /* [n_stream * n_words] bit i of stream s: the index holds the cell */
    uint32_t           n_words;   /* words per stream (the cell table's n_words) */
    kvc_prefix_handle *lock;      /* [n_lock] the prefix each sequence is attached to, {0, 0}: none */
    uint32_t           n_lock;    /* the cache's n_seq_max */
    kvc_reuse_cell    *rec;       /* [n_stream * size] each cell's record */
    uint64_t           serial;    /* placements so far */
    uint64_t           synced;    /* idx.n_lock_released when kvc_reuse_sync last checked every lock's
                                   * handle: while it has not grown, every handle is still valid */
    uint64_t          *avail;     /* [n_stream * avail_words] bit w of stream s: word w of its cells may
                                   * hold a cell neither used nor held (every word that holds one has
                                   * it set, with the table's emptied bits, kvc_reuse_avail): the
                                   * words placement reads in a cache whose empty cells it holds */
    uint32_t           avail_words;   /* (n_words + 63) / 64 */
    uint32_t          *tmp_cell;  /* [n_stream * (size + n_ghost)] scratch for matches and removals */
    uint32_t          *tmp_strm;
    void              *keep_buf;  /* a release's or publish's scratch (kvc_reuse_keep_scratch), or NULL */
    size_t             keep_cap;  /* its bytes */
    /* window mode (the SWA cache of an iSWA pair smaller than its base cache, which overwrites
     * cells that slid out of their sequence's window): the index remembers a prompt's tokens
     * beyond the cells it still holds. A token whose cell went is held by a ghost: an id in
     * [size, size + n_ghost) of the index's cell space, which names no cell of the cache. */
    uint32_t           n_ghost;   /* ghost ids per stream; 0: not window mode */
    kvc_cell_ext      *ext;       /* [n_stream * (size + n_ghost)] caches whose cells carry the
                                   * extension: each held cell's and each ghost's (by the index's cell
                                   * id, kvc_reuse_at), as it was when the index took the token (the
                                   * table resets a cell's when no sequence holds it; a ghost keeps
                                   * its cell's); NULL otherwise */
    int32_t           *pos;       /* [n_stream * (size + n_ghost)] with the extension: each held
                                   * token's position (an image's tokens share one, and the positions
                                   * after it jump, so a token's depth in its prompt is not its position) */
    uint32_t          *ghost_free;    /* [n_stream * n_ghost] the free ghost ids of each stream, a stack */
    uint32_t          *n_ghost_free;  /* [n_stream] */
} kvc_reuse;

/* Turn prefix reuse on for a 2026 cache (cap: the most cells the index may hold, 0 for no cap).
 * With the per-cell extension, a cell serves a request only where its 2-D position (and, with
 * per-layer embeddings, its extension's token) is the request's. KVC_OK (also when it is on
 * already: kvc_reuse_set_cap), KVC_E_ARG (a 2025 cache; on already in window mode), KVC_E_NOMEM
 * (nothing changed). */
int  kvc_reuse_enable(kvc_unified *c, uint32_t cap, kvc_err *err);
/* KVC_E_ARG when reuse is on in c in the other mode (window: kvc_reuse_enable_window's), else
 * KVC_OK: whether turning it on in that mode can go on. */
int  kvc_reuse_mode_check(const kvc_unified *c, bool window, kvc_err *err);
/* Reuse is on: the index's cap set (0: none), the cells past it evicted, least recently used
 * first (never a cell a live sequence holds: the index may stay above the cap until it ends). */
void kvc_reuse_set_cap(kvc_unified *c, uint32_t cap);
/* Turn prefix reuse on in window mode (the SWA cache of an iSWA pair smaller than its base
 * cache; n_ghost: the base cache's cells, the most tokens a prompt the index keeps may have).
 * No cap: the cache's size bounds what it holds. With the extension a ghost keeps the position
 * and extension of the token it holds, as a held cell does. KVC_OK (also when on already),
 * KVC_E_ARG (as kvc_reuse_enable; on already without window mode), KVC_E_NOMEM. */
int  kvc_reuse_enable_window(kvc_unified *c, uint32_t n_ghost, kvc_err *err);
/* A placement begins: the cells it fills are computed after every cell placed before. */
static inline void kvc_reuse_placing(kvc_unified *c) {
    if (c->reuse) {
        c->reuse->serial++;
    }
}
/* Cells i .. i + n - 1 of stream st get the tokens of the current placement (tok: their ids, or
 * NULL for KVC_TOKEN_NULL). */
static inline void kvc_reuse_note_placed_run(kvc_unified *c, uint32_t st, uint32_t i, uint32_t n, const int32_t *tok) {
    kvc_reuse *r = c->reuse;
    if (r) {
        kvc_reuse_cell *rec = r->rec + (size_t)st * c->cells.size + i;
        const uint64_t born = r->serial;
        for (uint32_t k = 0; k < n; k++) {
            rec[k] = (kvc_reuse_cell){ born, tok ? tok[k] : KVC_TOKEN_NULL };
        }
    }
}
/* Cell i of stream st gets a token of the current placement (tok: its id, or KVC_TOKEN_NULL). */
static inline void kvc_reuse_note_placed(kvc_unified *c, uint32_t st, uint32_t i, int32_t tok) {
    kvc_reuse_note_placed_run(c, st, i, 1, &tok);
}
/* Cell i of stream st of stream src became a copy of the same cell of stream src (what it
 * holds and when it was computed); every cell of the stream when i is UINT32_MAX. */
void kvc_reuse_copy_cells(kvc_unified *c, uint32_t src, uint32_t st, uint32_t i);
/* The position of cell i of stream st changed (seq_add, seq_div): the index forgets it and it is
 * never kept again (its K/V were computed in another context). */
void kvc_reuse_moved(kvc_unified *c, uint32_t st, uint32_t i);
/* A copy of c's prefix reuse that shares nothing with it and records no write-back
 * (kvc_prefix_copy), for a dry run of placement to evict from in its place; NULL: no memory.
 * kvc_reuse_free releases it. */
kvc_reuse *kvc_reuse_copy(const kvc_unified *c);
void kvc_reuse_free(kvc_reuse *r);
/* Turn it off: the index and its cells are forgotten (they are empty cells again). */
void kvc_reuse_disable(kvc_unified *c);

/* The held bits of word w of stream st's cells (0 when reuse is off). */
static inline uint64_t kvc_reuse_held_word(const kvc_unified *c, uint32_t st, uint32_t w) {
    const kvc_reuse *r = c->reuse;
    return r ? r->held[(size_t)st * r->n_words + w] : 0;
}
static inline bool kvc_reuse_is_held(const kvc_unified *c, uint32_t st, uint32_t i) {
    return (kvc_reuse_held_word(c, st, i >> 6) >> (i & 63)) & 1u;
}
/* The held bits of word w that placement never overwrites even where a sliding window lets it
 * reuse the cell: all of them, except in window mode, where an overwritten cell becomes a
 * ghost of the index (kvc_reuse_overwrite). */
static inline uint64_t kvc_reuse_kept_word(const kvc_unified *c, uint32_t st, uint32_t w) {
    const kvc_reuse *r = c->reuse;
    return r && r->n_ghost == 0 ? r->held[(size_t)st * r->n_words + w] : 0;
}
/* Placement overwrites cell i of stream st (a cell its only sequence's window left): in window
 * mode the index keeps the token as a ghost (or forgets it when no ghost is free). */
void kvc_reuse_overwrite_held(kvc_unified *c, uint32_t st, uint32_t i);
static inline void kvc_reuse_overwrite(kvc_unified *c, uint32_t st, uint32_t i) {
    if (c->reuse && kvc_reuse_is_held(c, st, i)) {
        kvc_reuse_overwrite_held(c, st, i);
    }
}
/* Whether cell id i of the index names a ghost, not a cell of the cache. */
static inline bool kvc_reuse_is_ghost(const kvc_unified *c, uint32_t i) { return i >= c->cells.size; }
/* A free ghost id of stream st taken (UINT32_MAX: none left); one given back. */
uint32_t kvc_reuse_ghost_take(kvc_unified *c, uint32_t st);
void kvc_reuse_ghost_give(kvc_unified *c, uint32_t st, uint32_t g);
/* Window mode: the token ghost g of stream st holds is held by cell i of st from now on (a cell
 * not held, computed for that token after that prefix); g is free again. */
void kvc_reuse_fill_ghost(kvc_unified *c, uint32_t st, uint32_t g, uint32_t i);
/* Window mode: evict least recently used prefixes until stream st has n free ghosts or nothing
 * evictable is left. Whether it has them. */
bool kvc_reuse_free_ghosts(kvc_unified *c, uint32_t st, uint32_t n);
/* Where the record (r->ext, r->pos) of the index's cell id i of stream st (a cell or a ghost) is. */
static inline size_t kvc_reuse_at(const kvc_reuse *r, uint32_t st, uint32_t i) {
    return (size_t)st * r->idx.n_cells + i;
}
/* The position held cell i of stream st was computed at: with the extension the one kept with
 * it, else its depth in its prompt (token i of a prompt sits at position i). */
static inline int32_t kvc_reuse_pos_of(const kvc_unified *c, uint32_t st, uint32_t i, uint32_t depth) {
    const kvc_reuse *r = c->reuse;
    return r->pos ? r->pos[kvc_reuse_at(r, st, i)] : (int32_t)depth;
}
/* Whether the extension e of a held cell is the one a request places at its position:
 * (x, y), and the token where the extension's token is a per-layer embedding's input. */
static inline bool kvc_reuse_ext_is(const kvc_unified *c, const kvc_cell_ext *e, int32_t x, int32_t y, int32_t tok) {
    return e->x == x && e->y == y && (!c->ple || e->tok == tok);
}
/* Cells of the cache the index holds (its tokens less its ghosts). */
uint32_t kvc_reuse_n_cells(const kvc_unified *c);

/* The index forgets cell i of stream st, and every token after it in the prompts through it (the
 * cells only it held become free). No-op for a cell it does not hold. */
void kvc_reuse_forget_cell(kvc_unified *c, uint32_t st, uint32_t i);
/* The index forgets every cell of stream st (its K/V are about to be overwritten). */
void kvc_reuse_forget_stream(kvc_unified *c, uint32_t st);
/* The index forgets everything (clear, a whole state read). */
void kvc_reuse_clear(kvc_unified *c);
/* Evict up to n cells (least recently used unprotected prefixes, leaves first): the cells freed. */
uint32_t kvc_reuse_evict(kvc_unified *c, uint32_t n);
/* Placement in stream st needs n cells it can take: evict until there are or nothing evictable is
 * left. n_free: how many cells neither used nor held the stream has now, when the caller knows (a
 * search that saw every cell), else UINT32_MAX (counted here); n_usable: the cells the search
 * could take (UINT32_MAX: not known), which with a sliding window include the used cells their
 * sequences' windows left: eviction starts from them, and only when it can make room (window
 * mode: evicting and demoting start only when they can). Returns whether anything was evicted. */
bool kvc_reuse_make_room(kvc_unified *c, uint32_t st, uint32_t n, uint32_t n_free, uint32_t n_usable);
/* The cells of stream st the index holds for no live sequence (not used, yet not free for a
 * placement: the most eviction can free there), counted up to `need` (the words after the need
 * is met are not read). Reuse must be on. */
uint32_t kvc_reuse_held_free(const kvc_unified *c, uint32_t st, uint64_t need);
/* Whether kvc_reuse_make_room could give stream st room for n cells (n_free, n_usable as there),
 * without evicting: false when the evictable cells of the stream are too few (those live
 * sequences hold too free nothing); in window mode, when the usable cells and every held cell no
 * live sequence holds are too few. False when reuse is off. */
bool kvc_reuse_room_possible(const kvc_unified *c, uint32_t st, uint32_t n, uint32_t n_free, uint32_t n_usable);
/* kvc_reuse_make_room, which also says in *have how many cells of the stream are now neither
 * used nor held (n_free must be known). Not in window mode. */
bool kvc_reuse_make_room_count(kvc_unified *c, uint32_t st, uint32_t n, uint32_t n_free, uint32_t *have);
/* Room made by eviction without evicting, for a dry run (kvc_unified_prepare_2026): the cells the
 * evictions would free are shown free (their held bits cleared) until kvc_reuse_dry_end puts
 * them back, the index itself untouched (no copy of it). Exact where a placement changes nothing
 * of the index that a later eviction reads (kvc_reuse_dry_exact: not in window mode, and without
 * a sliding window, whose placements may overwrite a held cell). */
typedef struct kvc_reuse_dry {
    kvc_prefix_dry ev;          /* the evictions so far */
    uint32_t      *cell, *strm; /* the cells shown free */
    uint32_t       n, cap;
    bool           nomem;
} kvc_reuse_dry;
bool kvc_reuse_dry_exact(const kvc_unified *c);
void kvc_reuse_dry_begin(kvc_reuse_dry *d);
/* kvc_reuse_make_room after the evictions d stands for, evicting nothing: 1 cells shown free
 * (search again), 0 not, KVC_E_NOMEM (d keeps what it showed). */
int  kvc_reuse_dry_make_room(kvc_unified *c, kvc_reuse_dry *d, uint32_t st, uint32_t n, uint32_t n_free,
                             uint32_t n_usable);
/* Every cell d showed free held again, d released. */
void kvc_reuse_dry_end(kvc_unified *c, kvc_reuse_dry *d);
/* Stream st's avail bits (bit w: word w of its cells may hold a cell neither used nor held;
 * every word that holds one has its bit set), brought up to date with the cells its table
 * emptied since the last call. A search that finds a word with no such cell may clear its bit. */
uint64_t *kvc_reuse_avail(kvc_unified *c, uint32_t st);
/* Scratch of at least `bytes` for one release or publish, kept for the next (grown when short;
 * the cache's operations never run at once): NULL when there is no memory for it. */
void *kvc_reuse_keep_scratch(kvc_reuse *r, size_t bytes);
/* Locks of sequences that have no cell any more are released, stale ones dropped (after every
 * operation that removes cells from sequences). */
void kvc_reuse_sync(kvc_unified *c);
/* kvc_reuse_sync after an operation that removed cells of sequence s alone (every sequence for
 * s < 0): O(1) where no prefix left the index since the last sync. */
void kvc_reuse_sync_seq(kvc_unified *c, int32_t s);
/* Record the effect of the index's last insert (n_added cells from cells / streams + n_present
 * on) and of the cells it let go. */
void kvc_reuse_note_insert(kvc_unified *c, const uint32_t *cells, const uint32_t *streams, uint32_t from,
                           uint32_t to);

/* KVC_OK when the held bits are exactly the index's cells and the index's own invariants hold,
 * every lock is valid for a sequence that holds cells; KVC_E_INTERNAL with err otherwise. */
int  kvc_reuse_check(const kvc_unified *c, kvc_err *err);

#ifdef __cplusplus
}
#endif

#endif
