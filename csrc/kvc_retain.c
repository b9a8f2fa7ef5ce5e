/* kvcache — prefix reuse, the requests' side (kvc_retain.h). */
#include "kvc_retain.h"

#include <string.h>

#include "kvc_unified.h"

static int reuse_off(kvc_err *err) {
    return kvc_err_set(err, KVC_E_ARG, "prefix reuse is off for this cache (enable_prefix_reuse() turns it on)");
}

/* Cells sequence s holds (the room a release needs per token). */
static uint32_t seq_n_cells(const kvc_unified *c, int32_t s) {
    return kvc_unified_stream_cells_c(c, kvc_unified_stream_of(c, s))->seq_pos[s].n;
}

/* Whether a cell with record rc and shift sh can be the next token of the prompt a release keeps,
 * after a cell computed at `last` (0 for the first token): unshifted, never moved, computed no
 * earlier than the cell before it (the K/V of a token depend on every token before it), with a
 * known token that agrees with the caller's (want: the caller's token, NULL when none was given).
 * If so its token goes to *tok. */
static inline bool cell_takes(kvc_reuse_cell rc, int32_t sh, uint64_t last, const int32_t *want, int32_t *tok) {
    if (sh != 0 || rc.born == KVC_REUSE_MOVED || rc.born < last) {
        return false;
    }
    if (rc.tok == KVC_TOKEN_NULL) {
        if (!want) {
            return false;
        }
        *tok = *want;
    } else if (want && *want != rc.tok) {
        return false;
    } else {
        *tok = rc.tok;
    }
    return true;
}

/* take_cell's shift of cell i: a table with no shift since its last reset has every shift 0
 * (one array less to read). */
static inline int32_t shift_of(const kvc_cells *cells, uint32_t i) {
    return cells->has_shift ? cells->shift[i] : 0;
}

/* Whether cell i of stream st can be token k of the prompt a release keeps (toks[0 .. k) and
 * their cells in r->tmp_cell / tmp_strm so far; cell_takes). If so it is recorded as token k. */
static inline bool take_cell(kvc_unified *c, uint32_t st, uint32_t i, const int32_t *tokens, uint32_t n, int32_t *toks,
                             uint32_t k) {
    kvc_reuse *r = c->reuse;
    const kvc_reuse_cell *rec = r->rec + (size_t)st * c->cells.size;
    const uint64_t last = k > 0 ? rec[r->tmp_cell[k - 1]].born : 0;
    if ((tokens && k >= n) ||
        !cell_takes(rec[i], shift_of(kvc_unified_stream_cells_c(c, st), i), last, tokens ? &tokens[k] : NULL, &toks[k])) {
        return false;
    }
    r->tmp_cell[k] = i;
    r->tmp_strm[k] = st;
    return true;
}

/* The tokens a release of s keeps at most, without the extension: the cells of positions 0, 1,
 * ... (the first cell of each) that cell_takes takes; their tokens into toks (room for
 * seq_n_cells), their cells into r->tmp_cell / tmp_strm. Returns how many. With the extension:
 * up to the first position holding several tokens (collect_ext goes past them). from: the
 * leading tokens taken already (held_run), whose entries are s's first `from` (their tokens
 * and cells are not written: the insert resumes after them).
 * (Every array is read through a local: the build does not assume that stores to the outputs
 * leave the cache's fields alone, and this loop runs once per token of every release.) */
static uint32_t collect(kvc_unified *c, int32_t s, const int32_t *tokens, uint32_t n, int32_t *toks, uint32_t from) {
    const kvc_reuse *r = c->reuse;
    const uint32_t st = kvc_unified_stream_of(c, s), size = c->cells.size;
    const kvc_cells *cells = kvc_unified_stream_cells_c(c, st);
    const uint64_t *key = cells->seq_pos[s].key;
    const uint32_t n_key = cells->seq_pos[s].n, k_max = tokens ? n : UINT32_MAX;
    const kvc_reuse_cell *rec = r->rec + (size_t)st * size;
    const int32_t *shift = cells->has_shift ? cells->shift : NULL;
    const bool ext = cells->ext != NULL;
    uint32_t *out_cell = r->tmp_cell, *out_strm = r->tmp_strm;
    uint32_t k = from;
    uint64_t last = from ? rec[kvc_seq_key_cell(key[from - 1])].born : 0;   /* when token k - 1's cell was computed */
    for (uint32_t e = from; e < n_key; e++) {
        const int32_t p = kvc_seq_key_pos(key[e]);
        const uint32_t i = kvc_seq_key_cell(key[e]);
        if (e + KVC_CELLS_AHEAD < n_key) {
            /* the sequence's cells lie scattered over the table; the insert that follows reads
             * where each new cell lies in the index (its line fetched with the record's) */
            const uint32_t next = kvc_seq_key_cell(key[e + KVC_CELLS_AHEAD]);
            if (shift) {
                KVC_PREFETCH(shift + next);
            }
            KVC_PREFETCH(rec + next);
            kvc_prefix_prefetch_place(&r->idx, st, next);
        }
        if (p < (int32_t)k) {
            if (ext) {
                /* several tokens at one position (an image's): a chain of one token per
                 * position stops before them (collect_ext orders them) */
                k = (uint32_t)p;
                break;
            }
            continue;   /* a second cell at a position already taken */
        }
        const kvc_reuse_cell rc = rec[i];
        if (p != (int32_t)k || k >= k_max ||
            !cell_takes(rc, shift ? shift[i] : 0, last, tokens ? &tokens[k] : NULL, &toks[k])) {
            break;
        }
        out_cell[k] = i;
        out_strm[k] = st;
        last = rc.born;
        k++;
    }
    return k;
}

/* Order the cells a[0 .. m) by their 2-D position, row-major (the order in which the M-RoPE mask
 * lets the tokens of one position see each other); tmp: room for m. Bottom-up merge sort:
 * O(m log m), stable. */
static void sort_2d(const kvc_cell_ext *ext, uint32_t *a, uint32_t *tmp, uint32_t m) {
    for (uint32_t w = 1; w < m; w = w > m / 2 ? m : 2 * w) {
        for (uint32_t lo = 0; lo < m; lo = m - lo > 2 * w ? lo + 2 * w : m) {
            const uint32_t mid = m - lo > w ? lo + w : m, hi = m - mid > w ? mid + w : m;
            uint32_t i = lo, j = mid, o = lo;
            while (i < mid && j < hi) {
                tmp[o++] = kvc_cell_ext_2d_gt(&ext[a[i]], ext[a[j]].x, ext[a[j]].y) ? a[j++] : a[i++];
            }
            while (i < mid) {
                tmp[o++] = a[i++];
            }
            while (j < hi) {
                tmp[o++] = a[j++];
            }
        }
        memcpy(a, tmp, (size_t)m * sizeof *a);
    }
}

