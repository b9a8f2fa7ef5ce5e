/* kvcache — the cell table of the recurrent-state cache (kvc_recurrent.h): one cell per state,
 * its position, the cell its state is copied from, the sequences sharing it, and per sequence
 * the cell holding its state. The operations every recurrent cache type shares work on a table
 * (the live one, or the work copy a transactional operation builds its result in). */
#ifndef KVC_REC_CELLS_H
#define KVC_REC_CELLS_H

#include "kvc_common.h"
#include "kvc_seqset.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The cell table plus the counters the operations move together (struct of arrays). */
typedef struct kvc_rec_cells {
    uint32_t  size;   /* number of cells */
    uint32_t  head;   /* first cell of the last placed ubatch (where s_copy / s_mask start) */
    uint32_t  n;      /* cells the last ubatch spans */
    uint32_t  used;   /* the reference's count of used cells (not always the true count) */
    int32_t   rs_z;   /* 2026: the cell of the last ubatch whose row is the zero state, -1 = none */
    int32_t  *pos;    /* [size] last position of the state, -1 = none */
    int32_t  *src;    /* [size] cell to copy the state from, -1 = none (state starts at zero) */
    int32_t  *src0;   /* [size] 2026: the source find_slot staged for s_copy (rs_z for a new state) */
    int32_t  *tail;   /* [size] for sequence i: the cell holding its state, -1 = none */
    uint32_t *rs_idx; /* [size] 2026, for sequence i: the snapshot plane a pending rollback reads
                       * (0 = none) */
    uint32_t *snap;   /* [size] 2026: snapshot planes of cell i its last ubatch wrote (kvcache's
                       * record: a rollback further back than this is refused) */
    uint64_t *seq;    /* [seq_words * size] the sequences sharing each cell's state (planes) */
    uint32_t  seq_words;
} kvc_rec_cells;

/* Cell i's set of sequences (ids outside the table's words are in no cell). */
static inline bool kvc_rec_has(const kvc_rec_cells *t, uint32_t i, int32_t s) {
    return s >= 0 && (uint32_t)s < 64 * t->seq_words && kvc_seqs_has(t->seq, t->size, i, s);
}
static inline void kvc_rec_add(kvc_rec_cells *t, uint32_t i, int32_t s) { kvc_seqs_add(t->seq, t->size, i, s); }
static inline void kvc_rec_del(kvc_rec_cells *t, uint32_t i, int32_t s) { kvc_seqs_del(t->seq, t->size, i, s); }
static inline bool kvc_rec_none(const kvc_rec_cells *t, uint32_t i) {
    return kvc_seqs_none(t->seq, t->size, t->seq_words, i);
}
static inline void kvc_rec_clear(kvc_rec_cells *t, uint32_t i) { kvc_seqs_put(t->seq, t->size, t->seq_words, i, NULL); }

/* Empty cell i the way the reference does when its last sequence leaves. */
static inline void kvc_rec_cell_drop(kvc_rec_cells *t, uint32_t i) {
    t->pos[i] = -1;
    t->src[i] = -1;
}

/* Allocate a table of size cells (contents undefined): KVC_OK or KVC_E_NOMEM (release it then). */
int  kvc_rec_cells_alloc(kvc_rec_cells *t, uint32_t size, uint32_t seq_words);
void kvc_rec_cells_release(kvc_rec_cells *t);   /* safe on a zeroed or half-allocated table */
/* Every cell new: pos, src, tail -1, no sequence, no pending rollback nor snapshot. Counters
 * and src0 untouched (llama.cpp's clear leaves the staged sources). */
void kvc_rec_cells_wipe(kvc_rec_cells *t);
/* dst = src (same size), counters included. */
void kvc_rec_cells_copy(kvc_rec_cells *dst, const kvc_rec_cells *src);
/* The reference's wrap-around scan for an empty cell from `from` on: at most size steps; when
 * nothing is empty the result is where the scan stopped, which may be size itself. */
uint32_t kvc_rec_next_empty(const kvc_rec_cells *t, uint32_t from);
/* Sequence s (or every one, s < 0) loses its state: a pending rollback goes with it (kvcache's
 * rule C9: llama.cpp keeps it, and the sequence's next state would start from a snapshot plane). */
void kvc_rec_forget_rollback(kvc_rec_cells *t, int32_t s);
/* Sequence s (valid) gives up its own state record: the cell it held loses it (and is dropped
 * when no sequence is left in it). */
void kvc_rec_release_seq(kvc_rec_cells *t, int32_t s);
/* The sequence operations on a table: dst shares src's state; only s keeps its state. */
void kvc_rec_seq_cp(kvc_rec_cells *t, int32_t s_src, int32_t s_dst);
void kvc_rec_seq_keep(kvc_rec_cells *t, int32_t s);
/* The cell holding s's state when it lies in [p0, p1) (after the reference's clamping and
 * early returns), or -1. */
int32_t kvc_rec_tail_in_range(const kvc_rec_cells *t, int32_t s, int32_t p0, int32_t p1);

#ifdef __cplusplus
}
#endif

#endif
