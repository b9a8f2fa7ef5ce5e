#include "kvc_ubatch.h"

int kvc_ubatch_check(const kvc_ubatch *ub, uint32_t n_seq_max, kvc_err *err) {
    if (ub->n_seq_tokens == 0 || (uint64_t)ub->n_seq_tokens * ub->n_seqs != ub->n_tokens) {
        return kvc_err_set(err, KVC_E_ARG, "ubatch: n_tokens (%u) != n_seq_tokens (%u) * n_seqs (%u)",
                           ub->n_tokens, ub->n_seq_tokens, ub->n_seqs);
    }
    if ((ub->pos_x == NULL) != (ub->pos_y == NULL)) {
        return kvc_err_set(err, KVC_E_ARG, "ubatch: a 2-D position needs both pos_x and pos_y");
    }
    for (uint32_t t = 0; t < ub->n_tokens; t++) {
        if (ub->pos[t] < 0) {
            return kvc_err_set(err, KVC_E_ARG, "ubatch: pos[%u] = %d is negative", t, ub->pos[t]);
        }
    }
    for (uint32_t g = 0; g < ub->n_seqs; g++) {
        const uint32_t b = ub->seq_off[g], e = ub->seq_off[g + 1];
        if (e <= b) {
            return kvc_err_set(err, KVC_E_ARG, "ubatch: token group %u has no sequence id", g);
        }
        for (uint32_t j = b; j < e; j++) {
            const int32_t s = ub->seq_ids[j];
            if (s < 0 || (uint32_t)s >= n_seq_max) {
                return kvc_err_set(err, KVC_E_ARG, "ubatch: seq_id %d of token group %u is outside [0, %u)",
                                   s, g, n_seq_max);
            }
        }
    }
    return KVC_OK;
}
