/* kvcache — reading a memory state into a unified cache of the seed's semantics (mid-2025
 * llama.cpp): one stream; the section parser (kvc_section.h) validates the state against the
 * cache while nothing changes, a single sequence's cells get their run of free cells by a dry
 * run of the slot search, then the apply, which cannot fail. */
#ifndef KVC_STATE_2025_H
#define KVC_STATE_2025_H

#include "kvc_common.h"
#include "kvc_slot.h"
#include "kvc_state_plan.h"
#include "kvc_unified.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Validate a state for a cache of the seed's semantics into plan (kvc_unified_state_prepare_lay's
 * work for such a cache, kvc_unified_ops.state_prepare, seq_id valid): KVC_OK, or a negative code with err and the plan freed. */
int kvc_state_prepare_2025(kvc_unified *c, int32_t seq_id, const uint8_t *data, size_t len, unsigned flags,
                           unsigned layout, kvc_state_plan *plan, kvc_err *err);
/* Apply a plan kvc_state_prepare_2025 made against c, unchanged since (not a no-op plan): KVC_OK,
 * or a negative code when c changed in between. */
int kvc_state_apply_2025(kvc_unified *c, const kvc_state_plan *plan);

#ifdef __cplusplus
}
#endif

#endif