/* collect() for cells with the extension, past images: the sequence's cells in the order its
 * tokens see each other (by position; the tokens of one position, an image's, by 2-D position,
 * row by row, as mtmd and transformers' Qwen2-VL lay an image out), each kept while take_cell
 * takes it. A token is kept only where every cell it saw is a token kept before it:
 * - two tokens at one 2-D position see each other: the walk stops at the first;
 * - positions follow one another, except after a position holding several tokens (an image),
 *   where the next is one past the largest x or y of its tokens (M-RoPE places the text after an
 *   image there; mtmd advances by max(nx, ny)): a cell anywhere else follows a gap that removed
 *   cells it saw, and the walk stops there.
 * grp, tmp: scratch, room for seq_n_cells each. */
static uint32_t collect_ext(kvc_unified *c, int32_t s, const int32_t *tokens, uint32_t n, int32_t *toks, uint32_t *grp,
                            uint32_t *tmp) {
    const uint32_t st = kvc_unified_stream_of(c, s);
    const kvc_cells *cells = kvc_unified_stream_cells_c(c, st);
    const kvc_seq_pos *sp = &cells->seq_pos[s];
    uint32_t k = 0, e = 0;
    int64_t next = 0;   /* the position the next token must sit at */
    while (e < sp->n) {
        const int32_t p = kvc_seq_key_pos(sp->key[e]);
        if (p != next) {
            break;
        }
        uint32_t m = 0;
        int64_t far = p;   /* the largest x or y of the position's tokens */
        for (; e < sp->n && kvc_seq_key_pos(sp->key[e]) == p; e++) {
            const uint32_t i = kvc_seq_key_cell(sp->key[e]);
            grp[m++] = i;
            far = cells->ext[i].x > far ? cells->ext[i].x : far;
            far = cells->ext[i].y > far ? cells->ext[i].y : far;
        }
        if (m > 1) {
            sort_2d(cells->ext, grp, tmp, m);
        }
        for (uint32_t g = 0; g < m; g++) {
            const kvc_cell_ext *x = &cells->ext[grp[g]];
            if ((g + 1 < m && !kvc_cell_ext_2d_gt(&cells->ext[grp[g + 1]], x->x, x->y)) ||
                !take_cell(c, st, grp[g], tokens, n, toks, k)) {
                return k;
            }
            k++;
        }
        next = m > 1 ? far + 1 : (int64_t)p + 1;
    }
    return k;
}

uint32_t kvc_retain_seq_tokens(kvc_unified *c, int32_t s, int32_t *toks) {
    return c->reuse ? collect(c, s, NULL, 0, toks, 0) : 0;
}

uint32_t kvc_retain_seq_cells(const kvc_unified *c, int32_t s) {
    return seq_n_cells(c, s);
}

/* The leading tokens of s that are, cell for cell, the prefix s holds a lock on (the one it
 * attached or published last), under salt and as the caller's tokens say (when given): token j's
 * cell is s's only cell at position j and the index's cell of depth j, in s's stream. The index
 * keeps a cell only while its K/V stay what it says (a moved or overwritten cell leaves it, and
 * its handles with it), so these tokens need neither their cells' records read (scattered over
 * the table) nor a walk down the tree, and the insert that follows resumes after them: *at /
 * *off name where (kvc_prefix_insert_upto_from), and nothing reads their tokens or cells again.
 * Reads s's entries and the path's edges, both in order. 0 with the per-cell extension
 * (collect_ext's order) or in window mode. */
static uint32_t held_run(kvc_unified *c, int32_t s, uint64_t salt, const int32_t *tokens, uint32_t n,
                         kvc_prefix_handle *at, uint32_t *off) {
    kvc_reuse *r = c->reuse;
    const kvc_prefix *idx = &r->idx;
    const kvc_prefix_handle h = r->lock[s];
    if (r->ext || r->n_ghost || h.node == 0 || !kvc_prefix_handle_valid(idx, h)) {
        return 0;
    }
    const uint32_t st = kvc_unified_stream_of(c, s);
    const kvc_seq_pos *sp = &kvc_unified_stream_cells_c(c, st)->seq_pos[s];
    const uint64_t *key = sp->key;
    const uint32_t lim = tokens && n < sp->n ? n : sp->n;
    uint32_t q = idx->nodes[h.node].depth + idx->nodes[h.node].len;
    q = q < lim ? q : lim;
    /* the first entries the attach placed, unchanged since, are the lock's path's cells already
     * (a valid handle's path still holds every cell it held): only the caller's tokens, when
     * given, are compared there */
    const uint32_t sure = tokens ? 0 : sp->sure;
    /* up from h's node: each edge checks its tokens below q, the first that fails lowers q (the
     * edges above hold the tokens before it); the edge holding token q - 1 is where to resume */
    uint32_t x = h.node;
    for (; !idx->nodes[x].root; x = idx->nodes[x].parent) {
        const kvc_prefix_node *e = &idx->nodes[x];
        const uint32_t d = e->depth;
        for (uint32_t t = sure > d ? sure - d : 0; d + t < q && t < e->len; t++) {
            const uint32_t j = d + t;
            if (e->strm[t] != st || key[j] != kvc_seq_key((int32_t)j, e->cell[t]) || (tokens && tokens[j] != e->tok[t])) {
                q = j;
                break;
            }
        }
        if (d < q && q <= d + e->len) {
            *at = (kvc_prefix_handle){ x, e->gen };
            *off = q - d;
        }
    }
    return idx->nodes[x].label == salt ? q : 0;
}

/* Sequence s's lock moves to h (a deeper prefix it published): h locked first, so that a
 * shared path never loses its protection on the way. s's first `verified` entries are cells of
 * h's path (held_run): of the entries its attach vouched for (kvc_seq_pos.sure), those stay
 * vouched for (an insert from the root may have found other cells for the same tokens). */
static void lock_for(kvc_unified *c, int32_t s, kvc_prefix_handle h, uint32_t verified) {
    kvc_reuse *r = c->reuse;
    kvc_seq_pos *sp = &kvc_unified_stream_cells(c, kvc_unified_stream_of(c, s))->seq_pos[s];
    sp->sure = sp->sure < verified ? sp->sure : verified;
    if (kvc_prefix_lock(&r->idx, h, NULL) != KVC_OK) {
        return;
    }
    if (r->lock[s].node && kvc_prefix_handle_valid(&r->idx, r->lock[s])) {
        (void)kvc_prefix_unlock(&r->idx, r->lock[s], NULL);
    }
    r->lock[s] = h;
}

