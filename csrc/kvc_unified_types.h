/* kvcache — the unified cache's struct (llama_kv_cache_unified's state) and the accessors that
 * only read or set its fields. Below every module that works on the cache: the defragmentation
 * plan (kvc_defrag.h), the operations (kvc_unified.h), placement (kvc_slot.h), the mask
 * (kvc_mask.h) and the state codec (kvc_state.h) all include it; it includes none of them. */
#ifndef KVC_UNIFIED_TYPES_H
#define KVC_UNIFIED_TYPES_H

#include "kvc_common.h"
#include "kvc_cells.h"
#include "kvc_ubatch.h"
#include "kvc_undo.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum kvc_swa_type {
    KVC_SWA_NONE     = 0,
    KVC_SWA_STANDARD = 1,  /* masked when p1 - p0 >= n_swa */
    KVC_SWA_CHUNKED  = 2,  /* masked when p0 < (p1 / n_swa) * n_swa */
} kvc_swa_type;

/* Which llama.cpp the cache follows: the seed (mid-2025: one cell table, contiguous placement
 * with commit/restore, defragmentation) or today's (streams, scattered placement that is final,
 * stream copies, no defragmentation). Each is a cache type of its own (kvc_unified_ops below),
 * chosen at construction. */
typedef enum kvc_semantics {
    KVC_SEM_2025 = 0,
    KVC_SEM_2026 = 1,
} kvc_semantics;

/* n_defrag_runs of a plan whose runs are known from defrag_ids alone */
#define KVC_RUNS_FROM_IDS UINT32_MAX

/* n_kv of a 2026 stream is padded to a multiple of at least this many cells */
#define KVC_N_KV_PAD_MIN 256u

/* A stream of a 2026 cache beyond the first: its own cell table and head (stream 0 is the
 * cache's `cells` / `head`, so that every single-table operation sees stream 0). */
typedef struct kvc_stream {
    kvc_cells cells;
    uint32_t  head;
} kvc_stream;

/* The layers (kvc_layer, kvc_common.h): K rows n_stream * size (stream s: rows s * size ..); V
 * likewise, or transposed per stream n_embd_v rows of size elements. */

/* Where the last successful find_slot put its ubatch (kvc_slot.h reads it through
 * kvc_unified_slot_cell): token t is in cell head + t, or, for a type that places tokens in
 * scattered cells, in cells[t] (the cache's kvc_scatter.idx, set at construction).
 * n == 0: nothing is placed. */
typedef struct kvc_slot {
    uint32_t       head, n;
    const int32_t *cells;   /* NULL: the placement is the run from head */
} kvc_slot;

/* Where the last successful 2026 find_slot put its ubatch: token g * n_seq_tokens + i of group
 * g went to cell idx[g * n_seq_tokens + i] of stream strm[g] (the buffers are the cache's, of
 * n_stream * size and n_stream entries; kvc_slot.n counts the tokens). */
typedef struct kvc_scatter {
    int32_t  *idx;          /* [n_stream * size] */
    uint32_t *strm;         /* [n_stream] */
    uint32_t  n_groups, n_seq_tokens;
} kvc_scatter;

struct kvc_unified_ops;
struct kvc_unified_params;

