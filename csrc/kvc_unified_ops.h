/* kvcache — the two unified cache types and the constructor that picks one. A cache follows one
 * semantics for its whole life: the seed's (mid-2025 llama.cpp: one cell table, contiguous
 * placement undone by restore, defragmentation) or today's (streams, scattered placement that
 * is final, stream copies, the per-cell extension, prefix reuse). Both share the cell table,
 * the sequence operations, the state writer and the section parser; what each does its own way
 * (placement, the attention's columns, the state reader, the hand-off) the layers reach through
 * the cache's table, c->ops (kvc_unified_ops, kvc_unified_types.h). The tables are defined here,
 * above every layer whose functions they name (csrc/LAYERS). */
#ifndef KVC_UNIFIED_OPS_H
#define KVC_UNIFIED_OPS_H

#include "kvc_common.h"
#include "kvc_unified.h"

#ifdef __cplusplus
extern "C" {
#endif

extern const kvc_unified_ops kvc_unified_2025_ops;   /* the seed's */
extern const kvc_unified_ops kvc_unified_2026_ops;   /* today's */

/* The table of semantics `semantics` (enum kvc_semantics), or NULL for another value. */
const kvc_unified_ops *kvc_unified_ops_of(int32_t semantics);

/* Validate params and initialise a cache of the type params->semantics names (buffers NULL).
 * KVC_OK, KVC_E_ARG (err says why), KVC_E_NOMEM. */
int kvc_unified_init(kvc_unified *c, const kvc_unified_params *p, kvc_err *err);

#ifdef __cplusplus
}
#endif

#endif
