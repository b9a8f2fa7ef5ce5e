/* kvcache — the undo log of a unified cache's placements: the cells each find_slot overwrote
 * since the last commit, as they were (kvc_slot.h fills it and puts them back). */
#ifndef KVC_UNDO_H
#define KVC_UNDO_H

#include "kvc_common.h"

#ifdef __cplusplus
extern "C" {
#endif

/* One find_slot's overwritten cells [i, i + n), as they were: entries [off, off + n) of the
 * undo log's arrays. */
typedef struct kvc_undo_span {
    uint32_t i, n, off;
} kvc_undo_span;

/* The undo log: the cells each find_slot overwrote since the last commit, as they were, so
 * that restore() (and a rewind) can put them back. */
typedef struct kvc_undo {
    kvc_undo_span *spans;        /* [n_spans] in find_slot order */
    uint32_t       n_spans, cap_spans;
    int32_t       *pos;          /* [n_cells] the overwritten cells' positions */
    uint64_t      *seq;          /* [n_cells * seq_words] and sequence sets, a cell's words together */
    uint32_t       n_cells, cap_cells;
    uint32_t       seq_words;    /* words of a set (the cell table's) */
} kvc_undo;

/* The log's memory (kvc_unified_init / kvc_unified_free use them). */
int  kvc_undo_init(kvc_undo *u, uint32_t seq_words);   /* KVC_OK / KVC_E_NOMEM (nothing to free then) */
void kvc_undo_free(kvc_undo *u);

#ifdef __cplusplus
}
#endif

#endif
