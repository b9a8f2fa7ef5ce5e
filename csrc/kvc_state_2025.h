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

/* The reader (kvc_state_plan.h) of a cache of the seed's semantics. */
kvc_state_prepare_fn kvc_state_prepare_2025;
kvc_state_apply_fn   kvc_state_apply_2025;

#ifdef __cplusplus
}
#endif

#endif
