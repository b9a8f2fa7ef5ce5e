#include "kvc_iswa.h"

#include "kvc_seqops.h"
#include "kvc_slot.h"

#include <inttypes.h>

/* --- sizing ------------------------------------------------------------------------------ */

static uint64_t pad_up(uint64_t x, uint64_t n) {
    return (x + n - 1) / n * n;
}

uint64_t kvc_iswa_swa_size(const kvc_iswa_sizing *s) {
    if (s->swa_full) {
        return s->kv_size;
    }
    /* every operand is below 2**32: products and sums stay below 2**64 */
    if (s->cap_then_pad) {
        const uint64_t n = s->kv_unified ? s->n_seq_max : 1;
        const uint64_t want = (uint64_t)s->n_swa * n + s->n_ubatch;
        return pad_up(want < s->kv_size ? want : s->kv_size, KVC_ISWA_PAD_2026);
    }
    const uint64_t want = pad_up((uint64_t)s->n_swa * s->n_seq_max + s->n_ubatch, s->n_pad ? s->n_pad : 1);
    return want < s->kv_size ? want : s->kv_size;
}

/* --- the pending pruning ranges ---------------------------------------------------------- */

void kvc_iswa_pending_clear(kvc_iswa_pending *p) {
    kvc_seqset_clear(&p->seqs);
}

int kvc_iswa_pending_set(kvc_iswa_pending *p, uint32_t n_tokens, const int32_t *pos, const uint32_t *seq_off,
                         const int32_t *seq_ids, uint32_t n_seq_max, bool record, kvc_err *err) {
    /* check first: a rejected batch leaves the previous ranges in place */
    if (n_seq_max > KVC_MAX_SEQ) {
        return kvc_err_set(err, KVC_E_ARG, "n_seq_max %" PRIu32 " exceeds %d", n_seq_max, KVC_MAX_SEQ);
    }
    const uint32_t n_ids = n_tokens ? seq_off[n_tokens] : 0;
    for (uint32_t k = 0; k < n_ids; k++) {
        if (seq_ids[k] < 0 || (uint32_t)seq_ids[k] >= n_seq_max) {
            uint32_t t = 0;
            while (seq_off[t + 1] <= k) {
                t++;
            }
            return kvc_err_set(err, KVC_E_ARG, "seq_id %" PRId32 " of token %" PRIu32 " is outside [0, %" PRIu32 ")",
                               seq_ids[k], t, n_seq_max);
        }
    }
    kvc_seqset_clear(&p->seqs);
    if (!record) {
        return KVC_OK;
    }
    for (uint32_t t = 0; t < n_tokens; t++) {
        const int32_t x = pos[t];
        for (uint32_t k = seq_off[t]; k < seq_off[t + 1]; k++) {
            const int32_t s = seq_ids[k];
            if (!kvc_seqset_has(&p->seqs, s)) {
                kvc_seqset_add(&p->seqs, s);
                p->pmin[s] = x;
                p->pmax[s] = x;
            } else if (x < p->pmin[s]) {
                p->pmin[s] = x;
            } else if (x > p->pmax[s]) {
                p->pmax[s] = x;
            }
        }
    }
    return KVC_OK;
}

/* --- the pair ---------------------------------------------------------------------------- */

int kvc_iswa_init(kvc_iswa *c, kvc_unified *base, kvc_unified *swa, bool swa_full, kvc_err *err) {
    if (base == swa) {
        return kvc_err_set(err, KVC_E_ARG, "the base and SWA caches are the same cache");
    }
    if (base->ops != swa->ops || base->n_stream != swa->n_stream || base->n_seq_max != swa->n_seq_max) {
        return kvc_err_set(err, KVC_E_ARG, "the base and SWA caches differ in semantics, streams or n_seq_max");
    }
    if (swa->swa_type == KVC_SWA_NONE) {
        return kvc_err_set(err, KVC_E_ARG, "the SWA cache has no sliding window");
    }
    /* each model layer's K/V is in one cache at most: both tables ascend, walk them together */
    for (uint32_t i = 0, j = 0; i < base->n_layer && j < swa->n_layer;) {
        const int32_t a = base->layers[i].il, b = swa->layers[j].il;
        if (a == b) {
            return kvc_err_set(err, KVC_E_ARG, "model layer %" PRId32 " is in both the base and the SWA cache", a);
        }
        i += a < b;
        j += b < a;
    }
    c->base = base;
    c->swa = swa;
    c->swa_full = swa_full;
    kvc_iswa_pending_clear(&c->pending);
    return KVC_OK;
}

