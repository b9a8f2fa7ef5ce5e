/* kvcache — the ubatch: the tokens placed into a cache in one step.
 *
 * Tokens are grouped: n_tokens = n_seq_tokens * n_seqs, token t belongs to
 * group t / n_seq_tokens. A simple split has n_seq_tokens = 1 (one group per
 * token). Each group carries its list of sequence ids, in the order given
 * (the mask uses the first one). */
#ifndef KVC_UBATCH_H
#define KVC_UBATCH_H

#include "kvc_common.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct kvc_ubatch {
    uint32_t        n_tokens;      /* number of tokens */
    uint32_t        n_seq_tokens;  /* tokens per group */
    uint32_t        n_seqs;        /* number of groups */
    const int32_t  *pos;           /* [n_tokens] positions */
    const uint32_t *seq_off;       /* [n_seqs + 1] group g's ids: seq_ids[seq_off[g] .. seq_off[g+1]) */
    const int32_t  *seq_ids;       /* flat list of sequence ids */
    /* optional (NULL: absent), what a cache with the per-cell extension stores per cell
     * (kvc_cells.h): a 2-D position per token (llama.cpp's M-RoPE position planes 2 and 1; both
     * or neither), and a token id per token */
    const int32_t  *pos_x;         /* [n_tokens] */
    const int32_t  *pos_y;         /* [n_tokens] */
    const int32_t  *token;         /* [n_tokens] */
} kvc_ubatch;

/* Check a ubatch against n_seq_max: shapes agree, every group has at least one id, every id is
 * in [0, n_seq_max), every position in [0, INT32_MAX], pos_x and pos_y both given or neither.
 * Returns KVC_OK or KVC_E_ARG (with err). */
int kvc_ubatch_check(const kvc_ubatch *ub, uint32_t n_seq_max, kvc_err *err);

/* Does the ubatch carry 2-D positions (llama_ubatch::is_pos_2d)? */
static inline bool kvc_ubatch_is_2d(const kvc_ubatch *ub) { return ub->pos_x != NULL; }

/* The first sequence id of token t: the one its mask row follows. */
static inline int32_t kvc_ubatch_first_id(const kvc_ubatch *ub, uint32_t t) {
    return ub->seq_ids[ub->seq_off[t / ub->n_seq_tokens]];
}

#ifdef __cplusplus
}
#endif

#endif