/* Release (end) or publish (!end: s goes on, holding a lock on what it published) sequence s. */
static int keep(kvc_unified *c, int32_t s, uint64_t salt, const int32_t *tokens, uint32_t n, bool end,
                kvc_retained *res, kvc_err *err) {
    kvc_reuse *r = c->reuse;
    memset(res, 0, sizeof *res);
    if (!r) {
        return reuse_off(err);
    }
    if (kvc_seq_id_check(s, c->n_seq_max, err) != KVC_OK) {
        return KVC_E_ARG;
    }
    const uint32_t st = kvc_unified_stream_of(c, s);
    const uint32_t m = seq_n_cells(c, s) ? seq_n_cells(c, s) : 1;
    int32_t *toks = kvc_reuse_keep_scratch(r, (size_t)m * 3 * sizeof *toks);
    if (!toks) {
        return kvc_err_set(err, KVC_E_NOMEM, "out of memory keeping the prefix of sequence %d", s);
    }
    uint32_t *dup_cells = (uint32_t *)(toks + m), *dup_strms = dup_cells + m;
    /* (the duplicates' room is the scratch of collect_ext until the match below) */
    kvc_prefix_handle from = { 0, 0 };
    uint32_t from_off = 0;
    const uint32_t q = held_run(c, s, salt, tokens, n, &from, &from_off);
    uint32_t k = r->ext ? collect_ext(c, s, tokens, n, toks, dup_cells, dup_strms) : collect(c, s, tokens, n, toks, q);
    /* with the extension, a prompt whose positions or 2-D positions differ from the held one's
     * shares none of its later cells: it is kept only up to there */
    if (k > 0 && r->ext) {
        kvc_prefix_handle at;
        const uint32_t held = kvc_prefix_match(&r->idx, salt, toks, k, k, dup_cells, dup_strms, &at);
        const kvc_cells *tab = kvc_unified_stream_cells_c(c, st);
        for (uint32_t j = 0; j < held && j < k; j++) {
            const uint32_t i = r->tmp_cell[j];
            const size_t at = kvc_reuse_at(r, dup_strms[j], dup_cells[j]);
            if (r->pos[at] != tab->pos[i] || !kvc_reuse_ext_is(c, &r->ext[at], tab->ext[i].x, tab->ext[i].y, tab->ext[i].tok)) {
                k = j;
                break;
            }
        }
    }
    int rc = KVC_OK;
    if (k > 0) {
        /* K/V depend on every token before: a cell the index holds serves this prompt only inside
         * the prefix the index holds of it (there it is the index's own cell or a duplicate); past
         * that prefix, a held cell belongs to another prompt and ends what is kept */
        kvc_prefix_inserted ins;
        rc = q > 0 ? kvc_prefix_insert_upto_from(&r->idx, from, from_off, toks, r->tmp_cell, r->tmp_strm, k, dup_cells,
                                                 dup_strms, &ins, err)
                   : kvc_prefix_insert_upto(&r->idx, salt, toks, r->tmp_cell, r->tmp_strm, k, dup_cells, dup_strms, &ins,
                                            err);
        k = ins.n_present + ins.n_added;
        if (rc == KVC_OK && k > 0) {
            kvc_reuse_note_insert(c, r->tmp_cell, r->tmp_strm, ins.n_present, k);
            const kvc_cells *tab = kvc_unified_stream_cells_c(c, st);
            for (uint32_t j = ins.n_present; r->ext && j < k; j++) {
                r->ext[kvc_reuse_at(r, st, r->tmp_cell[j])] = tab->ext[r->tmp_cell[j]];
                r->pos[kvc_reuse_at(r, st, r->tmp_cell[j])] = tab->pos[r->tmp_cell[j]];
            }
            res->n_kept = k;
            res->n_new = ins.n_added;
            res->n_evicted = ins.n_evicted;
            if (!end) {
                lock_for(c, s, ins.end, q);
            }
        } else if (rc == KVC_E_NOSPACE) {
            rc = KVC_OK;   /* nothing kept: said by n_kept 0 */
        }
    }
    if (rc != KVC_OK) {
        return rc;
    }
    if (end) {
        kvc_unified_seq_rm(c, s, -1, -1);   /* releases its lock (kvc_reuse_sync) */
    } else {
        kvc_reuse_sync_seq(c, s);   /* the cap may have evicted a lock's prefix */
    }
    return KVC_OK;
}

int kvc_retain_release(kvc_unified *c, int32_t s, uint64_t salt, const int32_t *tokens, uint32_t n,
                       kvc_retained *res, kvc_err *err) {
    return keep(c, s, salt, tokens, n, true, res, err);
}

int kvc_retain_publish(kvc_unified *c, int32_t s, uint64_t salt, const int32_t *tokens, uint32_t n,
                       kvc_retained *res, kvc_err *err) {
    return keep(c, s, salt, tokens, n, false, res, err);
}

/* With the extension: how many of the p matched cells (r->tmp_cell / tmp_strm) sit at the
 * position the request places their token at (pos: NULL for 0, 1, ...) and carry the extension
 * it places there (pos_x / pos_y: NULL for zeros); else p. */
static uint32_t ext_agree(const kvc_unified *c, const int32_t *tokens, const int32_t *pos, const int32_t *pos_x,
                          const int32_t *pos_y, uint32_t p) {
    const kvc_reuse *r = c->reuse;
    for (uint32_t j = 0; r->ext && j < p; j++) {
        const size_t at = kvc_reuse_at(r, r->tmp_strm[j], r->tmp_cell[j]);
        if (r->pos[at] != (pos ? pos[j] : (int32_t)j) ||
            !kvc_reuse_ext_is(c, &r->ext[at], pos_x ? pos_x[j] : 0, pos_y ? pos_y[j] : 0, tokens[j])) {
            return j;
        }
    }
    return p;
}

/* How many of the p tokens whose cells r->tmp_cell / tmp_strm hold an attach takes (the cells it
 * places, from lo, must lie in one stream): p when they do; else the run in the stream of the
 * first, and 0 in window mode (a window split between streams serves no hit). */
static uint32_t one_stream(const kvc_unified *c, bool window, uint32_t lo, uint32_t p) {
    const kvc_reuse *r = c->reuse;
    for (uint32_t i = lo + 1; c->n_stream > 1 && i < p; i++) {
        if (r->tmp_strm[i] != r->tmp_strm[lo]) {
            return window ? 0 : i;
        }
    }
    return p;
}

/* The longest prefix of at most max_len tokens the index holds and the request's extension
 * agrees with: its cells in r->tmp_cell / tmp_strm, its end in *end. */
static uint32_t match_xy(kvc_unified *c, uint64_t salt, const int32_t *tokens, const int32_t *pos,
                         const int32_t *pos_x, const int32_t *pos_y, uint32_t n, uint32_t max_len,
                         kvc_prefix_handle *end) {
    kvc_reuse *r = c->reuse;
    uint32_t p = kvc_prefix_match(&r->idx, salt, tokens, n, max_len, r->tmp_cell, r->tmp_strm, end);
    const uint32_t q = ext_agree(c, tokens, pos, pos_x, pos_y, p);
    if (q < p) {
        p = kvc_prefix_match(&r->idx, salt, tokens, n, q, r->tmp_cell, r->tmp_strm, end);
    }
    return p;
}