typedef struct kvc_unified {
    /* the cell table and the state that goes with it (head, placement, undo log) */
    kvc_cells  cells;        /* the cell table */
    uint32_t   head;         /* where the next slot search starts */
    kvc_slot   slot;         /* the last placement, until an operation changes the cells */
    const struct kvc_unified_ops *ops; /* the cache's type: its semantics' rules */
    /* semantics 2026 (KVC_SEM_2026): streams, scattered placement, stream copies */
    uint32_t   n_stream;     /* 1, or n_seq_max (kv_unified false): sequence s in stream s */
    kvc_stream *more;        /* [n_stream - 1] streams 1.. */
    kvc_scatter scatter;     /* the cells of the last placement (2026) */
    uint32_t  *copy_src, *copy_dst; /* [n_copies] stream copies queued for the next update */
    uint32_t   n_copies, cap_copies;
    kvc_undo   undo;         /* what the find_slot calls since the last commit overwrote */
    /* the whole cache */
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
    /* defragmentation (kvc_defrag.h) */
    bool       do_defrag;    /* set by defrag_sched, cleared by defrag_move / update */
    uint32_t  *defrag_ids;   /* [size] cell i moves to ids[i] (plan of the last defrag_prepare) */
    uint32_t   n_defrag_ids; /* length of the plan (used_max_p1 when it was made) */
    uint32_t  *defrag_run_list; /* [3 * n_defrag_runs] the plan's runs as kvc_unified_defrag_runs
                              * gives them, written by the planner along with defrag_ids */
    uint32_t   n_defrag_runs;  /* how many; KVC_RUNS_FROM_IDS: read them from defrag_ids (a plan
                              * that was written there by other means) */
    uint32_t   cap_defrag_runs;
    bool       defrag_pending; /* the plan's cells moved, their K/V rows not yet */
    uint32_t   n_threads;    /* threads a large K/V move may use; 0: kvc_parallel_width() */
    bool       vector_moves; /* transposed-V moves may take the vector path (decided at init) */
    struct kvc_mask_memo *mask_memo; /* the last mask buffer written with kvc_unified_kq_mask_reuse
                                      * (kvc_mask.h), NULL before */
    /* the per-cell extension (2026 only): every stream's table has one when the cache has it */
    bool       ple;          /* every ubatch sets the extension, a ubatch without token ids
                              * storing ple_token (llama.cpp's per-layer-embedding models) */
    int32_t    ple_token;
    /* prefix reuse (kvc_reuse.h, 2026 only): the index of the cells kept for later requests and
     * which cells it holds; NULL while reuse is off, which leaves every operation as llama.cpp's */
    struct kvc_reuse *reuse;
    /* sequence imports begun (kvc_handoff.h), not yet committed or aborted: the cells they
     * reserved and the snapshot they commit against must not change, so the bridge's lock
     * (kvc_lock.h) refuses every change while this is nonzero */
    uint32_t   imports;
} kvc_unified;

typedef struct kvc_unified_params {
    uint32_t        kv_size;     /* cells (of each stream) */
    int32_t         semantics;   /* kvc_semantics (0: the seed's) */
    bool            stream_per_seq; /* 2026: a stream per sequence (llama.cpp kv_unified false) */
    uint32_t        n_seq_max;   /* 1..KVC_MAX_SEQ */
    uint32_t        n_pad;       /* > 0, divides kv_size */
    uint32_t        n_swa;
    int32_t         swa_type;
    int32_t         type_k, type_v;
    bool            v_trans;     /* requires a V type with block size 1 */
    uint32_t        n_layer;     /* kept layers */
    const int32_t  *layer_il;    /* [n_layer] model layer indices */
    const uint32_t *n_embd_k;    /* [n_layer] */
    const uint32_t *n_embd_v;    /* [n_layer] */
    bool            cell_ext;    /* 2026: the per-cell extension (kvc_cells.h), as llama.cpp gives the
                                  * caches of M-RoPE and per-layer-embedding models */
    bool            ple;         /* with cell_ext: kvc_unified.ple */
    int32_t         ple_token;
} kvc_unified_params;

struct kvc_state_plan;
struct kvc_handoff_import;

/* A unified cache type: what one semantics does its own way, for the layers that serve both to
 * call without asking which (the two types, kvc_unified_2025_ops and kvc_unified_2026_ops, are in
 * kvc_unified_ops.h; each entry's function is documented where it is defined). Both share the
 * cell table, the sequence operations, the state writer and the section parser. */
typedef struct kvc_unified_ops {
    int32_t semantics;   /* kvc_semantics: the llama.cpp the type follows (for its name) */
    /* construction (kvc_unified.c): the parameters the type refuses (KVC_E_ARG with err), and
     * what it adds to the shared construction (KVC_OK or KVC_E_NOMEM) */
    int  (*check)(const struct kvc_unified_params *p, kvc_err *err);
    int  (*init)(struct kvc_unified *c, const struct kvc_unified_params *p);
    /* placement (kvc_slot.c): a ubatch, a ubatch into several caches all or nothing (found[k]:
     * cache k found room), the placed tokens' rows of one layer */
    int  (*find_slot)(struct kvc_unified *c, const kvc_ubatch *ub, kvc_err *err);
    int  (*find_slot_parts)(struct kvc_unified *const *cs, uint32_t n, const kvc_ubatch *ub, int *found,
                            kvc_err *err);
    void (*store)(struct kvc_unified *c, const kvc_layer *ly, uint32_t n_tokens, const uint8_t *k,
                  const uint8_t *v);
    /* the attention's columns (kvc_mask.c): of stream 0, and for placed ubatch ub with its token
     * groups (strm[g] the stream of group g, n_seq_tokens tokens each; KVC_E_ARG with err) */
    uint32_t (*n_kv)(const struct kvc_unified *c);
    int  (*kv_groups)(const struct kvc_unified *c, const kvc_ubatch *ub, uint32_t *strm, uint32_t *n_groups,
                      uint32_t *n_seq_tokens, uint32_t *n_kv, kvc_err *err);
    /* the state reader (kvc_state_2025.c / kvc_state_2026.c) */
    bool ids_once;       /* a cell record's sequence ids are each listed once */
    int  (*state_prepare)(struct kvc_unified *c, int32_t seq_id, const uint8_t *data, size_t len, unsigned flags,
                          unsigned layout, struct kvc_state_plan *plan, kvc_err *err);
    int  (*state_apply)(struct kvc_unified *c, const struct kvc_state_plan *plan);
    /* the hand-off of a sequence (kvc_handoff.c): the layout of its header's cells, the cells an
     * import reserves (a dry run), what it keeps for its abort besides the snapshot, and the
     * commit's placement */
    unsigned handoff_layout;
    int  (*handoff_reserve)(struct kvc_unified *c, struct kvc_handoff_import *imp, bool evict, kvc_err *err);
    bool (*handoff_save)(struct kvc_handoff_import *imp);
    int  (*handoff_place)(struct kvc_handoff_import *imp, kvc_err *err);
    /* rules of the layers above */
    bool prefix_reuse;   /* the prefix index may be kept (kvc_reuse.h) */
    bool shift_refused_partial; /* an iSWA update refuses a shift a partial SWA cache cannot make */
} kvc_unified_ops;

