/* kvcache — reading a memory state into a unified cache of semantics 2026: a section per
 * stream, each against a stream of the cache; a single sequence's sections placed in any free
 * cells of its stream (today's find_slot), all checked by a dry run before anything changes. */
#ifndef KVC_STATE_2026_H
#define KVC_STATE_2026_H

#include "kvc_common.h"
#include "kvc_slot.h"
#include "kvc_state_plan.h"
#include "kvc_unified.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Semantics 2026: the placement a single sequence's state section of cc cells at positions pos
 * gets when read into seq_id: the sequence removed from its stream, then the cells placed as one
 * ubatch of it (find_slot with cont false; !evict: kvc_unified_find_slot_2026_ask's). 1 placed
 * (kvc_unified_slot_cell tells where), 0 no room, KVC_ROOM_EVICTING (!evict: room only by
 * evicting, nothing placed); c is changed in every case. */
int kvc_unified_state_place_2026(kvc_unified *c, int32_t seq_id, uint32_t cc, const int32_t *pos, bool evict);
/* kvc_unified_state_place_2026 (evicting nothing) into a sequence that holds no cell, placed only
 * where the search finds exactly the cells want[0, cc) (its dry run's): 1 placed, 0 not (nothing
 * changed: the cells differ, or the sequence holds cells). */
int kvc_unified_state_place_2026_at(kvc_unified *c, int32_t seq_id, uint32_t cc, const int32_t *pos,
                                    const int32_t *want);
/* After kvc_unified_state_place_2026 placed cc cells in stream `stream`: the saved extensions
 * ext[0, cc) (token order; NULL: none saved, the cells keep what the placement gave them) into
 * the cells it placed, as a sequence's state read puts them back. No-op for a cache without the
 * extension. */
void kvc_unified_state_put_ext_2026(kvc_unified *c, uint32_t stream, uint32_t cc, const struct kvc_cell_ext *ext);
/* The dry run of placing secs[0, n_sec) (their cell counts and positions) into seq_id in turn; c
 * is left as it was (but for what its prefix index evicts to make room, only when evict). 1 all
 * placed (cells, when not NULL, gets the last section's cells in its stream, in token order), 0
 * section *failed found no room (*used: the stream's cells then used or held by the prefix
 * index, which no placement takes without evicting), KVC_ROOM_EVICTING (!evict:
 * every section has room, some only by evicting; cells not filled), KVC_E_NOMEM. */
int kvc_unified_state_try_place_2026(kvc_unified *c, int32_t seq_id, const struct kvc_state_sec *secs,
                                     uint32_t n_sec, bool evict, int32_t *cells, uint32_t *failed, uint32_t *used);

/* The reader (kvc_state_plan.h) of a cache of semantics 2026. */
kvc_state_prepare_fn kvc_state_prepare_2026;
kvc_state_apply_fn   kvc_state_apply_2026;

#ifdef __cplusplus
}
#endif

#endif