uint32_t kvc_retain_match_xy(kvc_unified *c, uint64_t salt, const int32_t *tokens, const int32_t *pos,
                             const int32_t *pos_x, const int32_t *pos_y, uint32_t n) {
    if (!c->reuse || n < 2) {
        return 0;
    }
    kvc_prefix_handle end;
    if (!c->reuse->ext && c->n_stream == 1) {
        return kvc_prefix_match(&c->reuse->idx, salt, tokens, n, n - 1, NULL, NULL, &end);
    }
    /* with streams, what an attach takes: the run in the stream of the first */
    const uint32_t p = match_xy(c, salt, tokens, pos, pos_x, pos_y, n, n - 1, &end);
    return c->reuse->n_ghost ? p : one_stream(c, false, 0, p);
}

uint32_t kvc_retain_match(kvc_unified *c, uint64_t salt, const int32_t *tokens, uint32_t n) {
    return kvc_retain_match_xy(c, salt, tokens, NULL, NULL, NULL, n);
}

/* The position the request places token j at (pos NULL: j); for j == n, the one after its last
 * (a hit of the whole prompt: the next token's). */
static inline int64_t req_pos(const int32_t *pos, uint32_t n, uint32_t j) {
    return !pos ? (int64_t)j : j < n ? (int64_t)pos[j] : (int64_t)pos[n - 1] + 1;
}

/* The first position a query at position p sees in c's sliding window (0 without one): the cells
 * a request resuming with a query at p needs of the positions before it (a later query sees no
 * more of them). */
static int64_t window_start(const kvc_unified *c, int64_t p) {
    const int64_t lo = kvc_unified_swa_start(c, (int32_t)(p < INT32_MAX ? p : INT32_MAX));
    return lo < 0 ? 0 : lo;
}

/* The longest hit q <= p a window-mode index serves with the tokens' cells (ghosts too) in
 * cells[0 .. p), the request placing token j at req_pos(pos, n, j): every token of the window
 * of the query at q's position is a cell of the cache, not a ghost. The positions of a held
 * prompt never decrease (kvc_retain_release's order), so the window is the tokens from the
 * first at or past its start, and the last ghost before q is the one to look at. */
static uint32_t window_hit(const kvc_unified *c, const uint32_t *cells, const int32_t *pos, uint32_t n, uint32_t p) {
    uint32_t best = 0;
    int64_t ghost = -1;   /* the position of the last ghost before q */
    for (uint32_t q = 1; q <= p; q++) {
        if (kvc_reuse_is_ghost(c, cells[q - 1])) {
            ghost = req_pos(pos, n, q - 1);
        }
        if (ghost < window_start(c, req_pos(pos, n, q))) {
            best = q;
        }
    }
    return best;
}

/* The first of the p tokens a window-mode attach places: the first at or past the start of the
 * window of the query at p. */
static uint32_t window_lo(const kvc_unified *c, const int32_t *pos, uint32_t n, uint32_t p) {
    const int64_t lo = window_start(c, req_pos(pos, n, p));
    uint32_t j = p;
    while (j > 0 && req_pos(pos, n, j - 1) >= lo) {
        j--;
    }
    return j;
}

static inline bool is_window(const kvc_unified *c) { return c->reuse && c->reuse->n_ghost; }

/* The longest hit q <= p a part attaches whole (attach_run's rules), the p tokens matched in its
 * index: without window mode the run of the first's stream; in window mode the longest hit whose
 * window the index holds as cells of one stream. */
static uint32_t part_hit(kvc_unified *c, uint64_t salt, const int32_t *tokens, const int32_t *pos, uint32_t n,
                         uint32_t p) {
    kvc_reuse *r = c->reuse;
    kvc_prefix_handle end;
    const uint32_t got = kvc_prefix_match(&r->idx, salt, tokens, n, p, r->tmp_cell, r->tmp_strm, &end);
    if (!is_window(c)) {
        return one_stream(c, false, 0, got);
    }
    uint32_t q = window_hit(c, r->tmp_cell, pos, n, got);
    while (q > 0 && one_stream(c, true, window_lo(c, pos, n, q), q) == 0) {
        q = window_hit(c, r->tmp_cell, pos, n, q - 1);
    }
    return q;
}

/* Attach to s the prefix the index holds of tokens[0 .. n), at most max_p tokens; in window mode
 * exactly max_p (the caller found that it serves them) of which only the window's cells are
 * placed in s. */