/* Whether the cache holds K/V memory (the owner attaches it to every layer or to none). */
static inline bool kvc_unified_has_memory(const kvc_unified *c) {
    for (uint32_t l = 0; l < c->n_layer; l++) {
        if (c->layers[l].k || c->layers[l].v) {
            return true;
        }
    }
    return false;
}

/* --- streams (one for a 2025 cache) --------------------------------------------------- */
static inline kvc_cells *kvc_unified_stream_cells(kvc_unified *c, uint32_t s) {
    return s ? &c->more[s - 1].cells : &c->cells;
}
static inline const kvc_cells *kvc_unified_stream_cells_c(const kvc_unified *c, uint32_t s) {
    return s ? &c->more[s - 1].cells : &c->cells;
}
static inline uint32_t *kvc_unified_stream_head(kvc_unified *c, uint32_t s) {
    return s ? &c->more[s - 1].head : &c->head;
}
static inline uint32_t kvc_unified_stream_head_c(const kvc_unified *c, uint32_t s) {
    return s ? c->more[s - 1].head : c->head;
}
/* The stream of (valid) sequence s. */
static inline uint32_t kvc_unified_stream_of(const kvc_unified *c, int32_t s) {
    return c->n_stream == 1 ? 0 : (uint32_t)s;
}

static inline int32_t kvc_unified_seq_pos_min(const kvc_unified *c, int32_t s) {
    return kvc_cells_seq_pos_min(kvc_unified_stream_cells_c(c, kvc_unified_stream_of(c, s)), s);
}
static inline int32_t kvc_unified_seq_pos_max(const kvc_unified *c, int32_t s) {
    return kvc_cells_seq_pos_max(kvc_unified_stream_cells_c(c, kvc_unified_stream_of(c, s)), s);
}

/* Whether the cache's cells carry the per-cell extension. */
static inline bool kvc_unified_has_ext(const kvc_unified *c) { return c->cells.ext != NULL; }
/* The streams the state codec walks (kvc_state.c: a section per stream): 1 for a 2025 cache. */
static inline uint32_t kvc_unified_n_stream(const kvc_unified *c) { return c->n_stream; }

/* The sliding window, the one definition the mask and the pruning share: a query at position p1
 * sees the keys at positions >= kvc_unified_swa_start(c, p1) (standard: masked when
 * p1 - p0 >= n_swa; chunked: masked before the chunk holding p1); without a window, every key. */
static inline int64_t kvc_unified_swa_start(const kvc_unified *c, int32_t p1) {
    switch (c->swa_type) {
    case KVC_SWA_STANDARD:
        return (int64_t)p1 - c->n_swa + 1;
    case KVC_SWA_CHUNKED:
        return ((int64_t)p1 / c->n_swa) * c->n_swa;
    default:
        return INT64_MIN;
    }
}

/* Is the pair (key position p0, query position p1) outside the sliding window? */
static inline bool kvc_unified_is_masked_swa(const kvc_unified *c, int32_t p0, int32_t p1) {
    return p0 < kvc_unified_swa_start(c, p1);
}

/* Forget the placement (kvc_slot.h): every operation that changes which cells hold what does. */
static inline void kvc_unified_slot_drop(kvc_unified *c) { c->slot.n = 0; }

#ifdef __cplusplus
}
#endif

#endif
