#include "kvc_hybrid_prefix.h"

#include <stdlib.h>
#include <string.h>

/* The attention part's caches: the unified cache, or the iSWA pair's base then SWA cache. */
static uint32_t attn_parts(const kvc_hybrid *h, kvc_unified *parts[2]) {
    parts[0] = h->attn;
    if (h->iswa) {
        parts[1] = h->iswa->swa;
        return 2;
    }
    return 1;
}

/* The deepest checkpoint of at most a tokens of tokens[0 .. n) the attention part also serves
 * (-1: none). An iSWA pair whose SWA cache keeps only windows serves a shorter hit only where it
 * holds the window before it, and a cache with a stream per sequence only the run of one stream,
 * so each candidate is asked in turn. */
static int32_t hit_upto(kvc_hybrid *h, kvc_ckpt_pool *p, uint64_t salt, const int32_t *tokens, uint32_t n,
                        uint32_t a) {
    kvc_unified *parts[2];
    const uint32_t k = attn_parts(h, parts);
    while (a) {
        const int32_t slot = kvc_ckpt_find(p, salt, tokens, n, a);
        if (slot < 0 || (!h->iswa && h->attn->n_stream == 1)) {
            return slot;
        }
        const uint32_t len = p->n_tok[slot];
        if (kvc_retain_serves_parts(parts, k, salt, tokens, n, len)) {
            return slot;
        }
        a = len - 1;
    }
    return -1;
}

/* The deepest checkpoint the attention part also serves, for a request of n tokens (-1: none). */
static int32_t hyb_hit(kvc_hybrid *h, kvc_ckpt_pool *p, uint64_t salt, const int32_t *tokens, uint32_t n) {
    kvc_unified *parts[2];
    const uint32_t k = attn_parts(h, parts);
    return hit_upto(h, p, salt, tokens, n, kvc_retain_match_parts(parts, k, salt, tokens, n));
}

uint32_t kvc_hybrid_prefix_match(kvc_hybrid *h, kvc_ckpt_pool *p, uint64_t salt, const int32_t *tokens, uint32_t n) {
    const int32_t slot = hyb_hit(h, p, salt, tokens, n);
    if (slot < 0) {
        return 0;
    }
    kvc_ckpt_touch(p, (uint32_t)slot);
    return p->n_tok[slot];
}

int kvc_hybrid_prefix_attach(kvc_hybrid *h, kvc_ckpt_pool *p, int32_t s, uint64_t salt, const int32_t *tokens,
                             uint32_t n, uint32_t *n_attached, kvc_err *err) {
    *n_attached = 0;
    if (!h->attn->reuse) {
        return kvc_err_set(err, KVC_E_ARG, "prefix reuse is off in the attention part");
    }
    if (kvc_seq_id_check(s, h->recr->n_seq_max, err) != KVC_OK) {
        return KVC_E_ARG;
    }
    kvc_unified *parts[2];
    const uint32_t k = attn_parts(h, parts);
    bool held = kvc_recurrent_seq_pos_max(h->recr, s) >= 0;
    for (uint32_t i = 0; i < k; i++) {
        held = held || kvc_unified_seq_pos_max(parts[i], s) >= 0;
    }
    if (held) {
        return kvc_err_set(err, KVC_E_ARG, "sequence %d holds cells or a state: attach into an empty sequence", s);
    }
    const int32_t slot = hyb_hit(h, p, salt, tokens, n);
    if (slot >= 0) {
        const uint32_t len = p->n_tok[slot];
        uint32_t cell = 0;
        int r = kvc_ckpt_place(p, h->recr, s, (uint32_t)slot, &cell, err);
        if (r != KVC_OK) {
            return r;
        }
        /* the attention part attaches [0, len) exactly: a match of len + 1 tokens attaches at most
         * len, and the index holds at least that many (an iSWA pair: the window before len too) */
        uint32_t got = 0;
        r = kvc_retain_attach_parts(parts, k, s, salt, tokens, len + 1, &got, err);
        if (r == KVC_OK && got != len) {
            for (uint32_t i = 0; i < k; i++) {
                kvc_unified_seq_rm(parts[i], s, -1, -1);
            }
            r = kvc_err_set(err, KVC_E_INTERNAL, "the attention part attached %u tokens of the %u matched", got, len);
        }
        if (r != KVC_OK) {
            kvc_recurrent_unplace(h->recr);
            return r;
        }
        /* the rows last: a failure above leaves even the free cell's bytes as they were */
        kvc_ckpt_fill(p, h->recr, (uint32_t)slot, cell);
        *n_attached = len;
    }
    kvc_ckpt_disown(p, s);
    return KVC_OK;
}

