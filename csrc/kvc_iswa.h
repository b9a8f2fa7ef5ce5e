/* kvcache — what the interleaved sliding-window (iSWA) cache adds to its two unified caches:
 * the pending pruning ranges.
 *
 * An iSWA cache is a base cache (the layers without a window) and a SWA cache (the layers with
 * one), driven together. When a batch is split, the iSWA cache records, per sequence, the
 * smallest and largest position the whole batch gives it; when the batch's ubatches are
 * committed, every cell of the SWA cache that no position up to that largest one can see is
 * pruned from the sequence (kvc_unified_prune_swa). */
#ifndef KVC_ISWA_H
#define KVC_ISWA_H

#include "kvc_common.h"
#include "kvc_seqset.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct kvc_iswa_pending {
    kvc_seqset seqs;             /* the sequences that have a range */
    int32_t  pmin[KVC_MAX_SEQ];  /* smallest position of s in the batch (valid when its bit is set) */
    int32_t  pmax[KVC_MAX_SEQ];  /* largest position */
} kvc_iswa_pending;

/* No pending range. */
void kvc_iswa_pending_clear(kvc_iswa_pending *p);

/* Replace the pending ranges by those of a batch of n_tokens tokens: token t has position pos[t]
 * and the sequence ids seq_ids[seq_off[t] .. seq_off[t + 1]). Every id must lie in
 * [0, n_seq_max) (n_seq_max <= KVC_MAX_SEQ), else KVC_E_ARG with err and p unchanged. With
 * record false the ids are checked and the ranges cleared, nothing recorded (a full-size SWA
 * cache is never pruned). */
int  kvc_iswa_pending_set(kvc_iswa_pending *p, uint32_t n_tokens, const int32_t *pos, const uint32_t *seq_off,
                          const int32_t *seq_ids, uint32_t n_seq_max, bool record, kvc_err *err);

#ifdef __cplusplus
}
#endif

#endif
