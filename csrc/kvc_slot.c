/* kvcache — placing ubatches in a unified cache (see kvc_slot.h). */
#include "kvc_slot.h"
#include "kvc_reuse.h"
#include "kvc_defrag.h"
#include "kvc_layout.h"   /* KVC_STATE_MAX_PARTS: the parts of a composite cache */

#include "kvc_types.h"

#include <string.h>

/* --- the undo log ---------------------------------------------------------------------- */

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
    for (uint32_t j = 0; j < n; j++) {
        kvc_cells_seq_get(cells, i + j, u->seq + (size_t)(r->off + j) * nw);
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
static bool kvc_unified_search_walk(kvc_unified *c, uint32_t n_tokens) {
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

/* Where the seed's search leaves the head when it gives up because fewer than n_tokens cells are
 * empty (so every window it tries holds a used cell), found without the walk. The walk lands
 * on j + 1 for a used cell j (the first at or after the window's start), or on 0 when the window
 * no longer fits (past s = size - n_tokens), and gives up at the first landing at or after the
 * head it started from, one lap on (t: that head, size for 0). Below t every landing it can
 * make from a start up to s comes from the first used cell at or after t - 1, so it gives up
 * there when t - 1 <= s; otherwise its last start up to s lands after the first used cell at
 * or after s, and when that is still short of t it wraps to 0 and gives up after the first
 * used cell of the cache. */
static uint32_t kvc_unified_search_end(const kvc_cells *cells, uint32_t h0, uint32_t n_tokens) {
    const uint32_t size = cells->size, s = size - n_tokens;
    const uint32_t t = h0 == 0 ? size : h0;
    if (t - 1 <= s) {
        return kvc_cells_next_used(cells, t - 1, size) + 1;
    }
    const uint32_t l = kvc_cells_next_used(cells, s, size) + 1;
    return l >= t ? l : kvc_cells_next_used(cells, 0, size) + 1;
}

/* The seed's search, found without walking the holes: the windows it tries lie at the head, at
 * the first empty cell after each used one, and at 0 after it wraps, in that order around the
 * cache, and it stops at the first that is empty throughout. That is the first window from the
 * head to the end, else the first from the start of the cache on, and it is reached before the
 * search has travelled a whole cache size. When no window is empty the walk itself runs, to give
 * up where the seed does (head then moved as the seed moves it). */
static bool kvc_unified_search(kvc_unified *c, uint32_t n_tokens) {
    const kvc_cells *cells = &c->cells;
    const uint32_t size = cells->size, h0 = c->head, last_fit = size - n_tokens;
    if (size - cells->used < n_tokens) {
        /* no window can be empty: give up at once, the head where the walk would leave it */
        c->head = kvc_unified_search_end(cells, h0, n_tokens);
        return false;
    }
    uint32_t p = h0 <= last_fit ? kvc_cells_first_free_run(cells, h0, last_fit, n_tokens) : UINT32_MAX;
    if (p == UINT32_MAX && h0 > 0) {
        p = kvc_cells_first_free_run(cells, 0, h0 - 1 < last_fit ? h0 - 1 : last_fit, n_tokens);
    }
    if (p == UINT32_MAX) {
        return kvc_unified_search_walk(c, n_tokens);
    }
    c->head = p;
    return true;
}

int kvc_unified_find_slot(kvc_unified *c, const kvc_ubatch *ub) {
    return c->ops->find_slot(c, ub, NULL);
}

int kvc_unified_find_slot_2025_dry(kvc_unified *c, const kvc_ubatch *ub, int32_t *out, uint32_t *head) {
    kvc_unified_mark mark;
    kvc_unified_mark_take(c, &mark);
    const bool pending = c->defrag_pending;
    c->defrag_pending = false;   /* (a placement undone must not settle a pending defrag either) */
    const int found = kvc_unified_find_slot_2025(c, ub, NULL);
    if (found == 1 && out) {
        kvc_unified_slot_cells(c, out);
    }
    if (head) {
        *head = c->head;
    }
    (void)kvc_unified_rewind(c, &mark);   /* (also the head a failed search moved) */
    c->defrag_pending = pending;
    return found;
}

int kvc_unified_find_slot_2025_parts(kvc_unified *const *cs, uint32_t n, const kvc_ubatch *ub, int *found,
                                     kvc_err *err) {
    kvc_unified_mark marks[KVC_STATE_MAX_PARTS];
    if (n == 0 || n > KVC_STATE_MAX_PARTS) {
        return kvc_err_set(err, KVC_E_ARG, "find_slot: 1 to %d caches expected, got %u", KVC_STATE_MAX_PARTS, n);
    }
    int all = 1;
    for (uint32_t k = 0; k < n; k++) {
        kvc_unified_mark_take(cs[k], &marks[k]);
        const int r = kvc_unified_find_slot_2025(cs[k], ub, err);
        if (r < 0) {
            /* only find_slot changed the caches before it since their marks: the rewinds cannot fail */
            for (uint32_t j = k; j-- > 0;) {
                (void)kvc_unified_rewind(cs[j], &marks[j]);
            }
            return r;
        }
        found[k] = r == 1;
        all &= found[k];
    }
    return all;
}

int kvc_unified_find_slot_2025(kvc_unified *c, const kvc_ubatch *ub, kvc_err *err) {
    (void)err;   /* the seed's search has no argument to refuse */
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
    for (uint32_t g = 0, nst = ub->n_seq_tokens; g < ub->n_seqs; g++) {
        const uint32_t b = ub->seq_off[g];
        kvc_cells_place_run(cells, head + g * nst, nst, ub->pos + g * nst, ub->seq_ids + b, ub->seq_off[g + 1] - b);
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

/* --- semantics 2026: scattered placement ------------------------------------------------ */

int kvc_unified_groups(const kvc_unified *c, const kvc_ubatch *ub, uint32_t *strm, uint32_t *n_groups,
                       uint32_t *n_seq_tokens, kvc_err *err) {
    const uint32_t n = ub->n_tokens;
    if (n == 0) {
        return kvc_err_set(err, KVC_E_ARG, "the ubatch has no tokens");
    }
    if (ub->pos_x && !kvc_unified_has_ext(c)) {
        return kvc_err_set(err, KVC_E_ARG, "a ubatch with 2-D positions needs a cache with the per-cell extension");
    }
    if (c->n_stream == 1) {
        strm[0] = 0;
        *n_groups = 1;
        *n_seq_tokens = n;
        return KVC_OK;
    }
    /* the sequences in order of appearance; ids are < n_seq_max == n_stream */
    kvc_seqset seen;
    kvc_seqset_clear(&seen);
    uint32_t k = 0;
    for (uint32_t t = 0; t < n; t++) {
        const int32_t s = kvc_ubatch_first_id(ub, t);
        if (!kvc_seqset_has(&seen, s)) {
            kvc_seqset_add(&seen, s);
            strm[k++] = (uint32_t)s;
        }
    }
    const uint32_t nst = n / k;
    bool ok = n % k == 0;
    for (uint32_t t = 0; ok && t < n; t++) {
        const uint32_t g = t / ub->n_seq_tokens;
        for (uint32_t j = ub->seq_off[g]; ok && j < ub->seq_off[g + 1]; j++) {
            ok = (uint32_t)ub->seq_ids[j] == strm[t / nst];
        }
    }
    if (!ok) {
        return kvc_err_set(err, KVC_E_ARG, "a ubatch of a cache with several streams must hold the tokens of each "
                           "sequence together, one sequence id per token, every sequence with as many tokens "
                           "(%u tokens of %u sequences)", n, k);
    }
    *n_groups = k;
    *n_seq_tokens = nst;
    return KVC_OK;
}

/* Can a placement take used cell i of a stream? Only with a sliding window, when its one
 * sequence's window (as of that sequence's next position) has left it. */
static bool kvc_stream_reusable(const kvc_unified *c, const kvc_cells *cells, uint32_t i) {
    if (kvc_cells_seq_count(cells, i) != 1) {
        return false;
    }
    const int32_t q = kvc_cells_seq_next(cells, i, -1);
    const int32_t p_max = kvc_cells_seq_pos_max(cells, q);
    return kvc_unified_is_masked_swa(c, cells->pos[i], p_max == KVC_POS_MAX ? KVC_POS_MAX : p_max + 1);
}

/* The cells of [a, b) (a < b) that are not used, in order, into idx from got on until it holds n:
 * the new count. A word at a time. */
static uint32_t kvc_take_free(const uint64_t *used, uint32_t a, uint32_t b, uint32_t n, int32_t *idx, uint32_t got) {
    const uint32_t w_last = (b - 1) >> 6;
    const uint64_t last = (b & 63) ? ((uint64_t)1 << (b & 63)) - 1 : ~(uint64_t)0;
    uint64_t m = ~(uint64_t)0 << (a & 63);
    for (uint32_t w = a >> 6; w <= w_last; w++, m = ~(uint64_t)0) {
        if (w == w_last) {
            m &= last;
        }
        for (uint64_t ok = ~used[w] & m; ok; ok &= ok - 1) {
            idx[got++] = (int32_t)((w << 6) + kvc_ctz64(ok));
            if (got == n) {
                return got;
            }
        }
    }
    return got;
}

/* kvc_take_free of a cache with a prefix index: the cells of [a, b) neither used nor held, read
 * only in the words whose avail bit is set (bit w for word w; every word with such a cell has
 * it), the same cells in the same order. A word found without one loses its bit. */
static uint32_t kvc_take_avail(const uint64_t *used, const uint64_t *held, uint64_t *avail, uint32_t a, uint32_t b,
                               uint32_t n, int32_t *idx, uint32_t got) {
    const uint32_t w_first = a >> 6, w_last = (b - 1) >> 6;
    for (uint32_t mw = w_first >> 6; mw <= w_last >> 6; mw++) {
        uint64_t bits = avail[mw];
        if (mw == w_first >> 6) {
            bits &= ~(uint64_t)0 << (w_first & 63);
        }
        for (; bits; bits &= bits - 1) {
            const uint32_t w = (mw << 6) + kvc_ctz64(bits);
            if (w > w_last) {
                return got;
            }
            const uint64_t open = ~(used[w] | held[w]);
            if (!open) {
                avail[mw] &= ~((uint64_t)1 << (w & 63));
                continue;
            }
            uint64_t m = w == w_first ? ~(uint64_t)0 << (a & 63) : ~(uint64_t)0;
            if (w == w_last && (b & 63)) {
                m &= ((uint64_t)1 << (b & 63)) - 1;
            }
            for (uint64_t ok = open & m; ok; ok &= ok - 1) {
                idx[got++] = (int32_t)((w << 6) + kvc_ctz64(ok));
                if (got == n) {
                    return got;
                }
            }
        }
    }
    return got;
}

/* Where the search of n cells in stream st starts: the head, or 0 when plenty of cells before it
 * are free (hoping to fill them) or it is at the end. In a sliding-window cache the cells the
 * prefix index holds count as taken, as they are for placement: otherwise a search from 0 meets
 * the cells a live sequence's window left (which it takes) where, without the index, it would
 * have met those free cells first. */
static uint32_t kvc_stream_start(const kvc_unified *c, uint32_t st, uint32_t n) {
    const kvc_cells *cells = kvc_unified_stream_cells_c(c, st);
    const uint32_t h = kvc_unified_stream_head_c(c, st);
    if (h >= cells->size) {
        return 0;
    }
    uint64_t taken = cells->used;
    if ((uint64_t)h > taken + 2 * (uint64_t)n && c->reuse && c->swa_type != KVC_SWA_NONE) {
        taken += kvc_reuse_held_free(c, st, (uint64_t)h - taken - 2 * (uint64_t)n);
    }
    return (uint64_t)h > taken + 2 * (uint64_t)n ? 0 : h;
}

/* The placement rule of one group of n tokens in stream st: the usable cells from the head on,
 * wrapping, until n are found (into idx) or every cell was tested. Free cells come from the
 * used bits a word at a time; used cells are looked at only with a sliding window. When no room
 * was found: *n_free, when the search saw every cell, the cells it found neither used nor held
 * (what kvc_reuse_make_room starts from), else UINT32_MAX; *n_usable the cells it found it could
 * take (a sliding window's search sees every cell, the used ones its window left among them), 0
 * when it looked at none. */
static bool kvc_stream_search(kvc_unified *c, uint32_t st, uint32_t n, int32_t *idx, uint32_t *n_free,
                              uint32_t *n_usable) {
    const kvc_cells *cells = kvc_unified_stream_cells_c(c, st);
    const uint32_t size = cells->size;
    const bool swa = c->swa_type != KVC_SWA_NONE;
    uint32_t h = kvc_stream_start(c, st, n);
    *n_free = UINT32_MAX;
    *n_usable = 0;
    if (n > size) {
        return false;
    }
    if (!swa && size - cells->used < n) {
        return false;   /* only empty cells can be taken, and fewer than n are */
    }
    if (!swa) {
        /* from the head to the end, then from the beginning to the head */
        uint32_t got;
        if (c->reuse) {
            const uint64_t *held = &c->reuse->held[(size_t)st * c->reuse->n_words];
            uint64_t *avail = kvc_reuse_avail(c, st);
            got = kvc_take_avail(cells->used_bits, held, avail, h, size, n, idx, 0);
            if (got < n && h > 0) {
                got = kvc_take_avail(cells->used_bits, held, avail, 0, h, n, idx, got);
            }
        } else {
            got = kvc_take_free(cells->used_bits, h, size, n, idx, 0);
            if (got < n && h > 0) {
                got = kvc_take_free(cells->used_bits, 0, h, n, idx, got);
            }
        }
        if (got < n) {
            *n_free = *n_usable = got;
        }
        return got == n;
    }
    uint64_t n_tested = 0;
    uint32_t got = 0;
    for (;;) {
        if (h == size) {
            h = 0;
        }
        const uint32_t base = h & ~63u;
        uint64_t end = (uint64_t)base + 64;
        if (end > size) {
            end = size;
        }
        if (end - h > size - n_tested) {
            end = h + (size - n_tested);
        }
        const unsigned lo = h - base, hi = (unsigned)(end - base);
        const uint64_t range = (hi == 64 ? ~(uint64_t)0 : (((uint64_t)1 << hi) - 1)) & ~(((uint64_t)1 << lo) - 1);
        const uint64_t used = cells->used_bits[h >> 6] & range;
        const uint64_t held = kvc_reuse_held_word(c, st, h >> 6);   /* the prefix index's cells stay */
        uint64_t ok = ~(used | held) & range;
        /* a held cell its window left is reused only where the index can let it go */
        for (uint64_t m = used & ~kvc_reuse_kept_word(c, st, h >> 6); m; m &= m - 1) {
            const uint32_t i = base + kvc_ctz64(m);
            if (kvc_stream_reusable(c, cells, i)) {
                ok |= (uint64_t)1 << (i - base);
            }
        }
        for (; ok; ok &= ok - 1) {
            idx[got++] = (int32_t)(base + kvc_ctz64(ok));
            if (got == n) {
                return true;
            }
        }
        n_tested += end - h;
        h = (uint32_t)end;
        if (n_tested >= size) {
            *n_usable = got;
            return false;
        }
    }
}

/* Where token t of a ubatch lies, advanced one token at a time (a division per token costs
 * more than the rest of a decode token's placement): its placement group g and index i in it,
 * its ubatch group ug and index ui in that. */
typedef struct placed_at {
    uint32_t g, i, ug, ui;
} placed_at;

static inline void placed_next(placed_at *a, uint32_t nst, uint32_t ub_nst) {
    if (++a->i == nst) {
        a->i = 0;
        a->g++;
    }
    if (++a->ui == ub_nst) {
        a->ui = 0;
        a->ug++;
    }
}

/* Token t's cell (idx[t], in stream strm[a.g]; a: where t lies) is about to be placed: its
 * fields prefetched (its position, its sequence count, its first sequence's word; the prefix
 * index's record of it). */
KVC_PREFETCH_FN void prefetch_placed(const kvc_unified *c, const kvc_ubatch *ub, const int32_t *idx,
                                     const uint32_t *strm, uint32_t t, placed_at a) {
    const uint32_t st = strm[a.g], cell = (uint32_t)idx[t];
    const kvc_cells *cells = kvc_unified_stream_cells_c(c, st);
    if (ub->seq_off[a.ug] < ub->seq_off[a.ug + 1]) {
        kvc_cells_prefetch_append(cells, cell, ub->seq_ids[ub->seq_off[a.ug]]);
    }
    if (c->reuse) {
        const size_t k = (size_t)st * c->cells.size + cell;
        KVC_PREFETCH_W(c->reuse->rec + k);
    }
}

/* Where token t lies: its group of the placement (nst tokens each) and of the ubatch. */
static inline placed_at placed_at_of(uint32_t t, uint32_t nst, uint32_t ub_nst) {
    return (placed_at){ t / nst, t % nst, t / ub_nst, t % ub_nst };
}

/* How many tokens from t on (at most `left` and KVC_CELLS_RUN_MAX) apply places as one run:
 * tokens of one sequence id each (their ubatch groups' only one, into seq[]) going to
 * consecutive empty cells from idx[t] on; 0 when fewer than KVC_CELLS_RUN_MIN. a: where t lies. */
static uint32_t apply_run_at(const kvc_cells *cells, const kvc_ubatch *ub, const int32_t *idx, uint32_t t,
                             uint32_t left, placed_at a, int32_t *seq) {
    const int32_t cell0 = idx[t];
    const uint32_t room = cells->size - (uint32_t)cell0, ub_nst = ub->n_seq_tokens;
    uint32_t max = left < KVC_CELLS_RUN_MAX ? left : KVC_CELLS_RUN_MAX;
    max = max < room ? max : room;
    /* a token where no run starts costs a compare or a word of bits */
    if (max < KVC_CELLS_RUN_MIN || idx[t + KVC_CELLS_RUN_MIN - 1] != cell0 + (int32_t)KVC_CELLS_RUN_MIN - 1 ||
        (max = kvc_cells_empty_run(cells, (uint32_t)cell0, max)) < KVC_CELLS_RUN_MIN) {
        return 0;
    }
    uint32_t m = 0;
    while (m < max && idx[t + m] == cell0 + (int32_t)m) {
        const uint32_t j0 = ub->seq_off[a.ug];
        if (ub->seq_off[a.ug + 1] - j0 != 1) {
            break;
        }
        seq[m++] = ub->seq_ids[j0];
        if (++a.ui == ub_nst) {
            a.ui = 0;
            a.ug++;
        }
    }
    return m >= KVC_CELLS_RUN_MIN ? m : 0;
}

/* apply_ubatch: the tokens into their cells (a reused cell is emptied first), then every
 * sequence that lost a cell loses its positions up to the largest one overwritten (so that
 * its positions stay contiguous), then each group's stream head follows its last cell. */
static void kvc_apply_2026(kvc_unified *c, const kvc_ubatch *ub, const int32_t *idx, const uint32_t *strm,
                           uint32_t n_groups, uint32_t nst, bool dry) {
    int32_t over[KVC_MAX_SEQ];   /* set at the first overwrite (a placement seldom has one) */
    bool any = false;
    if (!dry) {
        kvc_reuse_placing(c);
    }
    const uint32_t n_tokens = n_groups * nst, ub_nst = ub->n_seq_tokens;
    /* token t's ubatch group, and where the token KVC_CELLS_AHEAD later lies (prefetched) */
    placed_at at = { 0, 0, 0, 0 };
    placed_at ahead = { KVC_CELLS_AHEAD / nst, KVC_CELLS_AHEAD % nst, KVC_CELLS_AHEAD / ub_nst,
                        KVC_CELLS_AHEAD % ub_nst };
    int32_t run_seq[KVC_CELLS_RUN_MAX];
    for (uint32_t g = 0; g < n_groups; g++) {
        kvc_cells *cells = kvc_unified_stream_cells(c, strm[g]);
        for (uint32_t i = 0; i < nst; i++) {
            const uint32_t t = g * nst + i, cell = (uint32_t)idx[t];
            /* a run of consecutive empty cells, one sequence each (a prompt's chunk, or a decode
             * step's tokens side by side), at once: the same cells, sequences and records */
            const uint32_t m = cells->ext ? 0 : apply_run_at(cells, ub, idx, t, nst - i, at, run_seq);
            if (m) {
                kvc_cells_place_first_run(cells, cell, m, ub->pos + t, run_seq);
                if (!dry) {
                    kvc_reuse_note_placed_run(c, strm[g], cell, m, ub->token ? ub->token + t : NULL);
                }
                /* on after the run: where its next token lies, and the lines of those ahead */
                i += m - 1;
                at = placed_at_of(t + m, nst, ub_nst);
                for (uint32_t u = t + m; u < t + m + KVC_CELLS_AHEAD && u < n_tokens; u++) {
                    prefetch_placed(c, ub, idx, strm, u, placed_at_of(u, nst, ub_nst));
                }
                ahead = placed_at_of(t + m + KVC_CELLS_AHEAD, nst, ub_nst);
                continue;
            }
            if (t + KVC_CELLS_AHEAD < n_tokens) {
                prefetch_placed(c, ub, idx, strm, t + KVC_CELLS_AHEAD, ahead);
                placed_next(&ahead, nst, ub_nst);
            }
            /* (the position, whose line the placement writes next anyway: the used bits would be
             * one more line to read) */
            if (!kvc_cells_is_empty(cells, cell)) {
                const int32_t q = kvc_cells_seq_next(cells, cell, -1);
                for (uint32_t k = 0; !any && k < c->n_seq_max; k++) {
                    over[k] = -1;
                }
                any = true;
                if (cells->pos[cell] > over[q]) {
                    over[q] = cells->pos[cell];
                }
                kvc_cells_seq_rm(cells, cell, q);
                if (!dry) {
                    kvc_reuse_overwrite(c, strm[g], cell);
                }
            }
            /* the cell holds no sequence now (emptied above if it was used) */
            const uint32_t ug = at.ug, j0 = ub->seq_off[ug], j1 = ub->seq_off[ug + 1];
            if (j0 < j1) {
                kvc_cells_place_first(cells, cell, ub->pos[t], ub->seq_ids[j0]);
                for (uint32_t j = j0 + 1; j < j1; j++) {
                    kvc_cells_seq_add(cells, cell, ub->seq_ids[j]);
                }
            } else {
                kvc_cells_pos_set(cells, cell, ub->pos[t]);
            }
            if (!dry) {
                kvc_reuse_note_placed(c, strm[g], cell, ub->token ? ub->token[t] : KVC_TOKEN_NULL);
            }
            if (cells->ext && (ub->pos_x || ub->token || c->ple)) {
                /* a ubatch with neither leaves the cell's extension as it was (llama.cpp) */
                const kvc_cell_ext e = { ub->pos_x ? ub->pos_x[t] : 0, ub->pos_y ? ub->pos_y[t] : 0,
                                         ub->token ? ub->token[t] : c->ple ? c->ple_token : KVC_TOKEN_NULL };
                cells->ext[cell] = e;
            }
            placed_next(&at, nst, ub_nst);
        }
    }
    for (uint32_t q = 0; any && q < c->n_seq_max; q++) {
        if (over[q] < 0) {
            continue;
        }
        const int32_t p_min = kvc_unified_seq_pos_min(c, (int32_t)q);
        if (p_min >= 0 && p_min <= over[q]) {
            kvc_unified_stream_seq_rm(c, kvc_unified_stream_of(c, (int32_t)q), (int32_t)q, p_min,
                                      over[q] == KVC_POS_MAX ? -1 : over[q] + 1);
        }
    }
    for (uint32_t g = 0; g < n_groups; g++) {
        *kvc_unified_stream_head(c, strm[g]) = (uint32_t)idx[g * nst + nst - 1] + 1;
    }
}

/* Where a search that does not evict stopped: the first group that found no room, and what its
 * search saw (kvc_stream_search's n_free and n_usable). */
typedef struct kvc_search_stop {
    uint32_t g, n_free, n_usable;
} kvc_search_stop;

/* The search half of find_slot: every group's cells into c->scatter.idx; the cache's cells are
 * not touched. evict: the prefix index's cells are evicted where a group needs room; from a
 * stop (not NULL) the search goes on at the group that stopped (the groups before it found
 * theirs, and the placement was dropped then), else it starts over (the placement dropped).
 * !evict: the first group without room ends it, named in *stop. 1 every group found room, 0 not. */
static int kvc_search_2026(kvc_unified *c, const uint32_t *strm, uint32_t n_groups, uint32_t nst, bool evict,
                           kvc_search_stop *stop) {
    const bool resume = evict && stop;
    if (!resume) {
        kvc_unified_slot_drop(c);
    }
    for (uint32_t g = resume ? stop->g : 0; g < n_groups; g++) {
        int32_t *idx = c->scatter.idx + (size_t)g * nst;
        uint32_t n_free, n_usable;
        if (resume && g == stop->g) {
            n_free = stop->n_free;      /* its search failed already */
            n_usable = stop->n_usable;
        } else if (kvc_stream_search(c, strm[g], nst, idx, &n_free, &n_usable)) {
            continue;
        }
        if (!evict) {
            *stop = (kvc_search_stop){ g, n_free, n_usable };
            return 0;
        }
        if (n_free != UINT32_MAX && c->reuse && c->reuse->n_ghost == 0) {
            /* the search saw every free cell: room made, the search again (over the words that
             * hold a free cell now, kvc_reuse_avail) only when it will find enough */
            uint32_t have = 0;
            (void)kvc_reuse_make_room_count(c, strm[g], nst, n_free, &have);
            if (have < nst || !kvc_stream_search(c, strm[g], nst, idx, &n_free, &n_usable)) {
                return 0;
            }
            continue;
        }
        do {
            if (!kvc_reuse_make_room(c, strm[g], nst, n_free, n_usable)) {
                return 0;
            }
        } while (!kvc_stream_search(c, strm[g], nst, idx, &n_free, &n_usable));
    }
    return 1;
}

/* Whether the groups from a stopped search's on find room in c, evicting from the prefix index
 * where they must (as kvc_search_2026 would), answered without evicting. */
static int kvc_room_possible_2026(kvc_unified *c, const uint32_t *strm, uint32_t n_groups, uint32_t nst,
                                  const kvc_search_stop *stop) {
    for (uint32_t g = stop->g; g < n_groups; g++) {
        uint32_t n_free = stop->n_free, n_usable = stop->n_usable;
        if ((g == stop->g ||
             !kvc_stream_search(c, strm[g], nst, c->scatter.idx + (size_t)g * nst, &n_free, &n_usable)) &&
            !kvc_reuse_room_possible(c, strm[g], nst, n_free, n_usable)) {
            return 0;
        }
    }
    return 1;
}

/* The apply half: the searched cells get the ubatch, and become the placement. */
static void kvc_place_2026(kvc_unified *c, const kvc_ubatch *ub, const uint32_t *strm, uint32_t n_groups,
                           uint32_t nst) {
    kvc_apply_2026(c, ub, c->scatter.idx, strm, n_groups, nst, false);
    memcpy(c->scatter.strm, strm, n_groups * sizeof *strm);
    c->scatter.n_groups = n_groups;
    c->scatter.n_seq_tokens = nst;
    c->slot.n = ub->n_tokens;
}

/* A placement over several caches as kvc_parts_room asks it: each cache's search, whose stop
 * an evicting search after the asking one goes on from. */
typedef struct slot_parts {
    kvc_unified *const *cs;
    uint32_t           (*strm)[KVC_MAX_SEQ];
    const uint32_t     *n_groups, *nst;
    kvc_search_stop     stop[KVC_STATE_MAX_PARTS];
    int                *found;
    bool                asked;
} slot_parts;

/* kvc_part_room_fn of cache k: found[k] whether it found room (asked: or can make it). */
static int part_slot(void *ctx, uint32_t k, bool evict) {
    slot_parts *p = ctx;
    kvc_unified *c = p->cs[k];
    if (evict) {
        p->found[k] = kvc_search_2026(c, p->strm[k], p->n_groups[k], p->nst[k], true, p->asked ? &p->stop[k] : NULL);
        return p->found[k] ? KVC_OK : KVC_E_STATE;
    }
    p->asked = true;
    if ((p->found[k] = kvc_search_2026(c, p->strm[k], p->n_groups[k], p->nst[k], false, &p->stop[k]))) {
        return KVC_OK;
    }
    p->found[k] = kvc_room_possible_2026(c, p->strm[k], p->n_groups[k], p->nst[k], &p->stop[k]);
    return p->found[k] ? KVC_ROOM_EVICTING : KVC_E_STATE;
}

/* find_slot over the caches cs (kvc_unified_find_slot_2026_parts); ask (one cache): evict
 * nothing, and answer KVC_ROOM_EVICTING when it must to make room. */
static int find_slot_parts(kvc_unified *const *cs, uint32_t n, const kvc_ubatch *ub, int *found, bool ask,
                           kvc_err *err) {
    uint32_t strm[KVC_STATE_MAX_PARTS][KVC_MAX_SEQ], n_groups[KVC_STATE_MAX_PARTS], nst[KVC_STATE_MAX_PARTS];
    if (n == 0 || n > KVC_STATE_MAX_PARTS) {
        return kvc_err_set(err, KVC_E_ARG, "find_slot: 1 to %d caches expected, got %u", KVC_STATE_MAX_PARTS, n);
    }
    /* the grouping of every cache is checked before anything changes */
    for (uint32_t k = 0; k < n; k++) {
        const int rc = kvc_unified_groups(cs[k], ub, strm[k], &n_groups[k], &nst[k], err);
        if (rc != KVC_OK) {
            return rc;
        }
    }
    /* every cache searches against its unchanged cells, then all are applied or none; with
     * several, a cache evicts from its prefix index only once every other has room or can make
     * it (a placement that fails evicts nothing) */
    slot_parts p = { cs, strm, n_groups, nst, { { 0, 0, 0 } }, found, false };
    uint32_t failed;
    const int rc = ask ? part_slot(&p, 0, false) : kvc_parts_room(n, part_slot, &p, &failed);
    if (rc != KVC_OK) {
        for (uint32_t k = 0; k < n; k++) {
            kvc_unified_slot_drop(cs[k]);
        }
        return rc == KVC_ROOM_EVICTING ? KVC_ROOM_EVICTING : 0;
    }
    for (uint32_t k = 0; k < n; k++) {
        kvc_place_2026(cs[k], ub, strm[k], n_groups[k], nst[k]);
    }
    return 1;
}

int kvc_unified_find_slot_2026(kvc_unified *c, const kvc_ubatch *ub, kvc_err *err) {
    int found[1];
    return find_slot_parts(&c, 1, ub, found, false, err);
}

int kvc_unified_find_slot_2026_ask(kvc_unified *c, const kvc_ubatch *ub, kvc_err *err) {
    int found[1];
    return find_slot_parts(&c, 1, ub, found, true, err);
}

int kvc_unified_find_slot_2026_parts(kvc_unified *const *cs, uint32_t n, const kvc_ubatch *ub, int *found,
                                     kvc_err *err) {
    return find_slot_parts(cs, n, ub, found, false, err);
}

int kvc_unified_search_2026(kvc_unified *c, const kvc_ubatch *ub, bool evict, int32_t *out, kvc_err *err) {
    uint32_t strm[KVC_MAX_SEQ], n_groups, nst;
    const int rc = kvc_unified_groups(c, ub, strm, &n_groups, &nst, err);
    if (rc != KVC_OK) {
        return rc;
    }
    kvc_search_stop stop;
    int found = kvc_search_2026(c, strm, n_groups, nst, evict, evict ? NULL : &stop);
    if (!found && !evict) {
        found = kvc_room_possible_2026(c, strm, n_groups, nst, &stop) ? KVC_ROOM_EVICTING : 0;
    }
    if (found == 1 && out) {
        memcpy(out, c->scatter.idx, (size_t)ub->n_tokens * sizeof *out);
    }
    kvc_unified_slot_drop(c);
    return found;
}

int kvc_unified_find_slot_2026_at(kvc_unified *c, const kvc_ubatch *ub, const int32_t *want, kvc_err *err) {
    uint32_t strm[KVC_MAX_SEQ], n_groups, nst;
    const int rc = kvc_unified_groups(c, ub, strm, &n_groups, &nst, err);
    if (rc != KVC_OK) {
        return rc;
    }
    kvc_search_stop stop;
    if (!kvc_search_2026(c, strm, n_groups, nst, false, &stop) ||
        memcmp(c->scatter.idx, want, (size_t)ub->n_tokens * sizeof *want) != 0) {
        kvc_unified_slot_drop(c);
        return 0;
    }
    kvc_place_2026(c, ub, strm, n_groups, nst);
    return 1;
}

int kvc_parts_room(uint32_t n, kvc_part_room_fn *room, void *ctx, uint32_t *failed) {
    bool must[KVC_STATE_MAX_PARTS];
    int rc = KVC_OK;
    *failed = 0;
    if (n > KVC_STATE_MAX_PARTS) {
        return KVC_E_ARG;
    }
    if (n == 1) {
        return room(ctx, 0, true);
    }
    /* every part answers (each for itself, as a composite's per-part results report), and the
     * last that has no room is the one named (its error is the one left) */
    for (uint32_t k = 0; k < n; k++) {
        const int r = room(ctx, k, false);
        must[k] = r == KVC_ROOM_EVICTING;
        if (r != KVC_OK && !must[k]) {
            rc = r;
            *failed = k;
        }
    }
    for (uint32_t k = 0; k < n && rc == KVC_OK; k++) {
        if (must[k]) {
            rc = room(ctx, k, true);
            *failed = k;
        }
    }
    return rc;
}

/* A dry run must leave the prefix index as it was (held cells, recency, locks, write-back
 * records), yet see the room the real placement's eviction would make, in the cells eviction
 * would free. Without a sliding window the index shows it (kvc_reuse_dry_make_room: the cells
 * the evictions would free, in the index's own eviction order, shown free until the end). With
 * one, whose placements may overwrite held cells (which the index then forgets, changing what a
 * later eviction takes), the dry run evicts as placement does, from a copy of the index put in
 * the cache's place (*own keeps the cache's own until the end): exact by construction. The copy
 * costs O(index) once, and only in a dry run that evicts (or, in window mode, overwrites a held
 * cell). */
static bool dry_reuse_copy(kvc_unified *c, kvc_reuse **own) {
    kvc_reuse *copy = kvc_reuse_copy(c);
    if (copy) {
        *own = c->reuse;
        c->reuse = copy;
    }
    return copy != NULL;
}

/* kvc_reuse_make_room for the dry run: 1 evicted (search again), 0 not, KVC_E_NOMEM (no memory
 * for the copy). The copy is made only when eviction can make the room (make_room evicts nothing
 * otherwise). */
static int dry_make_room(kvc_unified *c, kvc_reuse **own, uint32_t st, uint32_t n, uint32_t n_free,
                         uint32_t n_usable) {
    if (!*own) {
        if (!kvc_reuse_room_possible(c, st, n, n_free, n_usable)) {   /* (false when reuse is off) */
            return 0;
        }
        if (!dry_reuse_copy(c, own)) {
            return KVC_E_NOMEM;
        }
    }
    return kvc_reuse_make_room(c, st, n, n_free, n_usable) ? 1 : 0;
}

/* Whether placing the searched cells idx overwrites a cell the prefix index holds (window mode:
 * the index then keeps the token as a ghost, or forgets the prompt from there, which later
 * evictions see), so that the dry run needs its copy of the index for the placement. */
static bool dry_overwrites_held(const kvc_unified *c, const int32_t *idx, const uint32_t *strm, uint32_t ng,
                                uint32_t nst) {
    for (uint32_t g = 0; c->reuse && c->reuse->n_ghost && g < ng; g++) {
        for (uint32_t i = 0; i < nst; i++) {
            if (kvc_reuse_is_held(c, strm[g], (uint32_t)idx[g * nst + i])) {
                return true;
            }
        }
    }
    return false;
}

/* What placing ubatch ub in the searched cells idx (ng groups of nst, group g in stream strm[g])
 * changes, into the streams' undos: those cells, the cells and entries of every sequence holding a
 * cell it overwrites (a sliding window's: it loses its positions up to the cell's), and the
 * entries of the ubatch's sequences. KVC_OK or KVC_E_NOMEM. */
static int dry_save(kvc_unified *c, kvc_cells_undo *saved, const kvc_ubatch *ub, const int32_t *idx,
                    const uint32_t *strm, uint32_t ng, uint32_t nst) {
    int rc = KVC_OK;
    for (uint32_t g = 0; g < ng && rc == KVC_OK; g++) {
        const kvc_cells *cells = kvc_unified_stream_cells_c(c, strm[g]);
        rc = kvc_cells_undo_cells(&saved[strm[g]], cells, idx + (size_t)g * nst, nst);
        for (uint32_t i = 0; i < nst && rc == KVC_OK; i++) {
            const uint32_t cell = (uint32_t)idx[(size_t)g * nst + i];
            for (int32_t q = kvc_cells_seq_next(cells, cell, -1); q >= 0 && rc == KVC_OK;
                 q = kvc_cells_seq_next(cells, cell, q)) {
                rc = kvc_cells_undo_seq(&saved[strm[g]], cells, q);
            }
        }
    }
    /* the ubatch's sequences gain entries from their first position in it on */
    int32_t p_min[KVC_MAX_SEQ];
    for (uint32_t q = 0; q < c->n_seq_max; q++) {
        p_min[q] = INT32_MAX;
    }
    for (uint32_t g = 0; g < ub->n_seqs; g++) {
        for (uint32_t t = g * ub->n_seq_tokens; t < (g + 1) * ub->n_seq_tokens; t++) {
            for (uint32_t j = ub->seq_off[g]; j < ub->seq_off[g + 1]; j++) {
                p_min[ub->seq_ids[j]] = ub->pos[t] < p_min[ub->seq_ids[j]] ? ub->pos[t] : p_min[ub->seq_ids[j]];
            }
        }
    }
    for (uint32_t q = 0; q < c->n_seq_max && rc == KVC_OK; q++) {
        if (p_min[q] != INT32_MAX) {
            const uint32_t st = kvc_unified_stream_of(c, (int32_t)q);
            rc = kvc_cells_undo_seq_grows(&saved[st], kvc_unified_stream_cells_c(c, st), (int32_t)q, p_min[q]);
        }
    }
    return rc;
}

int kvc_unified_prepare_2026(kvc_unified *c, const kvc_ubatch *ubs, uint32_t n_ub, int32_t *out_cells,
                             uint32_t *out_strm, uint32_t *out_groups, kvc_err *err) {
    uint32_t nst_of[1];
    if (n_ub == 0) {
        return kvc_err_set(err, KVC_E_ARG, "prepare needs at least one ubatch");
    }
    /* every ubatch is checked before anything changes */
    for (uint32_t u = 0; u < n_ub; u++) {
        const int rc = kvc_unified_groups(c, &ubs[u], out_strm + (size_t)u * c->n_stream, &out_groups[u], nst_of, err);
        if (rc != KVC_OK) {
            return rc;
        }
    }
    /* the state to come back to: the head of every stream a ubatch goes to, and what each
     * placement changes there (a placement and the purge it causes change only the streams of its
     * groups): its cells, and the cells and entries of the sequences it places or overwrites */
    kvc_cells_undo *saved = kvc_calloc(c->n_stream, sizeof *saved);
    uint32_t *heads = kvc_malloc_n(c->n_stream, sizeof *heads);
    bool *touched = kvc_calloc(c->n_stream, sizeof *touched);
    bool ok = saved && heads && touched;
    for (uint32_t u = 0; ok && u < n_ub; u++) {
        for (uint32_t g = 0; g < out_groups[u]; g++) {
            touched[out_strm[(size_t)u * c->n_stream + g]] = true;
        }
    }
    for (uint32_t s = 0; ok && s < c->n_stream; s++) {
        if (touched[s]) {
            ok = kvc_cells_undo_init(&saved[s], kvc_unified_stream_cells(c, s)) == KVC_OK;
            heads[s] = kvc_unified_stream_head_c(c, s);
        }
    }
    int placed = 1;
    kvc_reuse *own = NULL;   /* the cache's prefix reuse while the dry run has a copy in its place */
    /* where the cache's own index can show the room its evictions would make, no copy of it */
    const bool shows = kvc_reuse_dry_exact(c);
    kvc_reuse_dry shown;
    kvc_reuse_dry_begin(&shown);
    if (ok) {
        size_t off = 0;
        for (uint32_t u = 0; u < n_ub && placed == 1; u++) {
            const uint32_t *strm = out_strm + (size_t)u * c->n_stream, ng = out_groups[u];
            const uint32_t nst = ubs[u].n_tokens / ng;
            for (uint32_t g = 0; g < ng && placed == 1; g++) {
                uint32_t n_free, n_usable;
                int room = 1;
                while (!(placed = kvc_stream_search(c, strm[g], nst, out_cells + off + (size_t)g * nst, &n_free,
                                                    &n_usable)) &&
                       (room = shows ? kvc_reuse_dry_make_room(c, &shown, strm[g], nst, n_free, n_usable)
                                     : dry_make_room(c, &own, strm[g], nst, n_free, n_usable)) == 1) {
                }
                placed = room < 0 ? room : placed;
            }
            if (placed == 1 && !own && dry_overwrites_held(c, out_cells + off, strm, ng, nst) &&
                !dry_reuse_copy(c, &own)) {
                placed = KVC_E_NOMEM;
            }
            if (placed == 1 && dry_save(c, saved, &ubs[u], out_cells + off, strm, ng, nst) != KVC_OK) {
                placed = KVC_E_NOMEM;
            }
            if (placed == 1) {
                /* on a copy, the index's part of the placement too */
                kvc_apply_2026(c, &ubs[u], out_cells + off, strm, ng, nst, own == NULL);
                off += ubs[u].n_tokens;
            }
        }
        ok = placed >= 0;
        placed = placed > 0;
        if (own) {
            kvc_reuse_free(c->reuse);
            c->reuse = own;
        }
        if (shows) {
            kvc_reuse_dry_end(c, &shown);
        }
        for (uint32_t s = 0; s < c->n_stream; s++) {
            if (touched[s]) {
                kvc_cells_undo_apply(kvc_unified_stream_cells(c, s), &saved[s]);
                *kvc_unified_stream_head(c, s) = heads[s];
            }
        }
    }
    if (saved) {
        for (uint32_t s = 0; s < c->n_stream; s++) {
            kvc_cells_undo_free(&saved[s]);   /* one never begun is zeroed: frees nothing */
        }
    }
    kvc_free(saved);
    kvc_free(heads);
    kvc_free(touched);
    if (!ok) {
        return kvc_err_set(err, KVC_E_NOMEM, "out of memory saving the cache for prepare");
    }
    return placed;
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

/* The rows of the placed tokens in scattered cells of their streams (2026). */
void kvc_unified_store_scattered(kvc_unified *c, const kvc_layer *ly, uint32_t n_tokens, const uint8_t *k,
                                 const uint8_t *v) {
    const size_t size = c->cells.size;
    const size_t el = kvc_type_get(c->type_v)->type_size;
    for (uint32_t t = 0; t < n_tokens; t++) {
        const size_t st = kvc_unified_slot_stream(c, t), cell = kvc_unified_slot_cell(c, t);
        const size_t row = st * size + cell;
        if (k && ly->k) {
            memcpy(ly->k + row * ly->k_row_bytes, k + (size_t)t * ly->k_row_bytes, ly->k_row_bytes);
        }
        if (!v || !ly->v) {
            continue;
        }
        if (!c->v_trans) {
            memcpy(ly->v + row * ly->v_row_bytes, v + (size_t)t * ly->v_row_bytes, ly->v_row_bytes);
            continue;
        }
        /* transposed per stream: element e of the token to row e of its stream's block, column cell */
        uint8_t *dst = ly->v + (st * size * ly->n_embd_v + cell) * el;
        const uint8_t *src = v + (size_t)t * ly->n_embd_v * el;
        for (uint32_t e = 0; e < ly->n_embd_v; e++) {
            memcpy(dst + (size_t)e * size * el, src + (size_t)e * el, el);
        }
    }
}

int kvc_unified_store(kvc_unified *c, uint32_t ikv, uint32_t n_tokens, const void *k, const void *v) {
    if (c->slot.n == 0 || n_tokens != c->slot.n || ikv >= c->n_layer) {
        return KVC_E_ARG;
    }
    kvc_unified_defrag_settle(c);
    c->ops->store(c, &c->layers[ikv], n_tokens, k, v);
    return KVC_OK;
}

/* The placement is a run of cells: the rows go in at once. */
void kvc_unified_store_run(kvc_unified *c, const kvc_layer *ly, uint32_t n_tokens, const uint8_t *k,
                           const uint8_t *v) {
    const size_t head = kvc_unified_slot_cell(c, 0), size = c->cells.size;
    if (k && ly->k) {
        memcpy(ly->k + head * ly->k_row_bytes, k, n_tokens * ly->k_row_bytes);
    }
    if (!v || !ly->v) {
        return;
    }
    if (!c->v_trans) {
        memcpy(ly->v + head * ly->v_row_bytes, v, n_tokens * ly->v_row_bytes);
        return;
    }
    /* transposed: element e of token t goes to row e, column head + t */
    const size_t el = kvc_type_get(c->type_v)->type_size;
    for (uint32_t e = 0; e < ly->n_embd_v; e++) {
        uint8_t *dst = ly->v + ((size_t)e * size + head) * el;
        for (uint32_t t = 0; t < n_tokens; t++) {
            memcpy(dst + (size_t)t * el, v + ((size_t)t * ly->n_embd_v + e) * el, el);
        }
    }
}

/* --- snapshots ------------------------------------------------------------------------- */

int kvc_unified_snapshot_take(const kvc_unified *c, kvc_unified_snapshot *s) {
    memset(s, 0, sizeof *s);
    if (kvc_cells_snapshot(&s->cells, &c->cells) != KVC_OK) {
        return KVC_E_NOMEM;
    }
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
    s->undo.cap_spans = u->n_spans;
    s->undo.cap_cells = u->n_cells;
    kvc_unified_snapshot_scalars(c, s);
    return KVC_OK;
}

void kvc_unified_snapshot_scalars(const kvc_unified *c, kvc_unified_snapshot *s) {
    s->head = c->head;
    s->n = c->n;
    s->slot = c->slot;
    s->undo.n_spans = c->undo.n_spans;
    s->undo.n_cells = c->undo.n_cells;
    s->do_defrag = c->do_defrag;
    s->defrag_pending = c->defrag_pending;
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
