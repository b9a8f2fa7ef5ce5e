/* kvcache — attention indices: for a placed ubatch of a unified cache, the cells each query
 * token may attend to as CSR arrays (what paged-attention kernels such as FlashInfer's take with
 * pages of one cell), exactly the cells the KQ mask (kvc_mask.h) shows, at the cost of the cells
 * of the ubatch's sequences rather than of the whole cache.
 *
 * The query tokens are cut into groups: a run of tokens of the ubatch that are consecutive and
 * have the same first sequence id (and stream) is one group when a kernel can attend it as a
 * block; else each of its tokens is a group of its own. Group g holds tokens
 * [qo_indptr[g], qo_indptr[g + 1]) and the K/V rows kv_indices[kv_indptr[g] .. kv_indptr[g + 1])
 * (row = stream * size + cell, the cache's layer layout), ordered by position, then cell.
 * causal[g] says how its tokens see them:
 *   1: token i of a group of q tokens and L rows sees rows [0, L - q + i] (a kernel's causal
 *      rule with the queries as the last q keys, FlashInfer's causal=True), which is then
 *      exactly llama.cpp's position rule;
 *   0: every token of the group sees every row of it.
 * With causal=true every group of more than one token has causal[g] = 1 (a run whose mask that
 * rule does not reproduce, through holes or repeats in its positions, tokens out of order, a
 * sliding window or the 2-D rule, is split into single tokens); with causal=false every group
 * has 0. So a kernel with one causal flag for the whole batch, set as the call's, is exact. */
#ifndef KVC_ATTN_H
#define KVC_ATTN_H

#include "kvc_ubatch.h"
#include "kvc_unified_types.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The caller's arrays and what a call found. Buffers NULL (or too small) are not written; the
 * counts are always set. */
typedef struct kvc_attn {
    /* the caller's: room for cap_groups groups (qo_indptr and kv_indptr hold cap_groups + 1),
     * cap_nnz indices and cap_tokens query positions; kv_pos, q_pos and stream may be NULL when
     * not wanted */
    int32_t  *qo_indptr;   /* [n_groups + 1] the groups' first tokens, then n_tokens */
    int32_t  *kv_indptr;   /* [n_groups + 1] the groups' first entries of kv_indices, then nnz */
    int32_t  *kv_indices;  /* [nnz] K/V rows */
    int32_t  *kv_pos;      /* [nnz] each row's cell position (ALiBi: the distance is |kv_pos - pos|) */
    uint8_t  *causal;      /* [n_groups] the rule each group's tokens see its rows by (above) */
    int32_t  *stream;      /* [n_groups] each group's stream (0 with one) */
    int32_t  *q_pos;       /* [n_tokens] each query token's position (ALiBi, with kv_pos) */
    uint32_t  cap_groups, cap_nnz, cap_tokens;
    /* set by the call */
    uint32_t  n_groups, nnz;
    uint32_t  n_kv;        /* the KQ mask's columns: every cell index is below it */
    uint32_t  span;        /* the rows the indices reach: the largest + 1 (0 with none) */
} kvc_attn;

/* The attention indices of ub, which must be the cache's current placement (the ubatch the last
 * find_slot placed, no operation since: kvc_slot.h) with every token in a cell holding its
 * first sequence id at its position. Both semantics; 2026: the cells of each token's stream,
 * the ubatch grouped as its mask is (kvc_unified_groups). The counts are set whenever the
 * ubatch is accepted, and the arrays written when they have room for them (all but kv_pos,
 * q_pos and stream given). KVC_OK; KVC_E_NOSPACE when the arrays are too small (the counts say what is
 * needed); KVC_E_ARG (a ubatch not placed, or a grouping the mask refuses; more than INT32_MAX
 * indices) or KVC_E_NOMEM with err. Reads nothing beyond the cells of the ubatch's sequences. */
int kvc_unified_attn_indices(const kvc_unified *c, const kvc_ubatch *ub, bool causal, kvc_attn *out, kvc_err *err);

#ifdef __cplusplus
}
#endif

#endif
