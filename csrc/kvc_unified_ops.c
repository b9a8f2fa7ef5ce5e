/* kvcache — the two unified cache types (see kvc_unified_ops.h). */
#include "kvc_unified_ops.h"

#include "kvc_handoff.h"
#include "kvc_mask.h"
#include "kvc_slot.h"
#include "kvc_state_2025.h"
#include "kvc_state_2026.h"

const kvc_unified_ops kvc_unified_2025_ops = {
    .semantics = KVC_SEM_2025,
    .check = kvc_unified_refuse_streams,
    .init = NULL,
    .find_slot = kvc_unified_find_slot_2025,
    .find_slot_parts = kvc_unified_find_slot_2025_parts,
    .store = kvc_unified_store_run,
    .n_kv = kvc_unified_n_kv_seed,
    .kv_groups = kvc_unified_kv_groups_seed,
    .ids_once = false,
    .state_prepare = kvc_state_prepare_2025,
    .state_apply = kvc_state_apply_2025,
    .handoff_layout = KVC_HANDOFF_LAYOUT_2025,
    .handoff_reserve = kvc_handoff_reserve_2025,
    .handoff_save = kvc_handoff_save_2025,
    .handoff_place = kvc_handoff_place_2025,
    .prefix_reuse = false,
    .shift_refused_partial = true,
};

const kvc_unified_ops kvc_unified_2026_ops = {
    .semantics = KVC_SEM_2026,
    .check = NULL,
    .init = kvc_unified_streams_init,
    .find_slot = kvc_unified_find_slot_2026,
    .find_slot_parts = kvc_unified_find_slot_2026_parts,
    .store = kvc_unified_store_scattered,
    .n_kv = kvc_unified_n_kv_streams,
    .kv_groups = kvc_unified_kv_groups_streams,
    .ids_once = true,
    .state_prepare = kvc_state_prepare_2026,
    .state_apply = kvc_state_apply_2026,
    .handoff_layout = KVC_HANDOFF_LAYOUT_2026,
    .handoff_reserve = kvc_handoff_reserve_2026,
    .handoff_save = kvc_handoff_save_2026,
    .handoff_place = kvc_handoff_place_2026,
    .prefix_reuse = true,
    .shift_refused_partial = false,
};

const kvc_unified_ops *kvc_unified_ops_of(int32_t semantics) {
    switch (semantics) {
    case KVC_SEM_2025:
        return &kvc_unified_2025_ops;
    case KVC_SEM_2026:
        return &kvc_unified_2026_ops;
    default:
        return NULL;
    }
}

int kvc_unified_init(kvc_unified *c, const kvc_unified_params *p, kvc_err *err) {
    return kvc_unified_construct(c, p, kvc_unified_ops_of(p->semantics), err);
}