int kvc_hybrid_prefix_release(kvc_hybrid *h, kvc_ckpt_pool *p, int32_t s, uint64_t salt, const int32_t *tokens,
                              uint32_t n, uint32_t *n_hit, kvc_retained *attn, kvc_err *err) {
    *n_hit = 0;
    memset(attn, 0, sizeof *attn);
    if (kvc_seq_id_check(s, h->recr->n_seq_max, err) != KVC_OK) {
        return KVC_E_ARG;
    }
    kvc_unified *parts[2];
    const uint32_t k = attn_parts(h, parts);
    uint32_t len = kvc_ckpt_seq_len(h->recr, s);
    if (tokens && len > n) {
        return kvc_err_set(err, KVC_E_ARG, "sequence %d's recurrent state is the state after %u tokens, and tokens "
                           "has %u", s, len, n);
    }
    /* everything that can fail comes first: the tokens the cells recorded (without the caller's),
     * the chain's copy, then the attention part's release */
    int32_t *own = NULL;
    const int32_t *chain = tokens;
    uint32_t n_chain = n;
    if (!tokens && len && h->attn->reuse) {
        const uint32_t m = kvc_retain_seq_cells(h->attn, s);
        own = malloc((size_t)(m ? m : 1) * sizeof *own);
        if (!own) {
            return kvc_err_set(err, KVC_E_NOMEM, "the tokens of sequence %d's %u cells", s, m);
        }
        n_chain = kvc_retain_seq_tokens(h->attn, s, own);
        chain = own;
    }
    /* the state is the state after its len tokens: checkpointed only when all of them are known
     * (the caller's, or recorded by the attention cells of positions 0 .. len - 1) */
    if (!chain || n_chain < len) {
        len = 0;
    }
    int32_t *copy = NULL;
    if (len) {
        copy = malloc((size_t)len * sizeof *copy);
        if (!copy) {
            free(own);
            return kvc_err_set(err, KVC_E_NOMEM, "checkpoint of %u tokens", len);
        }
    }
    const int r = kvc_retain_release_parts(parts, k, s, salt, tokens, n, attn, err);
    if (r != KVC_OK) {
        free(copy);
        free(own);
        return r;
    }
    uint32_t kept = 0;
    if (len) {
        kvc_err ignored;
        /* validated above: it cannot fail (it takes copy over) */
        kvc_ckpt_save(p, h->recr, s, salt, chain, n_chain, copy, &kept, &ignored);
    }
    kvc_recurrent_seq_rm(h->recr, s, -1, -1);
    kvc_ckpt_disown(p, s);
    const int32_t slot = chain && attn->n_kept ? hit_upto(h, p, salt, chain, n_chain, attn->n_kept) : -1;
    *n_hit = slot < 0 ? 0 : p->n_tok[slot];
    free(own);
    return KVC_OK;
}

int kvc_hybrid_prefix_pin(kvc_hybrid *h, kvc_ckpt_pool *p, uint64_t salt, const int32_t *tokens, uint32_t n,
                          kvc_ckpt_handle *ckpt, kvc_prefix_handle attn[2], kvc_err *err) {
    kvc_unified *parts[2];
    const uint32_t k = attn_parts(h, parts);
    int rc = kvc_ckpt_pin(p, salt, tokens, n, ckpt, err);
    if (rc != KVC_OK) {
        return rc;
    }
    rc = kvc_retain_pin_parts_xy(parts, k, salt, tokens, NULL, NULL, NULL, n, attn, err);
    if (rc != KVC_OK) {
        kvc_ckpt_unpin(p, *ckpt, NULL);   /* the pin just taken: it is held */
    }
    return rc;
}

int kvc_hybrid_prefix_unpin(kvc_hybrid *h, kvc_ckpt_pool *p, kvc_ckpt_handle ckpt, const kvc_prefix_handle attn[2],
                            kvc_err *err) {
    kvc_unified *parts[2];
    const uint32_t k = attn_parts(h, parts);
    if (!kvc_ckpt_pin_held(p, ckpt)) {
        return kvc_ckpt_unpin(p, ckpt, err);   /* its refusal, which changes nothing */
    }
    const int rc = kvc_retain_unpin_parts(parts, k, attn, err);
    if (rc == KVC_OK) {
        kvc_ckpt_unpin(p, ckpt, NULL);
    }
    return rc;
}

void kvc_hybrid_prefix_evict(kvc_hybrid *h, kvc_ckpt_pool *p, uint32_t n_cells, uint32_t n_ckpts, uint32_t *cells,
                             uint32_t *ckpts) {
    kvc_unified *parts[2];
    const uint32_t k = attn_parts(h, parts);
    *cells = kvc_retain_evict_parts(parts, k, n_cells);
    *ckpts = kvc_ckpt_evict(p, n_ckpts);
}
