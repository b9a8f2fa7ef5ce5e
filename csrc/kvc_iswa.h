/* kvcache — the interleaved sliding-window (iSWA) cache: the rules that drive its two unified
 * caches together (llama_kv_cache_unified_iswa).
 *
 * An iSWA cache is a base cache (the layers without a window, kv_size cells) and a SWA cache
 * (the layers with one, usually far smaller), driven together: every operation is applied to
 * both, the base cache first. The SWA cache is sized for every sequence's window plus one
 * ubatch (kvc_iswa_swa_size). In the 2025 semantics it is kept small by pruning: when a batch is
 * split, the cache records, per sequence, the smallest and largest position the whole batch
 * gives it (the pending ranges); when the batch's ubatches are committed, every cell of the SWA
 * cache that no position up to that largest one can see leaves the sequence
 * (kvc_unified_prune_swa). Today's llama.cpp (2026) prunes nothing: its find_slot reuses the
 * cells a window has left, and places a ubatch in both caches or in neither. */
#ifndef KVC_ISWA_H
#define KVC_ISWA_H

#include "kvc_common.h"
#include "kvc_seqset.h"
#include "kvc_unified.h"

#ifdef __cplusplus
extern "C" {
#endif

/* --- sizing ------------------------------------------------------------------------------ */

/* What the SWA cache's size depends on. */
typedef struct kvc_iswa_sizing {
    uint32_t kv_size;     /* cells of the base cache (per stream) */
    uint32_t n_swa;       /* the window */
    uint32_t n_seq_max;   /* sequences of the cache */
    uint32_t n_ubatch;    /* the largest ubatch */
    uint32_t n_pad;       /* the caches' cell padding (without cap_then_pad; 0 counts as 1) */
    bool     swa_full;    /* the SWA cache as large as the base cache */
    bool     kv_unified;  /* one stream for every sequence (with cap_then_pad; else there is one) */
    bool     cap_then_pad; /* the rule of today's caches (semantics 2026): capped at kv_size, then
                            * padded to KVC_ISWA_PAD_2026 cells; else (the seed's) padded to n_pad,
                            * then capped */
} kvc_iswa_sizing;

/* today's llama.cpp pads its SWA cache to a multiple of this many cells, whatever n_pad */
#define KVC_ISWA_PAD_2026 256u

/* Cells of the SWA cache (per stream): kv_size with swa_full; else every sequence sharing a
 * stream gets its window, plus one ubatch: min(kv_size, pad(n_swa * n_seq_max + n_ubatch, n_pad)),
 * or with cap_then_pad pad(min(kv_size, n_swa * n + n_ubatch), 256), n = n_seq_max unified, else 1.
 * Exact in 64 bits for every input (the 2026 answer may exceed kv_size, and UINT32_MAX). */
uint64_t kvc_iswa_swa_size(const kvc_iswa_sizing *s);

/* --- the pending pruning ranges (2025) --------------------------------------------------- */

typedef struct kvc_iswa_pending {
    kvc_seqset seqs;             /* the sequences that have a range */
    int32_t  pmin[KVC_MAX_SEQ];  /* smallest position of s in the batch (valid when its bit is set) */
    int32_t  pmax[KVC_MAX_SEQ];  /* largest position */
} kvc_iswa_pending;

/* No pending range. */
void kvc_iswa_pending_clear(kvc_iswa_pending *p);

/* Replace the pending ranges by those of a batch of n_tokens tokens: token t has position pos[t]
 * and the sequence ids seq_ids[seq_off[t] .. seq_off[t + 1]). Every id must lie in
 * [0, n_seq_max) (n_seq_max <= KVC_MAX_SEQ), else KVC_E_ARG with err and p unchanged. With
 * record false the ids are checked and the ranges cleared, nothing recorded (a full-size SWA
 * cache is never pruned). */
int  kvc_iswa_pending_set(kvc_iswa_pending *p, uint32_t n_tokens, const int32_t *pos, const uint32_t *seq_off,
                          const int32_t *seq_ids, uint32_t n_seq_max, bool record, kvc_err *err);

/* --- the pair ---------------------------------------------------------------------------- */

/* An iSWA cache: its two caches (owned by the caller, of one semantics and n_seq_max, the SWA
 * one with a window) and what the pair adds to them. */
typedef struct kvc_iswa {
    kvc_unified     *base;      /* the full-attention layers' cache */
    kvc_unified     *swa;       /* the sliding-window layers' cache */
    bool             swa_full;  /* the SWA cache has kv_size cells: 2025 never prunes it */
    kvc_iswa_pending pending;   /* 2025: the ranges of the batch last split (kvc_iswa_sbatch_init) */
} kvc_iswa;

/* Bind the two caches: KVC_E_ARG with err when they are the same, differ in semantics, streams
 * or n_seq_max, the SWA cache has no window, or a model layer is in both. No pending range. */
int  kvc_iswa_init(kvc_iswa *c, kvc_unified *base, kvc_unified *swa, bool swa_full, kvc_err *err);

/* Record the pending ranges of a batch about to be split (the layout of kvc_iswa_pending_set),
 * nothing with swa_full: KVC_E_ARG with err (ranges unchanged) on an id out of range. */
int  kvc_iswa_sbatch_init(kvc_iswa *c, uint32_t n_tokens, const int32_t *pos, const uint32_t *seq_off,
                          const int32_t *seq_ids, kvc_err *err);

/* Place a (checked) ubatch in the base cache, then in the SWA cache; found[k]: 1 when cache k
 * found room, else 0. 2025: both are tried (kvc_unified_find_slot); when the SWA cache fails with
 * an error, the base cache's placement is undone exactly and the error returned. 2026: in both or
 * in neither (kvc_unified_find_slot_2026_parts). Returns 1 when both found room, 0 when one did
 * not, or a negative status (err set in 2026). */
int  kvc_iswa_find_slot(kvc_iswa *c, const kvc_ubatch *ub, int found[2], kvc_err *err);

/* 2025: keep what find_slot placed in both caches, then slide the window: every sequence of the
 * pending ranges leaves the SWA cells that no position up to its pmax can see, and the ranges
 * are cleared. partial gets the sequences whose window was only partly in the SWA cache (their
 * pmin and pmax as they were pending); returns how many. */
uint32_t kvc_iswa_commit(kvc_iswa *c, kvc_iswa_pending *partial);

/* 2025: undo both caches' find_slot calls since the last commit. */
void kvc_iswa_restore(kvc_iswa *c);
/* 2025: n = size and head = 0 in both caches. */
void kvc_iswa_set_full(kvc_iswa *c);
/* Empty both caches (the pending ranges are kept, as llama.cpp does). */
void kvc_iswa_clear(kvc_iswa *c);

/* --- the layer table --------------------------------------------------------------------- */

/* Which cache of the pair holds a model layer. */
enum kvc_iswa_part {
    KVC_ISWA_NONE = -1,  /* neither: a layer without K/V in the pair */
    KVC_ISWA_BASE = 0,
    KVC_ISWA_SWA  = 1,
};

/* The cache holding model layer il (enum kvc_iswa_part), *index its index in that cache's layer
 * table (kvc_unified_layer_index); KVC_ISWA_NONE and *index = -1 when neither holds it. The
 * pair's table is its caches' own tables, which hold no layer in common (kvc_iswa_init). */
int  kvc_iswa_layer(const kvc_iswa *c, int64_t il, int64_t *index);

/* The sequence operations, on both caches (arguments as kvc_unified's). seq_rm: true when both
 * removed. seq_cp: checked in both caches first (kvc_unified_seq_cp_check: KVC_E_ARG with err,
 * nothing changed), then copied in both. */
bool kvc_iswa_seq_rm(kvc_iswa *c, int32_t s, int32_t p0, int32_t p1);
int  kvc_iswa_seq_cp(kvc_iswa *c, int32_t src, int32_t dst, int32_t p0, int32_t p1, kvc_err *err);
void kvc_iswa_seq_keep(kvc_iswa *c, int32_t s);
void kvc_iswa_seq_add(kvc_iswa *c, int32_t s, int32_t p0, int32_t p1, int32_t shift);
void kvc_iswa_seq_div(kvc_iswa *c, int32_t s, int32_t p0, int32_t p1, int32_t d);

/* A sequence's positions are the SWA cache's: the cells the window still needs. */
static inline int32_t kvc_iswa_seq_pos_min(const kvc_iswa *c, int32_t s) { return kvc_unified_seq_pos_min(c->swa, s); }
static inline int32_t kvc_iswa_seq_pos_max(const kvc_iswa *c, int32_t s) { return kvc_unified_seq_pos_max(c->swa, s); }

/* Whether a K-shift may be applied: only when both caches have the same size (a smaller SWA cache
 * has dropped cells whose positions a shift would need; today's llama_memory_can_shift). */
static inline bool kvc_iswa_can_shift(const kvc_iswa *c) { return c->base->cells.size == c->swa->cells.size; }
/* Either cache has a pending K-shift. */
static inline bool kvc_iswa_has_shift(const kvc_iswa *c) {
    return kvc_unified_any_shift(c->base) || kvc_unified_any_shift(c->swa);
}
/* 2025: an update must refuse a pending shift it cannot apply (2026 shifts each cache's own
 * cells whatever can_shift says). */
static inline bool kvc_iswa_shift_refused(const kvc_iswa *c) {
    return c->base->ops->shift_refused_partial && kvc_iswa_has_shift(c) && !kvc_iswa_can_shift(c);
}

#ifdef __cplusplus
}
#endif

#endif