static int attach_run(kvc_unified *c, int32_t s, uint64_t salt, const int32_t *tokens, const int32_t *pos,
                      const int32_t *pos_x, const int32_t *pos_y, uint32_t n, uint32_t max_p, uint32_t *n_attached,
                      kvc_err *err) {
    kvc_reuse *r = c->reuse;
    const bool window = r->n_ghost != 0;
    kvc_prefix_handle end;
    uint32_t p = match_xy(c, salt, tokens, pos, pos_x, pos_y, n, max_p, &end);
    if (p == 0 || (window && p != max_p)) {
        return KVC_OK;
    }
    /* window mode: the cells of the window before p, all cells of the cache (ghosts before it) */
    const uint32_t lo = window ? window_lo(c, pos, n, p) : 0;
    for (uint32_t i = lo; window && i < p; i++) {
        if (kvc_reuse_is_ghost(c, r->tmp_cell[i])) {
            return kvc_err_set(err, KVC_E_INTERNAL, "the window before %u holds a ghost at %u", p, i);
        }
    }
    if (lo == p) {
        *n_attached = p;   /* the window before p is empty: nothing to place, nothing to lock */
        return KVC_OK;
    }
    /* the cells must come from one stream: the run in the stream of the first */
    const uint32_t src = r->tmp_strm[lo], st = kvc_unified_stream_of(c, s);
    p = one_stream(c, window, lo, p);
    if (p == 0) {
        return KVC_OK;   /* a window split between streams: no hit */
    }
    if (src != st) {
        /* room for the stream copy first: then nothing can fail */
        const int rc = kvc_unified_seq_cp_check(c, (int32_t)src, s, -1, -1, err);
        if (rc != KVC_OK) {
            return rc;
        }
    }
    kvc_unified_slot_drop(c);
    kvc_cells *cells = kvc_unified_stream_cells(c, st);
    if (src != st) {
        /* the sequence's stream holds nothing live (it is s's alone and s is empty): it becomes
         * the prefix's cells, whose K/V the next update copies from the source stream */
        kvc_reuse_forget_stream(c, st);
        kvc_cells_reset(cells);
        *kvc_unified_stream_head(c, st) = 0;
        c->copy_src[c->n_copies] = src;
        c->copy_dst[c->n_copies] = st;
        c->n_copies++;
    }
    /* the prefix's runs of consecutive cells only the index held (a prompt's chunks) are placed
     * a run at a time, when the positions are the tokens' depths */
    const bool runs = src == st && !r->pos && !r->ext;
    int32_t run_pos[KVC_CELLS_RUN_MAX], run_seq[KVC_CELLS_RUN_MAX];
    for (uint32_t i = lo; i < p; i++) {
        const uint32_t cell = r->tmp_cell[i];
        uint32_t m = 0;
        if (runs) {
            const uint32_t room = cells->size - cell;
            uint32_t max = p - i < KVC_CELLS_RUN_MAX ? p - i : KVC_CELLS_RUN_MAX;
            max = kvc_cells_empty_run(cells, cell, max < room ? max : room);
            while (m < max && r->tmp_cell[i + m] == cell + m) {
                run_pos[m] = (int32_t)(i + m);
                run_seq[m++] = s;
            }
        }
        if (m >= KVC_CELLS_RUN_MIN) {
            kvc_cells_place_first_run(cells, cell, m, run_pos, run_seq);
            for (uint32_t k = i + m; k < i + m + KVC_CELLS_AHEAD && k < p; k++) {
                kvc_cells_prefetch_seq(cells, r->tmp_cell[k], s);   /* those the run passed over */
            }
            i += m - 1;
            continue;
        }
        if (i + KVC_CELLS_AHEAD < p) {
            /* the prefix's cells lie scattered over the table */
            kvc_cells_prefetch_seq(cells, r->tmp_cell[i + KVC_CELLS_AHEAD], s);
        }
        if (kvc_cells_is_empty(cells, cell)) {
            /* a cell only the index held: its position back and s as its first sequence at once */
            kvc_cells_place_first(cells, cell, kvc_reuse_pos_of(c, src, cell, i), s);
            if (r->ext) {
                cells->ext[cell] = r->ext[kvc_reuse_at(r, src, cell)];   /* the table reset it */
            }
        } else {
            kvc_cells_seq_add(cells, cell, s);
        }
        if (src != st) {
            kvc_reuse_copy_cells(c, src, st, cell);
        }
    }
    if (src != st) {
        /* the head one past the last cell attached, as a placement of the prefix in the empty
         * stream leaves it: the request's next tokens go to cells after it, never over the
         * attached window's own cells while free ones remain (a sliding-window cache) */
        *kvc_unified_stream_head(c, st) = r->tmp_cell[p - 1] + 1;
        /* forgetting the stream may have dropped the node the match ended in (a prompt whose
         * later tokens lay in this stream): lock where the p tokens taken end now */
        (void)kvc_prefix_match(&r->idx, salt, tokens, n, p, NULL, NULL, &end);   /* p agreed already */
    }
    if (kvc_prefix_lock(&r->idx, end, NULL) == KVC_OK) {
        r->lock[s] = end;
        /* s's entries are the path's cells at positions 0 .. p - 1 (it was empty): a release
         * need not compare them (held_run) while they stay as they are */
        cells->seq_pos[s].sure = runs && !window ? p : 0;
    }
    *n_attached = p;
    return KVC_OK;
}

static int attach_check(kvc_unified *c, int32_t s, kvc_err *err) {
    if (!c->reuse) {
        return reuse_off(err);
    }
    if (kvc_seq_id_check(s, c->n_seq_max, err) != KVC_OK) {
        return KVC_E_ARG;
    }
    if (kvc_unified_seq_pos_max(c, s) >= 0) {
        return kvc_err_set(err, KVC_E_ARG, "sequence %d is not empty: a prefix attaches to a new sequence "
                           "(seq_rm(%d) first)", s, s);
    }
    return KVC_OK;
}

int kvc_retain_attach_xy(kvc_unified *c, int32_t s, uint64_t salt, const int32_t *tokens, const int32_t *pos,
                         const int32_t *pos_x, const int32_t *pos_y, uint32_t n, uint32_t *n_attached, kvc_err *err) {
    *n_attached = 0;
    const int rc = attach_check(c, s, err);
    if (rc != KVC_OK || n < 2) {
        return rc;
    }
    return attach_run(c, s, salt, tokens, pos, pos_x, pos_y, n, n - 1, n_attached, err);
}

int kvc_retain_attach(kvc_unified *c, int32_t s, uint64_t salt, const int32_t *tokens, uint32_t n,
                      uint32_t *n_attached, kvc_err *err) {
    return kvc_retain_attach_xy(c, s, salt, tokens, NULL, NULL, NULL, n, n_attached, err);
}

int kvc_retain_pin_xy(kvc_unified *c, uint64_t salt, const int32_t *tokens, const int32_t *pos, const int32_t *pos_x,
                      const int32_t *pos_y, uint32_t n, kvc_prefix_handle *pin, kvc_err *err) {
    memset(pin, 0, sizeof *pin);
    if (!c->reuse) {
        return reuse_off(err);
    }
    kvc_prefix_handle end;
    const uint32_t p = n ? match_xy(c, salt, tokens, pos, pos_x, pos_y, n, n, &end) : 0;
    if (n == 0 || p < n) {
        return kvc_err_set(err, KVC_E_ARG, "the index holds %u of the %u tokens to pin: only a held prefix can be "
                           "pinned", p, n);
    }
    const int rc = kvc_prefix_pin(&c->reuse->idx, end, err);
    if (rc == KVC_OK) {
        *pin = end;
    }
    return rc;
}

int kvc_retain_pin(kvc_unified *c, uint64_t salt, const int32_t *tokens, uint32_t n, kvc_prefix_handle *pin,
                   kvc_err *err) {
    return kvc_retain_pin_xy(c, salt, tokens, NULL, NULL, NULL, n, pin, err);
}

bool kvc_retain_pin_held(const kvc_unified *c, kvc_prefix_handle pin) {
    return c->reuse && pin.node != 0 && kvc_prefix_handle_valid(&c->reuse->idx, pin) &&
           c->reuse->idx.nodes[pin.node].n_pin != 0;
}

int kvc_retain_unpin(kvc_unified *c, kvc_prefix_handle pin, kvc_err *err) {
    if (!c->reuse) {
        return reuse_off(err);
    }
    if (!kvc_retain_pin_held(c, pin)) {
        return kvc_err_set(err, KVC_E_ARG, "not a pin of this cache's prefix index (unpinned already, or its "
                           "prefix was dropped)");
    }
    return kvc_prefix_unpin(&c->reuse->idx, pin, err);
}

/* --- composite caches -------------------------------------------------------------------- */

/* Composite enables are all or nothing: every part's mode is checked and every part that is off
 * turned on (an allocation may fail: those turned on go off again) before any cap is set on a
 * part that was on (setting it evicts, which cannot be taken back). */
