/* kvcache — what a unified cache remembers of the masks it wrote (kvc_unified.mask_memo), so that
 * kvc_mask.h rewrites only what changed. Its own module below the cache, so that the cache frees
 * it without depending on the mask. */
#ifndef KVC_MASK_MEMO_H
#define KVC_MASK_MEMO_H

#include "kvc_common.h"

#ifdef __cplusplus
extern "C" {
#endif

/* A buffer the cache wrote a mask into, and what it holds. */
typedef struct kvc_mask_slot {
    bool        valid;
    const uint8_t *out;
    size_t      extent;               /* bytes from out that the mask spans */
    size_t      row_stride;
    uint32_t    n_tokens, rows, n_kv, n_groups, nst;
    int         dtype;
    bool        causal, pad;
    uint64_t    used;                 /* the memo's clock when last written */
    uint32_t    cap;                  /* tokens the row arrays hold */
    int32_t    *seq, *lo, *hi;        /* [cap] per token: its row's sequence and window */
    uint32_t   *strm;                 /* [n_stream] the stream of each group */
    uint64_t   *epoch;                /* [n_stream] each stream's change log as of the write */
    uint32_t   *chg_n;
} kvc_mask_slot;

/* The last few buffers (a step may write masks of several dtypes or layers' windows). */
#define KVC_MASK_SLOTS 4

struct kvc_mask_memo {
    kvc_mask_slot slot[KVC_MASK_SLOTS];
    uint64_t    clock;
    uint32_t   *cells;                /* [cells_cap] scratch: a stream's changed cells */
    uint32_t    cells_cap;
};

/* Free what kvc_unified.mask_memo holds (kvc_unified_free calls it; NULL is fine). */
void kvc_mask_memo_free(struct kvc_mask_memo *m);

#ifdef __cplusplus
}
#endif

#endif
