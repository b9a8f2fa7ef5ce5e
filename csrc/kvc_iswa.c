#include "kvc_iswa.h"

#include <inttypes.h>

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
