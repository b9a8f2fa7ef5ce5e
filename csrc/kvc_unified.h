/* kvcache — the unified KV cache (llama_kv_cache_unified): cells, slot search,
 * sequence operations, recovery, KQ mask, position buckets, K-shift input,
 * defragmentation, and the per-layer K/V buffers it manages.
 *
 * The K/V memory is not allocated here: the owner (the Python layer) attaches
 * one K and one V buffer per kept layer with kvc_unified_set_layer_buffers, or
 * leaves them NULL for a metadata-only cache (then data operations are no-ops). */
#ifndef KVC_UNIFIED_H
#define KVC_UNIFIED_H

#include "kvc_common.h"
#include "kvc_cells.h"
#include "kvc_ubatch.h"
#include "kvc_mask.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum kvc_swa_type {
    KVC_SWA_NONE     = 0,
    KVC_SWA_STANDARD = 1,  /* masked when p1 - p0 >= n_swa */
    KVC_SWA_CHUNKED  = 2,  /* masked when p0 < (p1 / n_swa) * n_swa */
} kvc_swa_type;

typedef struct kvc_layer {
    int32_t  il;           /* model layer index */
    uint32_t n_embd_k;     /* K row width in elements */
    uint32_t n_embd_v;     /* V row width in elements */
    size_t   k_row_bytes;  /* kvc_row_size(type_k, n_embd_k) */
    size_t   v_row_bytes;  /* kvc_row_size(type_v, n_embd_v) */
    uint8_t *k;            /* size rows of k_row_bytes, or NULL */
    uint8_t *v;            /* size rows of v_row_bytes; transposed: n_embd_v rows of size elements */
} kvc_layer;

/* One find_slot's snapshot of cells [i, i + n): entries [off, off + n) of the arena. */
typedef struct kvc_recovery {
    uint32_t i, n, off;
} kvc_recovery;

typedef struct kvc_unified {
    kvc_cells  cells;        /* the cell table */
    uint32_t   head;         /* where the next slot search starts */
    uint32_t   n;            /* cells the attention looks at (the mask's columns) */
    uint32_t   n_seq_max;    /* valid sequence ids: [0, n_seq_max) */
    uint32_t   n_pad;        /* kv_size and n are multiples of it */
    uint32_t   n_swa;        /* sliding window size (0 with KVC_SWA_NONE) */
    int32_t    swa_type;     /* kvc_swa_type */
    int32_t    type_k;       /* ggml type id of K */
    int32_t    type_v;       /* ggml type id of V */
    bool       v_trans;      /* V stored transposed */
    uint32_t   n_layer;      /* kept layers */
    kvc_layer *layers;       /* [n_layer] in model order */
    /* recovery: snapshots of the cells each find_slot overwrote since the last commit */
    kvc_recovery *rec;       /* [n_rec] in find_slot order */
    uint32_t   n_rec, cap_rec;
    int32_t   *rec_pos;      /* arena of snapshot positions */
    uint64_t  *rec_seq;      /* arena of snapshot sequence words */
    uint32_t   n_rec_arena, cap_rec_arena;
    /* defragmentation */
    bool       do_defrag;    /* set by defrag_sched, cleared by defrag_apply / update */
    uint32_t  *defrag_ids;   /* [size] cell i moves to ids[i] (plan of the last defrag_prepare) */
    uint32_t   n_defrag_ids; /* length of the plan (used_max_p1 when it was made) */
} kvc_unified;

typedef struct kvc_unified_params {
    uint32_t        kv_size;
    uint32_t        n_seq_max;   /* 1..64 */
    uint32_t        n_pad;       /* > 0, divides kv_size */
    uint32_t        n_swa;
    int32_t         swa_type;
    int32_t         type_k, type_v;
    bool            v_trans;     /* requires a V type with block size 1 */
    uint32_t        n_layer;     /* kept layers */
    const int32_t  *layer_il;    /* [n_layer] model layer indices */
    const uint32_t *n_embd_k;    /* [n_layer] */
    const uint32_t *n_embd_v;    /* [n_layer] */
} kvc_unified_params;

/* Validate params and initialise (buffers NULL). KVC_OK, KVC_E_ARG (err says why), KVC_E_NOMEM. */
int  kvc_unified_init(kvc_unified *c, const kvc_unified_params *p, kvc_err *err);
void kvc_unified_free(kvc_unified *c);
/* Attach the K/V memory of kept layer `ikv` (index into layers, not the model index). */
void kvc_unified_set_layer_buffers(kvc_unified *c, uint32_t ikv, uint8_t *k, uint8_t *v);

