/* kvcache — placing ubatches in a unified cache: the slot search, the undo log of the
 * placements since the last commit (restore, and the exact rewind of a composite operation),
 * whole-object snapshots, and storing the placed tokens' K/V rows. */
#ifndef KVC_SLOT_H
#define KVC_SLOT_H

#include "kvc_unified.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Place a (checked) ubatch: 1 = placed at head, 0 = no slot (head may have moved, as the
 * seed's), KVC_E_NOMEM (nothing changed). */
int     kvc_unified_find_slot(kvc_unified *c, const kvc_ubatch *ub);
void    kvc_unified_commit(kvc_unified *c);
void    kvc_unified_restore(kvc_unified *c);
void    kvc_unified_set_full(kvc_unified *c);

/* Write the K / V rows of the n_tokens tokens just placed at head, for kept layer ikv.
 * k: n_tokens rows of k_row_bytes; v: n_tokens rows of v_row_bytes (transposed on store when
 * v_trans). Either may be NULL. The caller checked head + n_tokens <= size. */
void    kvc_unified_store(kvc_unified *c, uint32_t ikv, uint32_t n_tokens, const void *k, const void *v);

/* The undo log's memory (kvc_unified_init / kvc_unified_free use them). */
int     kvc_undo_init(kvc_undo *u);   /* KVC_OK / KVC_E_NOMEM (nothing to free then) */
void    kvc_undo_free(kvc_undo *u);

/* --- undoing find_slot calls exactly ---------------------------------------------------- */
/* What the find_slot calls change besides the cells: head, n and the undo log. A mark taken
 * before them lets kvc_unified_rewind undo them all, e.g. when a composite operation (the two
 * caches of an iSWA cache) fails in its second part after the first succeeded. */
typedef struct kvc_unified_mark {
    uint32_t head, n;
    uint32_t n_spans, n_cells;   /* the undo log's length */
} kvc_unified_mark;
void kvc_unified_mark_take(const kvc_unified *c, kvc_unified_mark *m);
/* Undo every find_slot since m was taken, newest first: the cells they filled get back their
 * previous positions and sequences, head and n their marked values. Only find_slot calls may
 * have changed c since the mark (KVC_E_ARG, nothing changed, when the undo log is shorter than
 * at the mark, e.g. after a commit). */
int  kvc_unified_rewind(kvc_unified *c, const kvc_unified_mark *m);

/* --- whole-object snapshot, for operations that must leave no trace on failure ---------- */
typedef struct kvc_unified_snapshot {
    kvc_cells cells;
    uint32_t  head, n;
    kvc_undo  undo;      /* a copy of the log (capacities: exactly its length) */
    bool      do_defrag;
} kvc_unified_snapshot;
int  kvc_unified_snapshot_take(const kvc_unified *c, kvc_unified_snapshot *s);   /* KVC_OK / NOMEM */
void kvc_unified_snapshot_restore(kvc_unified *c, const kvc_unified_snapshot *s); /* metadata only */
void kvc_unified_snapshot_free(kvc_unified_snapshot *s);

#ifdef __cplusplus
}
#endif

#endif