int kvc_retain_enable_parts(kvc_unified *const *cs, uint32_t n_parts, uint32_t cap, kvc_err *err) {
    bool was_on[8];
    if (n_parts > 8) {
        return kvc_err_set(err, KVC_E_ARG, "at most 8 parts, got %u", n_parts);
    }
    for (uint32_t k = 0; k < n_parts; k++) {
        const int rc = kvc_reuse_mode_check(cs[k], false, err);
        if (rc != KVC_OK) {
            return rc;
        }
        was_on[k] = cs[k]->reuse != NULL;
    }
    for (uint32_t k = 0; k < n_parts; k++) {
        const int rc = was_on[k] ? KVC_OK : kvc_reuse_enable(cs[k], cap, err);
        if (rc != KVC_OK) {
            for (uint32_t j = 0; j < k; j++) {
                if (!was_on[j]) {
                    kvc_reuse_disable(cs[j]);
                }
            }
            return rc;
        }
    }
    for (uint32_t k = 0; k < n_parts; k++) {
        if (was_on[k]) {
            kvc_reuse_set_cap(cs[k], cap);
        }
    }
    return KVC_OK;
}

int kvc_retain_enable_window_pair(kvc_unified *base, kvc_unified *swa, uint32_t cap, kvc_err *err) {
    const bool was_on = base->reuse != NULL;
    if (kvc_unified_has_ext(base) != kvc_unified_has_ext(swa)) {
        return kvc_err_set(err, KVC_E_ARG, "the two caches disagree on the per-cell extension (cell_ext)");
    }
    int rc = kvc_reuse_mode_check(base, false, err);
    if (rc == KVC_OK) {
        rc = kvc_reuse_mode_check(swa, true, err);
    }
    if (rc == KVC_OK && !was_on) {
        rc = kvc_reuse_enable(base, cap, err);
    }
    if (rc == KVC_OK) {
        rc = kvc_reuse_enable_window(swa, base->cells.size, err);
        if (rc != KVC_OK && !was_on) {
            kvc_reuse_disable(base);
        }
    }
    if (rc == KVC_OK && was_on) {
        kvc_reuse_set_cap(base, cap);
    }
    return rc;
}

uint32_t kvc_retain_match_parts(kvc_unified *const *cs, uint32_t n_parts, uint64_t salt, const int32_t *tokens,
                                uint32_t n) {
    return kvc_retain_match_parts_xy(cs, n_parts, salt, tokens, NULL, NULL, NULL, n);
}

uint32_t kvc_retain_match_parts_xy(kvc_unified *const *cs, uint32_t n_parts, uint64_t salt, const int32_t *tokens,
                                   const int32_t *pos, const int32_t *pos_x, const int32_t *pos_y, uint32_t n) {
    uint32_t p = n;
    for (uint32_t k = 0; k < n_parts; k++) {
        const uint32_t q = kvc_retain_match_xy(cs[k], salt, tokens, pos, pos_x, pos_y, n);
        p = q < p ? q : p;
    }
    if (n_parts == 0) {
        return 0;
    }
    /* a part in window mode serves only hits whose window it still holds, a part with streams
     * only the run of one stream (part_hit); every shorter hit the others serve too, so take the
     * smallest until all agree */
    for (bool changed = true; changed && p > 0;) {
        changed = false;
        for (uint32_t k = 0; k < n_parts; k++) {
            if (!is_window(cs[k]) && cs[k]->n_stream == 1) {
                continue;
            }
            const uint32_t q = part_hit(cs[k], salt, tokens, pos, n, p);
            if (q != p) {
                p = q;
                changed = true;
            }
        }
    }
    return p;
}

bool kvc_retain_serves_parts(kvc_unified *const *cs, uint32_t n_parts, uint64_t salt, const int32_t *tokens,
                             uint32_t n, uint32_t p) {
    if (p == 0 || p > n) {
        return false;
    }
    for (uint32_t k = 0; k < n_parts; k++) {
        kvc_unified *c = cs[k];
        if (!c->reuse) {
            return false;
        }
        kvc_prefix_handle end;
        if (match_xy(c, salt, tokens, NULL, NULL, NULL, n, p, &end) != p ||
            ((is_window(c) || c->n_stream > 1) && part_hit(c, salt, tokens, NULL, n, p) != p)) {
            return false;
        }
    }
    return true;
}

int kvc_retain_attach_parts(kvc_unified *const *cs, uint32_t n_parts, int32_t s, uint64_t salt,
                            const int32_t *tokens, uint32_t n, uint32_t *n_attached, kvc_err *err) {
    return kvc_retain_attach_parts_xy(cs, n_parts, s, salt, tokens, NULL, NULL, NULL, n, n_attached, err);
}

int kvc_retain_attach_parts_xy(kvc_unified *const *cs, uint32_t n_parts, int32_t s, uint64_t salt,
                               const int32_t *tokens, const int32_t *pos, const int32_t *pos_x, const int32_t *pos_y,
                               uint32_t n, uint32_t *n_attached, kvc_err *err) {
    *n_attached = 0;
    for (uint32_t k = 0; k < n_parts; k++) {
        const int rc = attach_check(cs[k], s, err);
        if (rc != KVC_OK) {
            return rc;
        }
    }
    const uint32_t p = kvc_retain_match_parts_xy(cs, n_parts, salt, tokens, pos, pos_x, pos_y, n);
    if (p == 0) {
        return KVC_OK;
    }
    /* every part serves p tokens: each attaches exactly p */
    for (uint32_t k = 0; k < n_parts; k++) {
        uint32_t got = 0;
        const int rc = attach_run(cs[k], s, salt, tokens, pos, pos_x, pos_y, n, p, &got, err);
        if (rc != KVC_OK || got != p) {
            for (uint32_t j = 0; j <= k; j++) {
                kvc_unified_seq_rm(cs[j], s, -1, -1);   /* back to empty; the locks go with it */
            }
            return rc != KVC_OK ? rc : kvc_err_set(err, KVC_E_INTERNAL, "part %u attached %u of %u tokens", k, got, p);
        }
    }
    *n_attached = p;
    return KVC_OK;
}

/* The order in which a prompt's tokens see each other (kvc_retain_release): by position, then
 * row, then column (a, b NULL: without the extension). Negative, 0 or positive. */
static inline int order_cmp(int64_t p, const kvc_cell_ext *a, int64_t q, const kvc_cell_ext *b) {
    if (p != q) {
        return p < q ? -1 : 1;
    }
    if (!a || a->y != b->y) {
        return !a ? 0 : a->y < b->y ? -1 : 1;
    }
    return a->x < b->x ? -1 : a->x > b->x;
}

