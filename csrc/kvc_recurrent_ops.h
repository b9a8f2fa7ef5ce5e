/* kvcache — the two recurrent cache types and the constructor that picks one. A cache follows one
 * semantics for its whole life: mid-2025 llama.cpp's llama_kv_cache_recurrent (s_copy and s_mask
 * move `src` in place; no snapshots, no prefix reuse) or today's llama_memory_recurrent (s_copy
 * reads the sources find_slot staged, a zero row rs_z instead of s_mask, rollback snapshots,
 * checkpoints for prefix reuse). What each does its own way the operations and the layers reach
 * through the cache's table, c->ops (kvc_recurrent_ops, kvc_recurrent.h). */
#ifndef KVC_RECURRENT_OPS_H
#define KVC_RECURRENT_OPS_H

#include "kvc_recurrent.h"

#ifdef __cplusplus
extern "C" {
#endif

extern const kvc_recurrent_ops kvc_recurrent_2025_ops;   /* mid-2025 llama.cpp's */
extern const kvc_recurrent_ops kvc_recurrent_2026_ops;   /* today's */

/* The table of semantics `semantics` (enum kvc_rec_semantics), or NULL for another value. */
const kvc_recurrent_ops *kvc_recurrent_ops_of(int32_t semantics);

/* Validate params and initialise an empty cache of the type params->semantics names (buffers
 * NULL). KVC_OK, KVC_E_ARG (err says why), KVC_E_NOMEM. */
int kvc_recurrent_init(kvc_recurrent *c, const kvc_recurrent_params *p, kvc_err *err);

#ifdef __cplusplus
}
#endif

#endif
