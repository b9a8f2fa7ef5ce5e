/* kvcache — attention indices (kvc_attn.h): each run of a ubatch's tokens of one sequence takes
 * the cells of its sequence's index (kvc_cells.seq_pos, ordered by position) that its windows
 * cover, and is written as one group when a kernel's rule reproduces its mask, else token by
 * token. The visible set of a token is the KQ mask's (kvc_mask.c): the cells of its first
 * sequence id in its window (kvc_unified_visible_range), below the mask's n_kv, less the cells
 * the 2-D rule hides. */
#include "kvc_attn.h"
#include "kvc_mask.h"
#include "kvc_slot.h"
#include "kvc_common.h"

#include <string.h>

/* Where the next group and index go, and the room there is. */
typedef struct kvc_attn_writer {
    kvc_attn *a;
    bool      room;        /* every group and index so far fits the caller's arrays */
    uint64_t  n_groups, nnz;
    uint64_t  span;        /* the largest row written + 1 */
    uint64_t *scratch;     /* a run's index entries below n_kv */
    uint32_t  cap_scratch;
} kvc_attn_writer;

static void kvc_attn_group(kvc_attn_writer *w, uint32_t t0, bool causal, uint32_t stream) {
    kvc_attn *a = w->a;
    if (w->room && w->n_groups < a->cap_groups) {
        a->qo_indptr[w->n_groups] = (int32_t)t0;
        a->kv_indptr[w->n_groups] = (int32_t)w->nnz;
        a->causal[w->n_groups] = (uint8_t)causal;
        if (a->stream) {
            a->stream[w->n_groups] = (int32_t)stream;
        }
    } else {
        w->room = false;
    }
    w->n_groups++;
}

/* Row `row` at position pos joins the current group. */
static inline void kvc_attn_entry(kvc_attn_writer *w, uint64_t row, int32_t pos) {
    kvc_attn *a = w->a;
    if (w->room && w->nnz < a->cap_nnz) {
        a->kv_indices[w->nnz] = (int32_t)row;
        if (a->kv_pos) {
            a->kv_pos[w->nnz] = pos;
        }
    } else {
        w->room = false;
    }
    w->nnz++;
    w->span = row + 1 > w->span ? row + 1 : w->span;
}

/* The rows of key[0, n) whose cells are below n_kv join the current group. With room for all of
 * them (a decode step's whole cost): every row written by a loop the compiler vectorizes, which
 * also finds the largest cell; only when that one is at or past n_kv are the rows compacted. */
static void kvc_attn_entries(kvc_attn_writer *w, const uint64_t *key, uint32_t n, uint64_t base, uint32_t n_kv) {
    kvc_attn *a = w->a;
    if (n == 0) {
        return;
    }
    if (!w->room || w->nnz + n > a->cap_nnz) {
        for (uint32_t k = 0; k < n; k++) {
            const uint32_t cell = kvc_seq_key_cell(key[k]);
            if (cell < n_kv) {
                kvc_attn_entry(w, base + cell, kvc_seq_key_pos(key[k]));
            }
        }
        return;
    }
    int32_t *rows = a->kv_indices + w->nnz;
    int32_t *pos = a->kv_pos ? a->kv_pos + w->nnz : NULL;
    /* rows are int32 (the call refuses more): the base is added modulo 2^32 as the cast would */
    const uint32_t base32 = (uint32_t)base;
    uint32_t top = 0;
    for (uint32_t k = 0; k < n; k++) {
        const uint32_t cell = kvc_seq_key_cell(key[k]);
        rows[k] = (int32_t)(base32 + cell);
        top = cell > top ? cell : top;
    }
    uint32_t m = n;
    if (top < n_kv) {
        for (uint32_t k = 0; pos && k < n; k++) {
            pos[k] = kvc_seq_key_pos(key[k]);
        }
    } else {
        /* each entry is written, and kept when its cell is below n_kv: m <= k < n stays in the room */
        m = 0;
        top = 0;
        for (uint32_t k = 0; k < n; k++) {
            const uint32_t cell = kvc_seq_key_cell(key[k]);
            const bool keep = cell < n_kv;
            rows[m] = (int32_t)(base32 + cell);
            if (pos) {
                pos[m] = kvc_seq_key_pos(key[k]);
            }
            top = keep && cell > top ? cell : top;
            m += keep;
        }
    }
    w->nnz += m;
    if (m) {
        w->span = base + top + 1 > w->span ? base + top + 1 : w->span;
    }
}

