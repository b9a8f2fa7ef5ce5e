/* kvcache — defragmenting a unified cache: scheduling, the plan (which moves the cell
 * metadata) and the moves of the K/V rows it implies. */
#ifndef KVC_DEFRAG_H
#define KVC_DEFRAG_H

#include "kvc_unified_types.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The fragmentation llama.cpp's defrag_sched measures, in its float arithmetic:
 * max(0, 1 - (used + n_pad) / n), 0 while n is 0. */
float    kvc_unified_fragmentation(const kvc_unified *c);
/* Schedule a defrag when the fragmentation exceeds thold; below n = 2048 it counts as 0. */
void     kvc_unified_defrag_sched(kvc_unified *c, float thold);
/* Plan a defrag: the cell metadata moves now, defrag_ids says from where. 1 = something moves
 * (the plan is then pending until its K/V rows move), 0 = not. A plan still pending from an
 * earlier call is settled first. */
int      kvc_unified_defrag_prepare(kvc_unified *c, int32_t n_max_nodes);
/* The last plan as runs: cells [src, src + n) move to [dst, dst + n); writes 3 values per run
 * into runs (when not NULL) and returns the number of runs. */
uint32_t kvc_unified_defrag_runs(const kvc_unified *c, uint32_t *runs);
/* Move the K/V rows as the pending plan says (once; nothing when none is pending) and clear
 * do_defrag. Without K/V memory nothing moves: the owner moves its own rows along
 * kvc_unified_defrag_runs first. The plan stays readable. */
void     kvc_unified_defrag_move(kvc_unified *c);

/* Between a defrag_prepare and its defrag_move the cells have moved, their rows not yet.
 * Every operation that reads or writes K/V data or changes which cells hold what (find_slot,
 * restore, store, the sequence operations, clear, prune_swa, state writes and reads, the
 * K-shift, update, the next defrag_prepare) settles the pending plan first: a cache with K/V
 * memory moves the rows (as defrag_move would); a metadata-only cache drops the plan (its owner
 * applied it, or missed it: a stale plan must not be applied later), so defrag_runs() is then
 * empty. No row is ever moved by a stale plan. */
void     kvc_unified_defrag_settle_pending(kvc_unified *c);
static inline void kvc_unified_defrag_settle(kvc_unified *c) {
    if (c->defrag_pending) {
        kvc_unified_defrag_settle_pending(c);
    }
}

#ifdef __cplusplus
}
#endif

#endif
