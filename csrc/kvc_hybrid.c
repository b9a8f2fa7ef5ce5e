#include "kvc_hybrid.h"
#include "kvc_slot.h"

int kvc_hybrid_init(kvc_hybrid *h, kvc_unified *attn, kvc_recurrent *recr, kvc_err *err) {
    h->attn = NULL;
    h->recr = NULL;
    if (attn->semantics != KVC_SEM_2026 || recr->semantics != KVC_REC_2026) {
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
    const int ra = kvc_unified_find_slot_2026(h->attn, ub, err);
    if (ra != 1) {
        /* the attention part changed nothing; nor does the recurrent part, then */
        kvc_recurrent_unplace(h->recr);
    }
    return ra;
}

void kvc_hybrid_clear(kvc_hybrid *h) {
    kvc_unified_clear(h->attn);
    kvc_recurrent_clear(h->recr);
}

bool kvc_hybrid_seq_rm(kvc_hybrid *h, int32_t s, int32_t p0, int32_t p1) {
    /* the recurrent part may refuse; it changes nothing then, and neither does the pair */
    if (!kvc_recurrent_seq_rm(h->recr, s, p0, p1)) {
        return false;
    }
    return kvc_unified_seq_rm(h->attn, s, p0, p1);
}

int kvc_hybrid_seq_cp(kvc_hybrid *h, int32_t src, int32_t dst, int32_t p0, int32_t p1, kvc_err *err) {
    const int r = kvc_unified_seq_cp_check(h->attn, src, dst, p0, p1, err);
    if (r != KVC_OK) {
        return r;
    }
    kvc_unified_seq_cp(h->attn, src, dst, p0, p1);
    kvc_recurrent_seq_cp(h->recr, src, dst, p0, p1);
    return KVC_OK;
}

void kvc_hybrid_seq_keep(kvc_hybrid *h, int32_t s) {
    kvc_unified_seq_keep(h->attn, s);
    kvc_recurrent_seq_keep(h->recr, s);
}

void kvc_hybrid_seq_add(kvc_hybrid *h, int32_t s, int32_t p0, int32_t p1, int32_t shift) {
    kvc_unified_seq_add(h->attn, s, p0, p1, shift);
    kvc_recurrent_seq_add(h->recr, s, p0, p1, shift);
}

void kvc_hybrid_seq_div(kvc_hybrid *h, int32_t s, int32_t p0, int32_t p1, int32_t d) {
    kvc_unified_seq_div(h->attn, s, p0, p1, d);
    kvc_recurrent_seq_div(h->recr, s, p0, p1, d);
}

int32_t kvc_hybrid_seq_pos_min(const kvc_hybrid *h, int32_t s) {
    const int32_t a = kvc_unified_seq_pos_min(h->attn, s), r = kvc_recurrent_seq_pos_min(h->recr, s);
    return a > r ? a : r;
}

int32_t kvc_hybrid_seq_pos_max(const kvc_hybrid *h, int32_t s) {
    const int32_t a = kvc_unified_seq_pos_max(h->attn, s), r = kvc_recurrent_seq_pos_max(h->recr, s);
    return a < r ? a : r;
}
