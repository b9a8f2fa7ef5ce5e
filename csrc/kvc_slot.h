/* kvcache — placing ubatches in a unified cache: the slot search, the undo log of the
 * placements since the last commit (restore, and the exact rewind of a composite operation),
 * whole-object snapshots, and storing the placed tokens' K/V rows. */
#ifndef KVC_SLOT_H
#define KVC_SLOT_H

#include "kvc_unified.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Place a (checked) ubatch by the rule of the cache's type (kvc_unified_ops.find_slot): the
 * seed's (kvc_unified_find_slot_2025) or today's (kvc_unified_find_slot_2026, whose grouping
 * errors come back as KVC_E_ARG without a message here). */
int     kvc_unified_find_slot(kvc_unified *c, const kvc_ubatch *ub);
/* The seed's find_slot: 1 = placed at head (the placement below), 0 = no slot (head may have
 * moved, as the seed's; nothing is placed then), KVC_E_NOMEM (nothing changed). err is not
 * used (the table's signature). */
int     kvc_unified_find_slot_2025(kvc_unified *c, const kvc_ubatch *ub, kvc_err *err);
/* The seed's find_slot of ub undone at once from the undo log (O(the cells placed), no copy of
 * the cache): nothing changes, a pending defrag is not settled. 1 room (the cells it takes into
 * out, n_tokens in token order, when not NULL), 0 no room, KVC_E_NOMEM; *head (when not NULL)
 * where the search left the head. The dry run of a placement for a sequence that holds no cell. */
int     kvc_unified_find_slot_2025_dry(kvc_unified *c, const kvc_ubatch *ub, int32_t *out, uint32_t *head);
/* The seed's find_slot into each of the n (1..KVC_STATE_MAX_PARTS) caches cs in turn (an iSWA
 * pair): found[k] whether cache k found room; 1 when all did, else 0 (the placements that
 * were made stay, for restore to undo). An error (KVC_E_NOMEM) of cache k rewinds the caches
 * before it and is returned. */
int     kvc_unified_find_slot_2025_parts(kvc_unified *const *cs, uint32_t n, const kvc_ubatch *ub, int *found,
                                         kvc_err *err);
void    kvc_unified_commit(kvc_unified *c);
void    kvc_unified_restore(kvc_unified *c);
void    kvc_unified_set_full(kvc_unified *c);

/* --- the placement: where the last successful find_slot put its tokens ------------------
 * It lasts until an operation changes which cells hold what or moves head: restore, every
 * sequence operation, clear, set_full, defrag_prepare, an update that defragments, a state
 * read, or the next find_slot (which replaces it, or leaves nothing placed when it fails).
 * commit and prune_swa keep it. */
static inline uint32_t kvc_unified_slot_n(const kvc_unified *c) { return c->slot.n; }   /* 0: none */
/* The cell of placed token t < kvc_unified_slot_n(c) (in its stream, kvc_unified_slot_stream). */
static inline uint32_t kvc_unified_slot_cell(const kvc_unified *c, uint32_t t) {
    return c->slot.cells ? (uint32_t)c->slot.cells[t] : c->slot.head + t;
}
/* The stream of placed token t (0 for a run: a cache of one stream). */
static inline uint32_t kvc_unified_slot_stream(const kvc_unified *c, uint32_t t) {
    return c->slot.cells ? c->scatter.strm[t / c->scatter.n_seq_tokens] : 0;
}
/* The cells of the placed tokens, in token order, into out[kvc_unified_slot_n(c)]. */
void    kvc_unified_slot_cells(const kvc_unified *c, int32_t *out);

/* --- semantics 2026 ----------------------------------------------------------------------
 * The token groups of a ubatch: one stream: one group of every token; several: the tokens
 * grouped per sequence in order of appearance, every group as long, one id per token (what
 * today's llama.cpp asserts). strm[g] the stream of group g (room for n_stream), *n_groups,
 * *n_seq_tokens. KVC_OK or KVC_E_ARG with err. */
int  kvc_unified_groups(const kvc_unified *c, const kvc_ubatch *ub, uint32_t *strm, uint32_t *n_groups,
                        uint32_t *n_seq_tokens, kvc_err *err);
/* find_slot(cont=false) + apply_ubatch of a (checked) ubatch: 1 placed (kvc_unified_slot_*
 * tell where), 0 no room (nothing changed), KVC_E_ARG (err: the grouping). */
int  kvc_unified_find_slot_2026(kvc_unified *c, const kvc_ubatch *ub, kvc_err *err);
/* The same over the n (1..KVC_STATE_MAX_PARTS) caches of a composite cache (an iSWA pair), all
 * or nothing: every cache's grouping is checked (KVC_E_ARG, nothing changed), every cache
 * searches against its own unchanged cells (found[k]: cache k found room), and only when all
 * did are all placed (1); else 0, no cell changed and no placement is current in any. */
int  kvc_unified_find_slot_2026_parts(kvc_unified *const *cs, uint32_t n, const kvc_ubatch *ub, int *found,
                                      kvc_err *err);
/* What a placement that may not evict answers: room only once the prefix index evicts. */
#define KVC_ROOM_EVICTING 2
/* kvc_unified_find_slot_2026 that evicts nothing from the prefix index: 1 placed, 0 no room even
 * by evicting, KVC_ROOM_EVICTING room only by evicting (nothing placed), KVC_E_ARG (err). */
