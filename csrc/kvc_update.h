/* kvcache — llama.cpp's update() of a unified cache, before a decode: today's queued stream
 * copies, the pending K-shift (the keys rotated with RoPE, or the shifts dropped), then a
 * scheduled defragmentation and its moves. */
#ifndef KVC_UPDATE_H
#define KVC_UPDATE_H

#include "kvc_unified.h"
#include "kvc_rope.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct kvc_update_opts {
    const kvc_rope_params *rope;      /* [n_layer] per kept layer: rotate K by the pending shifts;
                                       * NULL: the shifts are dropped (no RoPE, or no K memory
                                       * here: the owner rotates) */
    const uint32_t        *head_dim;  /* [n_layer] with rope: the K head size of each kept layer */
    int32_t                n_max_nodes; /* bounds the defrag's moves, as llama.cpp's graph budget */
    int32_t               *k_shift;   /* [n_stream * size] or NULL: receives the shift of every cell when one
                                       * was pending (0 for empty cells) */
    bool                   stream_copies; /* today's update: the queued stream copies run first
                                       * (kvc_unified_stream_copies), the shift then rotates them too */
} kvc_update_opts;

typedef struct kvc_update_result {
    bool shifted;       /* a K-shift was pending (opts.k_shift holds it) */
    bool rotated;       /* ... and K was rotated by it */
    bool defragged;     /* a scheduled defrag moved cells (kvc_unified_defrag_runs has the plan) */
    bool moved;         /* ... and the K/V rows moved with them */
    bool need_reserve;  /* the data changed, or its owner has to change it (metadata only): the
                         * graph needs a new reservation */
    uint32_t copies;    /* stream copies that ran (opts.stream_copies) */
} kvc_update_result;

/* Update n caches (1..KVC_UPDATE_MAX_PARTS, distinct) with opts[k] for caches[k], all or nothing:
 * every rotation is checked and its scratch allocated before the first cache changes. A pending
 * defrag plan is settled first (kvc_defrag.h); a defrag run clears the placement. KVC_OK with
 * res[k] filled, or KVC_E_ARG / KVC_E_NOMEM with err (nothing changed). */
#define KVC_UPDATE_MAX_PARTS 8
int kvc_unified_update_parts(kvc_unified *const *caches, uint32_t n, const kvc_update_opts *opts,
                             kvc_update_result *res, kvc_err *err);
/* The same for one cache. */
int kvc_unified_update(kvc_unified *c, const kvc_update_opts *opts, kvc_update_result *res, kvc_err *err);

#ifdef __cplusplus
}
#endif

#endif
