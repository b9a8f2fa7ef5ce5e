#include "kvc_hybrid.h"
#include "kvc_recurrent_ops.h"
#include "kvc_seqops.h"
#include "kvc_slot.h"

int kvc_hybrid_init(kvc_hybrid *h, kvc_unified *attn, kvc_recurrent *recr, kvc_err *err) {
    h->attn = NULL;
    h->iswa = NULL;
    h->recr = NULL;
    /* the hybrid places in the attention part as today's unified cache does, and its recurrent
     * part must be today's (staged sources, rollback, checkpoints) */
    if (attn->ops->find_slot != kvc_unified_find_slot_2026 || recr->ops != &kvc_recurrent_2026_ops) {
        return kvc_err_set(err, KVC_E_ARG, "a hybrid memory is today's llama.cpp's: both parts must be of "
                           "semantics '2026'");
    }
    if (attn->n_seq_max != recr->n_seq_max) {
        return kvc_err_set(err, KVC_E_ARG, "the attention part has n_seq_max %u, the recurrent part %u",
                           attn->n_seq_max, recr->n_seq_max);
    }
    h->attn = attn;
    h->recr = recr;
    return KVC_OK;
}

int kvc_hybrid_init_iswa(kvc_hybrid *h, kvc_iswa *iswa, kvc_recurrent *recr, kvc_err *err) {
    /* the pair's caches share semantics and n_seq_max (kvc_iswa_init): its base stands for both */
    const int r = kvc_hybrid_init(h, iswa->base, recr, err);
    if (r == KVC_OK) {
        h->iswa = iswa;
    }
    return r;
}

kvc_unified *kvc_hybrid_attn_layer(const kvc_hybrid *h, int64_t il, int64_t *index) {
    if (h->iswa) {
        const int part = kvc_iswa_layer(h->iswa, il, index);
        return part == KVC_ISWA_SWA ? h->iswa->swa : part == KVC_ISWA_BASE ? h->iswa->base : NULL;
    }
    *index = kvc_unified_layer_index(h->attn, il);
    return *index >= 0 ? h->attn : NULL;
}

int64_t kvc_hybrid_recr_layer(const kvc_hybrid *h, int64_t il) {
    return kvc_layers_find(h->recr->layers, h->recr->n_layer, il);
}

int kvc_hybrid_find_slot(kvc_hybrid *h, const kvc_ubatch *ub, kvc_err *err) {
    const int rr = kvc_recurrent_find_slot(h->recr, ub, err);
    if (rr < 0) {
        return rr;
    }
    if (rr == 0) {
        /* llama.cpp's prepare fails on the sanity check: the ubatch goes nowhere */
        kvc_recurrent_unplace(h->recr);
        return 0;
    }
    int found[2];
    const int ra = h->iswa ? kvc_iswa_find_slot(h->iswa, ub, found, err) : kvc_unified_find_slot_2026(h->attn, ub, err);
    if (ra != 1) {
        /* the attention part changed nothing; nor does the recurrent part, then */
        kvc_recurrent_unplace(h->recr);
    }
    return ra;
}

bool kvc_hybrid_seq_rm(kvc_hybrid *h, int32_t s, int32_t p0, int32_t p1) {
    /* the recurrent part may refuse; it changes nothing then, and neither does the pair */
    if (!kvc_recurrent_seq_rm(h->recr, s, p0, p1)) {
        return false;
    }
    return h->iswa ? kvc_iswa_seq_rm(h->iswa, s, p0, p1) : kvc_unified_seq_rm(h->attn, s, p0, p1);
}

int kvc_hybrid_seq_cp(kvc_hybrid *h, int32_t src, int32_t dst, int32_t p0, int32_t p1, kvc_err *err) {
    if (h->iswa) {
        /* checked in both caches before either copies */
        const int r = kvc_iswa_seq_cp(h->iswa, src, dst, p0, p1, err);
        if (r != KVC_OK) {
            return r;
        }
    } else {
        const int r = kvc_unified_seq_cp_check(h->attn, src, dst, p0, p1, err);
        if (r != KVC_OK) {
            return r;
        }
        kvc_unified_seq_cp(h->attn, src, dst, p0, p1);
    }
    kvc_recurrent_seq_cp(h->recr, src, dst, p0, p1);
    return KVC_OK;
}

int32_t kvc_hybrid_seq_pos_min(const kvc_hybrid *h, int32_t s) {
    const int32_t a = h->iswa ? kvc_iswa_seq_pos_min(h->iswa, s) : kvc_unified_seq_pos_min(h->attn, s);
    const int32_t r = kvc_recurrent_seq_pos_min(h->recr, s);
    return a > r ? a : r;
}

int32_t kvc_hybrid_seq_pos_max(const kvc_hybrid *h, int32_t s) {
    const int32_t a = h->iswa ? kvc_iswa_seq_pos_max(h->iswa, s) : kvc_unified_seq_pos_max(h->attn, s);
    const int32_t r = kvc_recurrent_seq_pos_max(h->recr, s);
    return a < r ? a : r;
}

/* The attention part's operations that both parts take unchanged: the iSWA pair's when the
 * layers have a sliding window, else the unified cache's. */
static void kvc_hybrid_attn_clear(kvc_hybrid *h) {
    if (h->iswa) {
        kvc_iswa_clear(h->iswa);
    } else {
        kvc_unified_clear(h->attn);
    }
}

static void kvc_hybrid_attn_seq_keep(kvc_hybrid *h, int32_t s) {
    if (h->iswa) {
        kvc_iswa_seq_keep(h->iswa, s);
    } else {
        kvc_unified_seq_keep(h->attn, s);
    }
}

static void kvc_hybrid_attn_seq_add(kvc_hybrid *h, int32_t s, int32_t p0, int32_t p1, int32_t shift) {
    if (h->iswa) {
        kvc_iswa_seq_add(h->iswa, s, p0, p1, shift);
    } else {
        kvc_unified_seq_add(h->attn, s, p0, p1, shift);
    }
}

static void kvc_hybrid_attn_seq_div(kvc_hybrid *h, int32_t s, int32_t p0, int32_t p1, int32_t d) {
    if (h->iswa) {
        kvc_iswa_seq_div(h->iswa, s, p0, p1, d);
    } else {
        kvc_unified_seq_div(h->attn, s, p0, p1, d);
    }
}

/* clear, seq_keep, seq_add, seq_div: the attention part, then the recurrent part */
KVC_SEQ_PAIR_DEFINE(kvc_hybrid, kvc_hybrid, kvc_hybrid_attn, c, kvc_recurrent, c->recr)
