/* kvcache — prefix reuse, the requests' side (kvc_retain.h). */
#include "kvc_retain.h"

#include <string.h>

#include "kvc_unified.h"

static int reuse_off(kvc_err *err) {
    return kvc_err_set(err, KVC_E_ARG, "prefix reuse is off for this cache (enable_prefix_reuse() turns it on)");
}

int kvc_retain_release(kvc_unified *c, int32_t s, uint64_t salt, const int32_t *tokens, uint32_t n,
                       kvc_retained *res, kvc_err *err) {
    kvc_reuse *r = c->reuse;
    memset(res, 0, sizeof *res);
    if (!r) {
        return reuse_off(err);
    }
    const uint32_t st = kvc_unified_stream_of(c, s), size = c->cells.size;
    const kvc_cells *cells = kvc_unified_stream_cells_c(c, st);
    const kvc_seq_pos *sp = &cells->seq_pos[s];
    const int32_t *tok_of = r->tok + (size_t)st * size;
    const uint64_t *born = r->born + (size_t)st * size;
    /* the cells of positions 0, 1, ... (the first cell of each), unshifted, with a known token
     * that agrees with the caller's */
    const uint32_t m = sp->n ? sp->n : 1;
    int32_t *toks = kvc_malloc_n(m, 3 * sizeof *toks);
    if (!toks) {
        return kvc_err_set(err, KVC_E_NOMEM, "out of memory releasing sequence %d", s);
    }
    uint32_t *dup_cells = (uint32_t *)(toks + m), *dup_strms = dup_cells + m;
    uint32_t k = 0;
    for (uint32_t e = 0; e < sp->n; e++) {
        const int32_t p = kvc_seq_key_pos(sp->key[e]);
        const uint32_t i = kvc_seq_key_cell(sp->key[e]);
        if (p < (int32_t)k) {
            continue;   /* a second cell at a position already taken */
        }
        /* the K/V of a token depend on every token before it: a cell counts only when computed
         * no earlier than the cell before it and never moved since */
        if (p != (int32_t)k || (tokens && k >= n) || cells->shift[i] != 0 || born[i] == KVC_REUSE_MOVED ||
            (k > 0 && born[i] < born[r->tmp_cell[k - 1]])) {
            break;
        }
        int32_t t = tok_of[i];
        if (t == KVC_TOKEN_NULL) {
            if (!tokens) {
                break;
            }
            t = tokens[k];
        } else if (tokens && tokens[k] != t) {
            break;
        }
        toks[k] = t;
        r->tmp_cell[k] = i;
        r->tmp_strm[k] = st;
        k++;
    }
    /* K/V depend on every token before: a cell the index holds serves this prompt only inside
     * the prefix the index holds of it (there it is the index's own cell or a duplicate); past
     * that prefix, a held cell belongs to another prompt and ends what can be kept */
    if (k > 0) {
        kvc_prefix_handle end;
        const uint32_t held = kvc_prefix_match(&r->idx, salt, toks, k, k, dup_cells, dup_strms, &end);
        for (uint32_t j = 0; j < k; j++) {
            const uint32_t i = r->tmp_cell[j];
            if (kvc_reuse_is_held(c, st, i) && (j >= held || dup_cells[j] != i || dup_strms[j] != st)) {
                k = j;
                break;
            }
        }
    }
    int rc = KVC_OK;
    if (k > 0) {
        kvc_prefix_inserted ins;
        rc = kvc_prefix_insert(&r->idx, salt, toks, r->tmp_cell, r->tmp_strm, k, dup_cells, dup_strms, &ins, err);
        if (rc == KVC_OK) {
            kvc_reuse_note_insert(c, r->tmp_cell, r->tmp_strm, ins.n_present, k);
            res->n_kept = k;
            res->n_new = ins.n_added;
            res->n_evicted = ins.n_evicted;
        } else if (rc == KVC_E_NOSPACE) {
            rc = KVC_OK;   /* nothing kept: said by n_kept 0 */
        }
    }
    kvc_free(toks);
    if (rc != KVC_OK) {
        return rc;
    }
    kvc_unified_seq_rm(c, s, -1, -1);   /* releases its lock (kvc_reuse_sync) */
    return KVC_OK;
}

uint32_t kvc_retain_match(kvc_unified *c, uint64_t salt, const int32_t *tokens, uint32_t n) {
    if (!c->reuse || n < 2) {
        return 0;
    }
    kvc_prefix_handle end;
    return kvc_prefix_match(&c->reuse->idx, salt, tokens, n, n - 1, NULL, NULL, &end);
}