/* keep() for a part in window mode: the prompt toks[0 .. n) (the tokens the base part kept, so
 * every token was computed after exactly the ones before it), the sequence's cells where it
 * still has them, ghosts elsewhere. kpos, kext: with the extension, the position and extension
 * of each token as the base part's cells hold them (which the index records with each token,
 * ghosts too); NULL without (token j at position j). have_tokens: the caller gave the tokens (a
 * cell placed without one takes its token's). */
static int keep_window(kvc_unified *c, int32_t s, uint64_t salt, const int32_t *toks, const int32_t *kpos,
                       const kvc_cell_ext *kext, uint32_t n, bool have_tokens, bool end, kvc_retained *res,
                       kvc_err *err) {
    kvc_reuse *r = c->reuse;
    memset(res, 0, sizeof *res);
    const uint32_t st = kvc_unified_stream_of(c, s), size = c->cells.size, none = UINT32_MAX;
    const kvc_cells *cells = kvc_unified_stream_cells_c(c, st);
    const kvc_seq_pos *sp = &cells->seq_pos[s];
    const kvc_reuse_cell *rec = r->rec + (size_t)st * size;
    if (kext && !r->ext) {
        return kvc_err_set(err, KVC_E_ARG, "the parts of the cache disagree on the per-cell extension");
    }
    const size_t room = 6 * (size_t)n + 2 * (size_t)sp->n;
    uint32_t *buf = n ? kvc_malloc_n(room, sizeof *buf) : NULL;
    if (n && !buf) {
        return kvc_err_set(err, KVC_E_NOMEM, "out of memory keeping the prefix of sequence %d", s);
    }
    uint32_t *ours = buf, *idx_cell = buf + n, *idx_strm = buf + 2 * (size_t)n, *fill = buf + 3 * (size_t)n;
    uint32_t *dup_cells = buf + 4 * (size_t)n, *dup_strms = buf + 5 * (size_t)n;
    uint32_t *grp = buf + 6 * (size_t)n, *tmp = grp + sp->n;
    /* the sequence's cells of the prompt's tokens, walked beside the prompt in the order its
     * tokens see each other (by position; with the extension one position's tokens by 2-D
     * position): a cell is token j's where it sits at token j's position and 2-D position (with
     * per-layer embeddings: for its input too), unshifted, never moved, computed after the cell
     * before it, for the token */
    for (uint32_t j = 0; j < n; j++) {
        ours[j] = none;
    }
    uint64_t last = 0;
    for (uint32_t e = 0, j = 0; e < sp->n && j < n;) {
        const int32_t p = kvc_seq_key_pos(sp->key[e]);
        uint32_t m = 0;
        for (; e < sp->n && kvc_seq_key_pos(sp->key[e]) == p; e++) {
            grp[m++] = kvc_seq_key_cell(sp->key[e]);
        }
        if (kext && m > 1) {
            sort_2d(cells->ext, grp, tmp, m);
        }
        for (uint32_t g = 0; g < m && j < n; g++) {
            const uint32_t i = grp[g];
            const kvc_cell_ext *x = kext ? &cells->ext[i] : NULL;
            int cmp = 1;
            while (j < n && (cmp = order_cmp(p, x, kpos ? kpos[j] : (int64_t)j, kext ? &kext[j] : NULL)) > 0) {
                j++;
            }
            if (cmp != 0 || ours[j] != none || cells->shift[i] != 0 || rec[i].born == KVC_REUSE_MOVED ||
                rec[i].born < last || (rec[i].tok == KVC_TOKEN_NULL ? !have_tokens : rec[i].tok != toks[j]) ||
                (x && !kvc_reuse_ext_is(c, x, kext[j].x, kext[j].y, kext[j].tok))) {
                continue;
            }
            ours[j] = i;
            last = rec[i].born;
        }
    }
    uint32_t k = 0, held = 0;
    for (int attempt = 0; attempt < 2; attempt++) {
        kvc_prefix_handle at;
        held = n ? kvc_prefix_match(&r->idx, salt, toks, n, n, idx_cell, idx_strm, &at) : 0;
        uint32_t need = 0;
        k = n;
        for (uint32_t j = 0; j < n; j++) {
            const uint32_t i = ours[j];
            /* a held cell past the prefix the index holds of this prompt belongs to another */
            if (i != none && kvc_reuse_is_held(c, st, i) && (j >= held || idx_cell[j] != i || idx_strm[j] != st)) {
                k = j;
                break;
            }
            /* with the extension, a held prompt whose positions or 2-D positions differ from this
             * one's shares none of its later tokens: kept only up to there */
            const size_t at = j < held && kext ? kvc_reuse_at(r, idx_strm[j], idx_cell[j]) : 0;
            if (j < held && kext &&
                (r->pos[at] != kpos[j] || !kvc_reuse_ext_is(c, &r->ext[at], kext[j].x, kext[j].y, kext[j].tok))) {
                k = j;
                break;
            }
            need += j >= held && i == none;
        }
        if (need <= r->n_ghost_free[st]) {
            break;
        }
        if (attempt == 0) {
            (void)kvc_reuse_free_ghosts(c, st, need);   /* evicting may change what the index holds */
            continue;
        }
        /* keep what the free ghosts reach */
        uint32_t have = r->n_ghost_free[st];
        for (uint32_t j = held; j < k; j++) {
            if (ours[j] == none && have-- == 0) {
                k = j;
                break;
            }
        }
    }
    int rc = KVC_OK;
    if (k > 0) {
        for (uint32_t j = 0; j < k; j++) {
            fill[j] = none;
            if (j < held) {
                const bool ghost = kvc_reuse_is_ghost(c, idx_cell[j]);
                if (ghost && ours[j] != none && idx_strm[j] == st && !kvc_reuse_is_held(c, st, ours[j])) {
                    fill[j] = idx_cell[j];   /* the index's ghost gets this cell */
                }
                r->tmp_cell[j] = ours[j] != none && !ghost ? ours[j] : idx_cell[j];
                r->tmp_strm[j] = ours[j] != none && !ghost ? st : idx_strm[j];
            } else {
                r->tmp_cell[j] = ours[j] != none ? ours[j] : kvc_reuse_ghost_take(c, st);
                r->tmp_strm[j] = st;
            }
        }
        kvc_prefix_inserted ins;
        rc = kvc_prefix_insert(&r->idx, salt, toks, r->tmp_cell, r->tmp_strm, k, dup_cells, dup_strms, &ins, err);
        if (rc == KVC_OK) {
            kvc_reuse_note_insert(c, r->tmp_cell, r->tmp_strm, ins.n_present, k);
            for (uint32_t j = ins.n_present; kext && j < k; j++) {   /* cells and ghosts alike */
                r->ext[kvc_reuse_at(r, st, r->tmp_cell[j])] = kext[j];
                r->pos[kvc_reuse_at(r, st, r->tmp_cell[j])] = kpos[j];
            }
            for (uint32_t j = 0; j < held && j < k; j++) {
                if (fill[j] != none) {
                    kvc_reuse_fill_ghost(c, st, fill[j], ours[j]);
                }
            }
            res->n_kept = k;
            res->n_new = ins.n_added;
            if (!end) {
                lock_for(c, s, ins.end, 0);
            }
        } else {
            for (uint32_t j = held; j < k; j++) {
                if (ours[j] == none) {
                    kvc_reuse_ghost_give(c, st, r->tmp_cell[j]);
                }
            }
        }
    }
    kvc_free(buf);
    if (rc != KVC_OK) {
        return rc;
    }
    if (end) {
        kvc_unified_seq_rm(c, s, -1, -1);
    } else {
        kvc_reuse_sync(c);
    }
    return KVC_OK;
}