/* --- operations; sequence ids and positions are validated by the caller ---------------- */
void    kvc_unified_clear(kvc_unified *c);           /* also zeroes the K/V buffers; n kept */
/* Zero the K/V data of cells [from, to) (every layer; columns of a transposed V). */
void    kvc_unified_zero_cells(kvc_unified *c, uint32_t from, uint32_t to);
bool    kvc_unified_seq_rm(kvc_unified *c, int32_t s, int32_t p0, int32_t p1); /* s -1 = any */
void    kvc_unified_seq_cp(kvc_unified *c, int32_t src, int32_t dst, int32_t p0, int32_t p1);
void    kvc_unified_seq_keep(kvc_unified *c, int32_t s);
void    kvc_unified_seq_add(kvc_unified *c, int32_t s, int32_t p0, int32_t p1, int32_t shift);
void    kvc_unified_seq_div(kvc_unified *c, int32_t s, int32_t p0, int32_t p1, int32_t d); /* d > 0 */
static inline int32_t kvc_unified_seq_pos_min(const kvc_unified *c, int32_t s) { return kvc_cells_seq_pos_min(&c->cells, s); }
static inline int32_t kvc_unified_seq_pos_max(const kvc_unified *c, int32_t s) { return kvc_cells_seq_pos_max(&c->cells, s); }

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

/* Slide the window of sequence s after a batch spanning [pmin, pmax] (iSWA commit): the cells of
 * s that no position up to pmax can see lose s. Returns 1 when fewer than min(n_swa, pmin)
 * cells of s were visible from pmin (a partial SWA cache: information may be lost), 0 otherwise,
 * KVC_E_ARG for a cache without a sliding window. */
int     kvc_unified_prune_swa(kvc_unified *c, int32_t s, int32_t pmin, int32_t pmax);

/* Is the pair (key position p0, query position p1) outside the sliding window? */
bool    kvc_unified_is_masked_swa(const kvc_unified *c, int32_t p0, int32_t p1);


/* KQ mask into out[rows][c->n], rows = kvc_pad_u32(n_tokens, KVC_KQ_MASK_PAD) (the caller
 * allocated it): a token sees a cell when the cell holds the token's first sequence id, is not
 * in its future (causal) and not outside the sliding window. Padding rows see nothing.
 * KVC_OK or KVC_E_NOMEM (out untouched). */
int     kvc_unified_kq_mask(const kvc_unified *c, const kvc_ubatch *ub, bool causal, bool alibi,
                            int dtype, void *out);
/* T5 relative position buckets into out[n_tokens][c->n]. */
void    kvc_unified_pos_bucket(const kvc_unified *c, const kvc_ubatch *ub, uint32_t n_buckets, int32_t *out);
int32_t kvc_relative_position_bucket(int32_t p0, int32_t p1, uint32_t n_buckets);
/* The per-cell shift input: out[i] = shift of cell i (0 when empty), i < size. */
void    kvc_unified_k_shift(const kvc_unified *c, int32_t *out);

/* Schedule a defrag when fragmentation (n >= 2048) exceeds thold. */
void    kvc_unified_defrag_sched(kvc_unified *c, float thold);
/* Plan a defrag (moves the cell metadata, fills defrag_ids). 1 = something to move, 0 = not. */
int     kvc_unified_defrag_prepare(kvc_unified *c, int32_t n_max_nodes);
/* The last plan as runs: cells [src, src + n) move to [dst, dst + n); writes 3 values per run
 * into runs (when not NULL) and returns the number of runs. */
uint32_t kvc_unified_defrag_runs(const kvc_unified *c, uint32_t *runs);
/* Move the K/V data as the last plan says (contiguous runs at once). */
void    kvc_unified_defrag_move(kvc_unified *c);

/* --- undoing find_slot calls exactly ---------------------------------------------------- */
/* What the find_slot calls change besides the cells: head, n and the recovery stack. A mark
 * taken before them lets kvc_unified_rewind undo them all, e.g. when a composite operation
 * (the two caches of an iSWA cache) fails in its second part after the first succeeded. */
typedef struct kvc_unified_mark {
    uint32_t head, n;
    uint32_t n_rec, n_rec_arena;
} kvc_unified_mark;
void kvc_unified_mark_take(const kvc_unified *c, kvc_unified_mark *m);
/* Undo every find_slot since m was taken, newest first: the cells they filled get back their
 * previous positions and sequences, head and n their marked values. Only find_slot calls may
 * have changed c since the mark (KVC_E_ARG, nothing changed, when the recovery stack is
 * shorter than at the mark, e.g. after a commit). */
int  kvc_unified_rewind(kvc_unified *c, const kvc_unified_mark *m);

/* --- whole-object snapshot, for operations that must leave no trace on failure ---------- */
typedef struct kvc_unified_snapshot {
    kvc_cells cells;
    uint32_t  head, n;
    uint32_t  n_rec, n_rec_arena;
    kvc_recovery *rec;
    int32_t  *rec_pos;
    uint64_t *rec_seq;
    bool      do_defrag;
} kvc_unified_snapshot;
int  kvc_unified_snapshot_take(const kvc_unified *c, kvc_unified_snapshot *s);   /* KVC_OK / NOMEM */
void kvc_unified_snapshot_restore(kvc_unified *c, const kvc_unified_snapshot *s); /* metadata only */
void kvc_unified_snapshot_free(kvc_unified_snapshot *s);

#ifdef __cplusplus
}
#endif

#endif