int kvc_retain_attach(kvc_unified *c, int32_t s, uint64_t salt, const int32_t *tokens, uint32_t n,
                      uint32_t *n_attached, kvc_err *err) {
    kvc_reuse *r = c->reuse;
    *n_attached = 0;
    if (!r) {
        return reuse_off(err);
    }
    if (kvc_unified_seq_pos_max(c, s) >= 0) {
        return kvc_err_set(err, KVC_E_ARG, "sequence %d is not empty: a prefix attaches to a new sequence "
                           "(seq_rm(%d) first)", s, s);
    }
    if (n < 2) {
        return KVC_OK;
    }
    kvc_prefix_handle end;
    uint32_t p = kvc_prefix_match(&r->idx, salt, tokens, n, n - 1, r->tmp_cell, r->tmp_strm, &end);
    if (p == 0) {
        return KVC_OK;
    }
    /* the cells must come from one stream: the run in the stream of the first */
    const uint32_t src = r->tmp_strm[0], st = kvc_unified_stream_of(c, s);
    for (uint32_t i = 1; i < p; i++) {
        if (r->tmp_strm[i] != src) {
            p = i;
            break;
        }
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
    for (uint32_t i = 0; i < p; i++) {
        const uint32_t cell = r->tmp_cell[i];
        if (kvc_cells_is_empty(cells, cell)) {
            kvc_cells_pos_set(cells, cell, (int32_t)i);
        }
        kvc_cells_seq_add(cells, cell, s);
        if (src != st) {
            kvc_reuse_copy_cells(c, src, st, cell);
        }
    }
    if (src != st) {
        /* forgetting the stream may have dropped the node the match ended in (a prompt whose
         * later tokens lay in this stream): lock where the p tokens taken end now */
        (void)kvc_prefix_match(&r->idx, salt, tokens, n, p, NULL, NULL, &end);
    }
    if (kvc_prefix_lock(&r->idx, end, NULL) == KVC_OK) {
        r->lock[s] = end;
    }
    *n_attached = p;
    return KVC_OK;
}

int kvc_retain_pin(kvc_unified *c, uint64_t salt, const int32_t *tokens, uint32_t n, kvc_prefix_handle *pin,
                   kvc_err *err) {
    memset(pin, 0, sizeof *pin);
    if (!c->reuse) {
        return reuse_off(err);
    }
    kvc_prefix_handle end;
    const uint32_t p = n ? kvc_prefix_match(&c->reuse->idx, salt, tokens, n, n, NULL, NULL, &end) : 0;
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

int kvc_retain_unpin(kvc_unified *c, kvc_prefix_handle pin, kvc_err *err) {
    if (!c->reuse) {
        return reuse_off(err);
    }
    if (pin.node == 0 || !kvc_prefix_handle_valid(&c->reuse->idx, pin) || c->reuse->idx.nodes[pin.node].n_pin == 0) {
        return kvc_err_set(err, KVC_E_ARG, "not a pin of this cache's prefix index (unpinned already, or its "
                           "prefix was dropped)");
    }
    return kvc_prefix_unpin(&c->reuse->idx, pin, err);
}

/* --- composite caches -------------------------------------------------------------------- */

int kvc_retain_enable_parts(kvc_unified *const *cs, uint32_t n_parts, uint32_t cap, kvc_err *err) {
    bool was_on[8];
    if (n_parts > 8) {
        return kvc_err_set(err, KVC_E_ARG, "at most 8 parts, got %u", n_parts);
    }
    for (uint32_t k = 0; k < n_parts; k++) {
        was_on[k] = cs[k]->reuse != NULL;
        const int rc = kvc_reuse_enable(cs[k], cap, err);
        if (rc != KVC_OK) {
            for (uint32_t j = 0; j < k; j++) {
                if (!was_on[j]) {
                    kvc_reuse_disable(cs[j]);
                }
            }
            return rc;
        }
    }
    return KVC_OK;
}

uint32_t kvc_retain_match_parts(kvc_unified *const *cs, uint32_t n_parts, uint64_t salt, const int32_t *tokens,
                                uint32_t n) {
    uint32_t p = n;
    for (uint32_t k = 0; k < n_parts; k++) {
        const uint32_t q = kvc_retain_match(cs[k], salt, tokens, n);
        p = q < p ? q : p;
    }
    return n_parts ? p : 0;
}

int kvc_retain_attach_parts(kvc_unified *const *cs, uint32_t n_parts, int32_t s, uint64_t salt,
                            const int32_t *tokens, uint32_t n, uint32_t *n_attached, kvc_err *err) {
    *n_attached = 0;
    for (uint32_t k = 0; k < n_parts; k++) {
        if (!cs[k]->reuse) {
            return reuse_off(err);
        }
        if (kvc_unified_seq_pos_max(cs[k], s) >= 0) {
            return kvc_err_set(err, KVC_E_ARG, "sequence %d is not empty: a prefix attaches to a new sequence "
                               "(seq_rm(%d) first)", s, s);
        }
    }
    const uint32_t p = kvc_retain_match_parts(cs, n_parts, salt, tokens, n);
    if (p == 0) {
        return KVC_OK;
    }
    /* every part holds p tokens: attaching p + 1 tokens' prefix takes exactly p in each */
    for (uint32_t k = 0; k < n_parts; k++) {
        uint32_t got = 0;
        const int rc = kvc_retain_attach(cs[k], s, salt, tokens, p + 1, &got, err);
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

int kvc_retain_release_parts(kvc_unified *const *cs, uint32_t n_parts, int32_t s, uint64_t salt,
                             const int32_t *tokens, uint32_t n, kvc_retained *res, kvc_err *err) {
    memset(res, 0, sizeof *res);
    res->n_kept = UINT32_MAX;
    for (uint32_t k = 0; k < n_parts; k++) {
        kvc_retained one;
        const int rc = kvc_retain_release(cs[k], s, salt, tokens, n, &one, err);
        if (rc != KVC_OK) {
            res->n_kept = 0;
            return rc;
        }
        res->n_kept = one.n_kept < res->n_kept ? one.n_kept : res->n_kept;
        res->n_new += one.n_new;
        res->n_evicted += one.n_evicted;
    }
    if (res->n_kept == UINT32_MAX) {
        res->n_kept = 0;
    }
    return KVC_OK;
}