/* Release (end) or publish in every part. */
static int keep_parts(kvc_unified *const *cs, uint32_t n_parts, int32_t s, uint64_t salt, const int32_t *tokens,
                      uint32_t n, bool end, kvc_retained *res, kvc_err *err) {
    memset(res, 0, sizeof *res);
    if (kvc_seq_id_check(s, cs[0]->n_seq_max, err) != KVC_OK) {
        return KVC_E_ARG;
    }
    res->n_kept = UINT32_MAX;
    /* a part in window mode keeps the prompt the first other part keeps: its tokens first (with
     * the extension, their positions and extensions too) */
    int32_t *toks = NULL, *kpos = NULL;
    kvc_cell_ext *kext = NULL;
    uint32_t n_toks = 0;
    for (uint32_t k = 0; k < n_parts; k++) {
        if (!cs[k]->reuse) {
            res->n_kept = 0;
            return reuse_off(err);
        }
    }
    for (uint32_t k = 0; k < n_parts && !toks; k++) {
        if (is_window(cs[k])) {
            for (uint32_t b = 0; b < n_parts; b++) {
                if (!is_window(cs[b])) {
                    kvc_unified *base = cs[b];
                    const uint32_t m = seq_n_cells(base, s) ? seq_n_cells(base, s) : 1;
                    const bool ext = base->reuse->ext != NULL;
                    /* toks, then with the extension kpos, collect_ext's scratch (2 m) and kext */
                    toks = kvc_malloc_n(m, ext ? 4 * sizeof *toks + sizeof *kext : sizeof *toks);
                    if (!toks) {
                        res->n_kept = 0;
                        return kvc_err_set(err, KVC_E_NOMEM, "out of memory keeping the prefix of sequence %d", s);
                    }
                    if (!ext) {
                        n_toks = collect(base, s, tokens, n, toks, 0);
                        break;
                    }
                    kpos = toks + m;
                    uint32_t *grp = (uint32_t *)(kpos + m), *tmp = grp + m;
                    kext = (kvc_cell_ext *)(tmp + m);
                    n_toks = collect_ext(base, s, tokens, n, toks, grp, tmp);
                    const kvc_cells *tab = kvc_unified_stream_cells_c(base, kvc_unified_stream_of(base, s));
                    for (uint32_t j = 0; j < n_toks; j++) {
                        kpos[j] = tab->pos[base->reuse->tmp_cell[j]];
                        kext[j] = tab->ext[base->reuse->tmp_cell[j]];
                    }
                    break;
                }
            }
            if (!toks) {
                res->n_kept = 0;
                return kvc_err_set(err, KVC_E_ARG, "a cache in window mode needs a part that is not");
            }
        }
    }
    int rc = KVC_OK;
    for (int pass = 0; pass < 2 && rc == KVC_OK; pass++) {
        /* the parts that hold every cell first: the window parts keep what they kept */
        for (uint32_t k = 0; k < n_parts && rc == KVC_OK; k++) {
            if (is_window(cs[k]) != (pass == 1)) {
                continue;
            }
            kvc_retained one;
            if (pass == 0) {
                rc = keep(cs[k], s, salt, tokens, n, end, &one, err);
            } else {
                const uint32_t upto = res->n_kept < n_toks ? res->n_kept : n_toks;
                rc = keep_window(cs[k], s, salt, toks, kpos, kext, upto, tokens != NULL, end, &one, err);
            }
            if (rc == KVC_OK) {
                res->n_kept = one.n_kept < res->n_kept ? one.n_kept : res->n_kept;
                res->n_new += one.n_new;
                res->n_evicted += one.n_evicted;
            }
        }
    }
    kvc_free(toks);
    if (rc != KVC_OK || res->n_kept == UINT32_MAX) {
        res->n_kept = 0;
    }
    return rc;
}

int kvc_retain_release_parts(kvc_unified *const *cs, uint32_t n_parts, int32_t s, uint64_t salt,
                             const int32_t *tokens, uint32_t n, kvc_retained *res, kvc_err *err) {
    return keep_parts(cs, n_parts, s, salt, tokens, n, true, res, err);
}

int kvc_retain_publish_parts(kvc_unified *const *cs, uint32_t n_parts, int32_t s, uint64_t salt,
                             const int32_t *tokens, uint32_t n, kvc_retained *res, kvc_err *err) {
    return keep_parts(cs, n_parts, s, salt, tokens, n, false, res, err);
}

int kvc_retain_pin_parts_xy(kvc_unified *const *cs, uint32_t n_parts, uint64_t salt, const int32_t *tokens,
                            const int32_t *pos, const int32_t *pos_x, const int32_t *pos_y, uint32_t n,
                            kvc_prefix_handle *pins, kvc_err *err) {
    for (uint32_t k = 0; k < n_parts; k++) {
        const int rc = kvc_retain_pin_xy(cs[k], salt, tokens, pos, pos_x, pos_y, n, &pins[k], err);
        if (rc != KVC_OK) {
            /* a pin just taken is held: its unpin cannot fail */
            for (uint32_t j = 0; j < k; j++) {
                kvc_retain_unpin(cs[j], pins[j], NULL);
            }
            return rc;
        }
    }
    return KVC_OK;
}

int kvc_retain_unpin_parts(kvc_unified *const *cs, uint32_t n_parts, const kvc_prefix_handle *pins, kvc_err *err) {
    for (uint32_t k = 0; k < n_parts; k++) {
        if (!kvc_retain_pin_held(cs[k], pins[k])) {
            return kvc_retain_unpin(cs[k], pins[k], err);   /* its refusal, which changes nothing */
        }
    }
    for (uint32_t k = 0; k < n_parts; k++) {
        kvc_retain_unpin(cs[k], pins[k], NULL);
    }
    return KVC_OK;
}

uint32_t kvc_retain_evict_parts(kvc_unified *const *cs, uint32_t n_parts, uint32_t n) {
    uint32_t went = 0;
    for (uint32_t k = 0; k < n_parts; k++) {
        went += kvc_reuse_evict(cs[k], n);
    }
    return went;
}