int kvc_iswa_sbatch_init(kvc_iswa *c, uint32_t n_tokens, const int32_t *pos, const uint32_t *seq_off,
                         const int32_t *seq_ids, kvc_err *err) {
    return kvc_iswa_pending_set(&c->pending, n_tokens, pos, seq_off, seq_ids, c->swa->n_seq_max, !c->swa_full, err);
}

int kvc_iswa_layer(const kvc_iswa *c, int64_t il, int64_t *index) {
    *index = kvc_unified_layer_index(c->swa, il);
    if (*index >= 0) {
        return KVC_ISWA_SWA;
    }
    *index = kvc_unified_layer_index(c->base, il);
    return *index >= 0 ? KVC_ISWA_BASE : KVC_ISWA_NONE;
}

int kvc_iswa_find_slot(kvc_iswa *c, const kvc_ubatch *ub, int found[2], kvc_err *err) {
    /* the pair's rule is the caches' type's: the seed's places in each in turn (an error in the
     * SWA cache rewinds the base cache), today's in both or neither */
    kvc_unified *const parts[2] = { c->base, c->swa };
    int room[2] = { 0, 0 };
    const int r = c->base->ops->find_slot_parts(parts, 2, ub, room, err);
    found[0] = room[0] == 1;
    found[1] = room[1] == 1;
    return r;
}

uint32_t kvc_iswa_commit(kvc_iswa *c, kvc_iswa_pending *partial) {
    kvc_unified_commit(c->base);
    kvc_unified_commit(c->swa);
    /* the ranges are consumed before pruning, as llama.cpp swaps them out */
    const kvc_iswa_pending *p = &c->pending;
    kvc_iswa_pending_clear(partial);
    uint32_t n = 0;
    for (int32_t s = kvc_seqset_next(&p->seqs, KVC_SEQ_WORDS, -1); s >= 0;
         s = kvc_seqset_next(&p->seqs, KVC_SEQ_WORDS, s)) {
        if (kvc_unified_prune_swa(c->swa, s, p->pmin[s], p->pmax[s]) == 1) {
            kvc_seqset_add(&partial->seqs, s);
            partial->pmin[s] = p->pmin[s];
            partial->pmax[s] = p->pmax[s];
            n++;
        }
    }
    kvc_iswa_pending_clear(&c->pending);
    return n;
}

void kvc_iswa_restore(kvc_iswa *c) {
    kvc_unified_restore(c->base);
    kvc_unified_restore(c->swa);
}

void kvc_iswa_set_full(kvc_iswa *c) {
    kvc_unified_set_full(c->base);
    kvc_unified_set_full(c->swa);
}

bool kvc_iswa_seq_rm(kvc_iswa *c, int32_t s, int32_t p0, int32_t p1) {
    const bool in_base = kvc_unified_seq_rm(c->base, s, p0, p1);
    const bool in_swa = kvc_unified_seq_rm(c->swa, s, p0, p1);
    return in_base && in_swa;
}

int kvc_iswa_seq_cp(kvc_iswa *c, int32_t src, int32_t dst, int32_t p0, int32_t p1, kvc_err *err) {
    int r = kvc_unified_seq_cp_check(c->base, src, dst, p0, p1, err);
    if (r == KVC_OK) {
        r = kvc_unified_seq_cp_check(c->swa, src, dst, p0, p1, err);
    }
    if (r != KVC_OK) {
        return r;
    }
    kvc_unified_seq_cp(c->base, src, dst, p0, p1);
    kvc_unified_seq_cp(c->swa, src, dst, p0, p1);
    return KVC_OK;
}

/* clear, seq_keep, seq_add, seq_div: the base cache, then the SWA cache */
KVC_SEQ_PAIR_DEFINE(kvc_iswa, kvc_iswa, kvc_unified, c->base, kvc_unified, c->swa)
