/* kvcache — defragmenting a unified cache: scheduling, the plan (which moves the cell
 * metadata) and the moves of the K/V rows it implies. */
#ifndef KVC_DEFRAG_H
#define KVC_DEFRAG_H

#include "kvc_unified.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The fragmentation llama.cpp's defrag_sched measures, in its float arithmetic:
 * max(0, 1 - (used + n_pad) / n), 0 while n is 0. */
float    kvc_unified_fragmentation(const kvc_unified *c);
/* Schedule a defrag when the fragmentation exceeds thold; below n = 2048 it counts as 0. */
void     kvc_unified_defrag_sched(kvc_unified *c, float thold);
/* Plan a defrag (moves the cell metadata, fills defrag_ids). 1 = something to move, 0 = not. */
int      kvc_unified_defrag_prepare(kvc_unified *c, int32_t n_max_nodes);
/* The last plan as runs: cells [src, src + n) move to [dst, dst + n); writes 3 values per run
 * into runs (when not NULL) and returns the number of runs. */
uint32_t kvc_unified_defrag_runs(const kvc_unified *c, uint32_t *runs);
/* Move the K/V data as the last plan says (contiguous runs at once). */
void     kvc_unified_defrag_move(kvc_unified *c);

#ifdef __cplusplus
}
#endif

#endif
