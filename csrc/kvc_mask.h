/* kvcache — the KQ mask of a ubatch against a unified cache. */
#ifndef KVC_MASK_H
#define KVC_MASK_H

#include "kvc_ubatch.h"
#include "kvc_unified_types.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum kvc_mask_dtype {
    KVC_MASK_F32  = 0,  /* 0.0f (or -|p0-p1| with alibi) / -INFINITY */
    KVC_MASK_F16  = 1,  /* the same values as IEEE half */
    KVC_MASK_BOOL = 2,  /* 1 where the token attends the cell, 0 elsewhere (alibi ignored) */
} kvc_mask_dtype;

/* The window of key positions [lo, hi] a query at p1 may see (the mask's rule, and the
 * attention indices', kvc_attn.h). */
static inline void kvc_unified_visible_range(const kvc_unified *c, int32_t p1, bool causal, int32_t *lo, int32_t *hi) {
    const int64_t l = kvc_unified_swa_start(c, p1);
    *lo = (int32_t)(l > 0 ? l : 0);
    *hi = causal ? p1 : INT32_MAX;
}

/* KQ mask into out[rows][c->n], rows = kvc_pad_u32(n_tokens, KVC_KQ_MASK_PAD) with pad, else
 * n_tokens (the caller allocated it), row r at out + r * row_stride bytes (0: dense rows of
 * c->n elements; else at least that; the bytes between rows are not written), of the given
 * dtype (kvc_mask_dtype): a token sees a cell when the cell holds the token's first sequence
 * id, is not in its future (causal) and not outside the sliding window. Padding rows see
 * nothing. KVC_OK or KVC_E_NOMEM (out untouched). */
int kvc_unified_kq_mask(const kvc_unified *c, const kvc_ubatch *ub, bool causal, bool alibi, int dtype, bool pad,
                        size_t row_stride, void *out);

/* Semantics 2026: the mask of a (checked) ubatch per token group, without padding rows:
 * out[n_groups][n_seq_tokens][n_kv] (kvc_unified_groups gives the groups), n_kv the largest
 * kvc_unified_stream_n_kv over the groups' streams (kvc_unified_kq_mask_2026_n_kv); a row
 * sees the cells of its token's stream. KVC_OK, KVC_E_ARG / KVC_E_NOMEM with err. */
int kvc_unified_kq_mask_2026(const kvc_unified *c, const kvc_ubatch *ub, bool causal, bool alibi, int dtype,
                             void *out, kvc_err *err);
uint32_t kvc_unified_kq_mask_2026_n_kv(const kvc_unified *c, const uint32_t *strm, uint32_t n_groups);

/* The columns of the attention of ub and its token groups (kvc_unified_ops.kv_groups): the
 * seed's one group of every token against the cache's n, or today's groups (kvc_unified_groups,
 * KVC_E_ARG with err) against the largest n_kv of their streams. */
int kvc_unified_kv_groups_seed(const kvc_unified *c, const kvc_ubatch *ub, uint32_t *strm, uint32_t *n_groups,
                               uint32_t *n_seq_tokens, uint32_t *n_kv, kvc_err *err);
int kvc_unified_kv_groups_streams(const kvc_unified *c, const kvc_ubatch *ub, uint32_t *strm, uint32_t *n_groups,
                                  uint32_t *n_seq_tokens, uint32_t *n_kv, kvc_err *err);

/* The same masks into a buffer the cache remembers (kvc_unified.mask_memo: the last buffer
 * written this way, its shape and what each of its rows showed). With reuse, when out is that
 * buffer, untouched since, and the call asks for a mask of the same shape (dtype, rows, n_kv,
 * row stride, padding, causal, token groups and their streams), only what changed since is
 * rewritten: for each row the cells whose position or sequences changed, and a whole row where
 * its sequence or the start of its window changed or where cells that did not change came into
 * (or left) its causal window; every other case (ALiBi, a cell table replaced, more changes
 * than a full write costs) writes the whole mask. The result equals a fresh mask's. Without
 * reuse the whole mask is written. Either way out is remembered. */
int kvc_unified_kq_mask_reuse(kvc_unified *c, const kvc_ubatch *ub, bool causal, bool alibi, int dtype, bool pad,
                              size_t row_stride, void *out, bool reuse);
int kvc_unified_kq_mask_2026_reuse(kvc_unified *c, const kvc_ubatch *ub, bool causal, bool alibi, int dtype,
                                   void *out, bool reuse, kvc_err *err);

#ifdef __cplusplus
}
#endif

#endif
