/* kvcache — the mask memo's memory (see kvc_mask_memo.h). */
#include "kvc_mask_memo.h"

void kvc_mask_memo_free(struct kvc_mask_memo *m) {
    if (!m) {
        return;
    }
    for (int k = 0; k < KVC_MASK_SLOTS; k++) {
        kvc_mask_slot *sl = &m->slot[k];
        kvc_free(sl->seq);
        kvc_free(sl->lo);
        kvc_free(sl->hi);
        kvc_free(sl->strm);
        kvc_free(sl->epoch);
        kvc_free(sl->chg_n);
    }
    kvc_free(m->cells);
    kvc_free(m);
}