int  kvc_unified_find_slot_2026_ask(kvc_unified *c, const kvc_ubatch *ub, kvc_err *err);
/* The search half of kvc_unified_find_slot_2026 (evict) or _ask (!evict) alone: the cells the
 * placement would take into out (n_tokens, token order; NULL: not wanted), nothing placed and no
 * cell changed (but for what the prefix index evicts, only when evict), no placement current.
 * 1 found, 0 no room, KVC_ROOM_EVICTING (!evict: room only by evicting), KVC_E_ARG (err). The dry
 * run of a placement for sequences that hold no cell, whose placement changes nothing the
 * search reads. */
int  kvc_unified_search_2026(kvc_unified *c, const kvc_ubatch *ub, bool evict, int32_t *out, kvc_err *err);
/* kvc_unified_find_slot_2026_ask that places ub only where its search finds exactly the cells
 * want[0 .. n_tokens) (what a dry run found): 1 placed, 0 not (nothing changed, no placement
 * current), KVC_E_ARG (err). */
int  kvc_unified_find_slot_2026_at(kvc_unified *c, const kvc_ubatch *ub, const int32_t *want, kvc_err *err);
/* The room of the n (0..KVC_STATE_MAX_PARTS) parts of a composite operation (an iSWA pair's
 * placement, state read or import), all or none evicting: room(ctx, k, false) asks every part k
 * without evicting (KVC_OK: room, KVC_ROOM_EVICTING: room once its prefix index evicts, else a
 * negative code), and only when every part has room or can make it does room(ctx, k, true) make
 * it in those that must (a single part is asked so at once). KVC_OK, or the code of a part that
 * has no room (the last asked), *failed naming it. */
typedef int kvc_part_room_fn(void *ctx, uint32_t k, bool evict);
int  kvc_parts_room(uint32_t n, kvc_part_room_fn *room, void *ctx, uint32_t *failed);
/* The dry run of placing ubs[0..n_ub) in turn (each against the state holding the ones before
 * it); the cache is left exactly as it was, its prefix index included: a ubatch that fits only by
 * evicting gets the cells the real placement would give it after evicting, yet nothing is
 * evicted (nor recorded for write-back). For ubatch u: out_cells gets its tokens' cells (in
 * order, the ubatches one after another), out_strm its groups' streams (n_stream entries per
 * ubatch), out_groups[u] its group count. 1 all placed, 0 one did not fit, KVC_E_ARG /
 * KVC_E_NOMEM with err. */
int  kvc_unified_prepare_2026(kvc_unified *c, const kvc_ubatch *ubs, uint32_t n_ub, int32_t *out_cells,
                              uint32_t *out_strm, uint32_t *out_groups, kvc_err *err);

/* Write the K / V rows of the placed tokens for kept layer ikv: k holds n_tokens rows of
 * k_row_bytes, v n_tokens rows of v_row_bytes (V is transposed on the way in when v_trans);
 * either may be NULL. KVC_E_ARG (nothing written) when nothing is placed, n_tokens is not the
 * placement's size or ikv is not a kept layer. */
int     kvc_unified_store(kvc_unified *c, uint32_t ikv, uint32_t n_tokens, const void *k, const void *v);
/* The types' halves of it (kvc_unified_ops.store), the placement current and n_tokens its
 * size: the rows into the placement's run of cells (the seed's), or each token's row into its
 * cell of its stream (today's). */
void    kvc_unified_store_run(kvc_unified *c, const kvc_layer *ly, uint32_t n_tokens, const uint8_t *k,
                              const uint8_t *v);
void    kvc_unified_store_scattered(kvc_unified *c, const kvc_layer *ly, uint32_t n_tokens, const uint8_t *k,
                                    const uint8_t *v);

/* --- undoing find_slot calls exactly ---------------------------------------------------- */
/* What the find_slot calls change besides the cells: head, n and the undo log. A mark taken
 * before them lets kvc_unified_rewind undo them all, e.g. when a composite operation (the two
 * caches of an iSWA cache) fails in its second part after the first succeeded. */
typedef struct kvc_unified_mark {
    uint32_t head, n;
    kvc_slot slot;
    uint32_t n_spans, n_cells;   /* the undo log's length */
} kvc_unified_mark;
void kvc_unified_mark_take(const kvc_unified *c, kvc_unified_mark *m);
/* Undo every find_slot since m was taken, newest first: the cells they filled get back their
 * previous positions and sequences, head, n and the placement their marked values. Only find_slot calls may
 * have changed c since the mark (KVC_E_ARG, nothing changed, when the undo log is shorter than
 * at the mark, e.g. after a commit). */
int  kvc_unified_rewind(kvc_unified *c, const kvc_unified_mark *m);

/* --- whole-object snapshot, for operations that must leave no trace on failure ---------- */
typedef struct kvc_unified_snapshot {
    kvc_cells cells;
    uint32_t  head, n;
    kvc_slot  slot;
    kvc_undo  undo;      /* a copy of the log (capacities: exactly its length) */
    bool      do_defrag, defrag_pending;
} kvc_unified_snapshot;
int  kvc_unified_snapshot_take(const kvc_unified *c, kvc_unified_snapshot *s);   /* KVC_OK / NOMEM */
void kvc_unified_snapshot_restore(kvc_unified *c, const kvc_unified_snapshot *s); /* metadata only */
void kvc_unified_snapshot_free(kvc_unified_snapshot *s);
/* The snapshot's fields besides the cells and the undo log's contents (head, n, placement, the
 * log's length, the defrag flags): what kvc_unified_snapshot_take takes of them. */
void kvc_unified_snapshot_scalars(const kvc_unified *c, kvc_unified_snapshot *s);

#ifdef __cplusplus
}
#endif

#endif