/* The first of keys[0, n) at position p or later. */
static uint32_t kvc_attn_lower(const uint64_t *keys, uint32_t n, int32_t p) {
    const uint64_t k = kvc_seq_key(p, 0);
    uint32_t lo = 0, hi = n;
    while (lo < hi) {
        const uint32_t mid = lo + (hi - lo) / 2;
        if (keys[mid] < k) {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    return lo;
}

/* The first of keys[0, n) after position p. */
static uint32_t kvc_attn_upper(const uint64_t *keys, uint32_t n, int32_t p) {
    return p == INT32_MAX ? n : kvc_attn_lower(keys, n, p + 1);
}

/* Whether the 2-D rule hides from token t the cell of key (a cell of its sequence at its own
 * position whose 2-D position is after the token's). */
static inline bool kvc_attn_hidden_2d(const kvc_cells *cells, const kvc_ubatch *ub, uint32_t t, uint64_t key) {
    return kvc_seq_key_pos(key) == ub->pos[t] &&
           kvc_cell_ext_2d_gt(&cells->ext[kvc_seq_key_cell(key)], ub->pos_x[t], ub->pos_y[t]);
}

/* Tokens [t0, t1) of sequence s in stream st: one group or one per token. */
static int kvc_attn_run(kvc_attn_writer *w, const kvc_unified *c, const kvc_ubatch *ub, uint32_t t0, uint32_t t1,
                        int32_t s, uint32_t st, bool causal) {
    const kvc_cells *cells = kvc_unified_stream_cells_c(c, st);
    const uint64_t base = (uint64_t)st * cells->size;
    const uint32_t n_kv = w->a->n_kv, q = t1 - t0;
    /* the mask applies the 2-D rule to causal rows of cells with the extension (only today's
     * cache type has it) */
    const bool two_d = causal && kvc_ubatch_is_2d(ub) && cells->ext;
    int32_t lo_all = INT32_MAX, hi_all = 0;
    for (uint32_t t = t0; t < t1; t++) {
        int32_t lo, hi;
        kvc_unified_visible_range(c, ub->pos[t], causal, &lo, &hi);
        lo_all = lo < lo_all ? lo : lo_all;
        hi_all = hi > hi_all ? hi : hi_all;
    }
    uint32_t a, e;
    const kvc_pos_range window = { lo_all, (int64_t)hi_all + 1 };
    kvc_cells_seq_pos_span(cells, s, window, &a, &e);
    const uint64_t *key = cells->seq_pos[s].key;
    if (q == 1 && !two_d) {
        /* a token alone sees its whole window: the decode step of many sequences */
        kvc_attn_group(w, t0, false, st);
        kvc_attn_entries(w, key + a, e - a, base, n_kv);
        return KVC_OK;
    }
    /* the run's entries below n_kv, for the tokens' windows to be found among them */
    if (w->cap_scratch < e - a) {
        uint64_t *p = kvc_realloc_n(w->scratch, e - a, sizeof *p);
        if (!p) {
            return KVC_E_NOMEM;
        }
        w->scratch = p;
        w->cap_scratch = e - a;
    }
    uint64_t *keys = w->scratch;
    uint32_t n = 0;
    for (uint32_t k = a; k < e; k++) {
        if (kvc_seq_key_cell(key[k]) < n_kv) {
            keys[n++] = key[k];
        }
    }
    /* exact: token i sees entries [0, n - q + i] (a kernel's causal rule); full: it sees all */
    bool exact = causal && q > 1, full = true;
    for (uint32_t i = 0; i < q && (exact || full); i++) {
        const uint32_t t = t0 + i;
        int32_t lo, hi;
        kvc_unified_visible_range(c, ub->pos[t], causal, &lo, &hi);
        const uint32_t ai = kvc_attn_lower(keys, n, lo), ei = kvc_attn_upper(keys, n, hi);
        bool hides = false;
        for (uint32_t k = ei; two_d && !hides && k > ai && kvc_seq_key_pos(keys[k - 1]) == ub->pos[t]; k--) {
            hides = kvc_attn_hidden_2d(cells, ub, t, keys[k - 1]);
        }
        if (ai != 0 || hides) {
            exact = full = false;
        }
        exact = exact && (int64_t)ei == (int64_t)n - q + i + 1;
        full = full && ei == n;
    }
    if (exact || (full && !(causal && q > 1))) {
        kvc_attn_group(w, t0, exact, st);
        kvc_attn_entries(w, keys, n, base, n_kv);
        return KVC_OK;
    }
    for (uint32_t t = t0; t < t1; t++) {
        int32_t lo, hi;
        kvc_unified_visible_range(c, ub->pos[t], causal, &lo, &hi);
        kvc_attn_group(w, t, false, st);
        for (uint32_t k = kvc_attn_lower(keys, n, lo), ei = kvc_attn_upper(keys, n, hi); k < ei; k++) {
            if (!(two_d && kvc_attn_hidden_2d(cells, ub, t, keys[k]))) {
                kvc_attn_entry(w, base + kvc_seq_key_cell(keys[k]), kvc_seq_key_pos(keys[k]));
            }
        }
    }
    return KVC_OK;
}

/* KVC_OK when ub is the cache's current placement, else KVC_E_ARG with err. */
static int kvc_attn_check_placed(const kvc_unified *c, const kvc_ubatch *ub, kvc_err *err) {
    if (kvc_unified_slot_n(c) != ub->n_tokens) {
        return kvc_err_set(err, KVC_E_ARG, "the ubatch (%u tokens) is not the one last placed in this cache "
                           "(%u tokens placed; find_slot places a ubatch and a sequence operation forgets it)",
                           ub->n_tokens, kvc_unified_slot_n(c));
    }
    for (uint32_t t = 0; t < ub->n_tokens; t++) {
        const kvc_cells *cells = kvc_unified_stream_cells_c(c, kvc_unified_slot_stream(c, t));
        const uint32_t cell = kvc_unified_slot_cell(c, t);
        if (cells->pos[cell] != ub->pos[t] || !kvc_cells_seq_has(cells, cell, kvc_ubatch_first_id(ub, t))) {
            return kvc_err_set(err, KVC_E_ARG, "the ubatch is not the one last placed in this cache (token %u, "
                               "sequence %d at position %d, is not in cell %u)", t, kvc_ubatch_first_id(ub, t),
                               ub->pos[t], cell);
        }
    }
    return KVC_OK;
}

int kvc_unified_attn_indices(const kvc_unified *c, const kvc_ubatch *ub, bool causal, kvc_attn *out, kvc_err *err) {
    uint32_t strm[KVC_MAX_SEQ], n_groups, nst;
    int rc = c->ops->kv_groups(c, ub, strm, &n_groups, &nst, &out->n_kv, err);
    if (rc != KVC_OK) {
        return rc;
    }
    rc = kvc_attn_check_placed(c, ub, err);
    if (rc != KVC_OK) {
        return rc;
    }
    kvc_attn_writer w = { .a = out, .room = out->qo_indptr && out->kv_indptr && out->kv_indices && out->causal };
    for (uint32_t t0 = 0, t1; t0 < ub->n_tokens && rc == KVC_OK; t0 = t1) {
        const int32_t s = kvc_ubatch_first_id(ub, t0);
        const uint32_t st = strm[t0 / nst];
        for (t1 = t0 + 1; t1 < ub->n_tokens && kvc_ubatch_first_id(ub, t1) == s && strm[t1 / nst] == st; t1++) {
        }
        rc = kvc_attn_run(&w, c, ub, t0, t1, s, st, causal);
    }
    kvc_free(w.scratch);
    if (rc != KVC_OK) {
        return kvc_err_set(err, rc, "out of memory building the attention indices");
    }
    if (w.nnz > INT32_MAX) {
        return kvc_err_set(err, KVC_E_ARG, "the attention indices would have %llu entries, more than int32 holds",
                           (unsigned long long)w.nnz);
    }
    out->n_groups = (uint32_t)w.n_groups;
    out->nnz = (uint32_t)w.nnz;
    out->span = (uint32_t)w.span;
    if (!w.room || out->cap_groups < w.n_groups || (out->q_pos && out->cap_tokens < ub->n_tokens)) {
        return KVC_E_NOSPACE;
    }
    if (out->q_pos) {
        memcpy(out->q_pos, ub->pos, (size_t)ub->n_tokens * sizeof *out->q_pos);
    }
    /* the closing bounds */
    out->qo_indptr[w.n_groups] = (int32_t)ub->n_tokens;
    out->kv_indptr[w.n_groups] = (int32_t)w.nnz;
    return KVC_OK;
}
