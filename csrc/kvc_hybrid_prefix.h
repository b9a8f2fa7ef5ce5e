/* kvcache — prefix reuse for the hybrid memory: the attention part's prefix index (kvc_retain.h)
 * and the recurrent part's checkpoints (kvc_checkpoint.h) together.
 *
 * A hit of length P needs both: the attention K/V of positions [0, P) and the recurrent state at
 * exactly P. The attention index serves any prefix it holds, the recurrent part only the lengths
 * it has checkpoints of, so a hit is the deepest checkpoint no longer than what the attention
 * index holds of the request (and at most all but its last token); the attention part then
 * attaches exactly [0, P), never more, so that both parts resume at the same position. With an
 * iSWA pair as the attention part both of its caches serve the hit (kvc_retain's parts: a SWA
 * cache that keeps only windows must hold the window before P). */
#ifndef KVC_HYBRID_PREFIX_H
#define KVC_HYBRID_PREFIX_H

#include "kvc_checkpoint.h"
#include "kvc_hybrid.h"
#include "kvc_retain.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The hit a request of tokens[0 .. n) gets under salt (0: none); both parts' prefixes touched. */
uint32_t kvc_hybrid_prefix_match(kvc_hybrid *h, kvc_ckpt_pool *p, uint64_t salt, const int32_t *tokens, uint32_t n);

/* Sequence s, empty in both parts, takes the hit: the checkpoint's state at position P - 1 and the
 * attention cells of [0, P); *n_attached = P (0: nothing attached). KVC_OK; KVC_E_ARG (s not a
 * sequence id or holding cells or a state, reuse off), KVC_E_NOSPACE (no recurrent cell),
 * KVC_E_NOMEM: nothing changed. */
int kvc_hybrid_prefix_attach(kvc_hybrid *h, kvc_ckpt_pool *p, int32_t s, uint64_t salt, const int32_t *tokens,
                             uint32_t n, uint32_t *n_attached, kvc_err *err);

/* Sequence s ends: its attention cells go to the index (kvc_retain_release; tokens NULL: the
 * cells' own tokens) and its recurrent state is checkpointed as the state after its tokens (the
 * given ones, or without them the tokens its attention cells recorded, when they cover every
 * position of the state); then s leaves both parts. *n_hit: the hit a later request with these tokens (and one more) gets from what is
 * held now; *attn: the attention part's release. KVC_OK; KVC_E_ARG (s not a sequence id, tokens
 * shorter than the state, reuse off), KVC_E_NOMEM: nothing changed. */
int kvc_hybrid_prefix_release(kvc_hybrid *h, kvc_ckpt_pool *p, int32_t s, uint64_t salt, const int32_t *tokens,
                              uint32_t n, uint32_t *n_hit, kvc_retained *attn, kvc_err *err);

/* Pin the prefix tokens[0 .. n) in both parts: the checkpoint of exactly these tokens (*ckpt) and
 * its cells in every attention cache (attn[k]: the unified cache, or the iSWA pair's base then SWA
 * cache). KVC_OK; KVC_E_ARG (either part does not hold it): nothing pinned. */
int kvc_hybrid_prefix_pin(kvc_hybrid *h, kvc_ckpt_pool *p, uint64_t salt, const int32_t *tokens, uint32_t n,
                          kvc_ckpt_handle *ckpt, kvc_prefix_handle attn[2], kvc_err *err);
/* Let go of both parts' pins (kvc_hybrid_prefix_pin's), every one checked before any is let go:
 * KVC_OK; KVC_E_ARG (one is not a pin held now): nothing changed. */
int kvc_hybrid_prefix_unpin(kvc_hybrid *h, kvc_ckpt_pool *p, kvc_ckpt_handle ckpt, const kvc_prefix_handle attn[2],
                            kvc_err *err);
/* Evict up to n_cells cells from every attention cache's index and up to n_ckpts checkpoints:
 * *cells the cells evicted in all, *ckpts the checkpoints. */
void kvc_hybrid_prefix_evict(kvc_hybrid *h, kvc_ckpt_pool *p, uint32_t n_cells, uint32_t n_ckpts, uint32_t *cells,
                             uint32_t *ckpts);

#ifdef __cplusplus
}
#endif

#endif
