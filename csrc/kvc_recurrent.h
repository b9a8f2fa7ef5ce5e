/* kvcache — the recurrent-state cache (llama_kv_cache_recurrent, today llama_memory_recurrent)
 * of Mamba / RWKV style models: one cell holds the whole rolling state of a sequence (or of
 * several sequences sharing it), so there is no attention window and no K-shift.
 *
 * Cell i has a position (the last one its state has seen), `src` (the cell whose
 * state must be copied in before the next step, -1 = start from zero), the set of
 * sequences sharing the state (word planes as kvc_seqset.h has them, listed in
 * ascending order), and
 * `tail`: cell i doubles as the record of sequence i, and tail is the index of the
 * cell holding that sequence's state (-1 = none). A cell is empty when its sequence
 * set is empty, whatever its position.
 *
 * Every operation reproduces the reference's behaviour, including its quirks (`used`
 * is a counter updated the way the reference updates it, s_copy / s_mask update
 * `src` in place). Where the reference would abort, these functions return an error
 * and change nothing. A cache is of one of two types for its whole life, mid-2025's
 * llama_kv_cache_recurrent or today's llama_memory_recurrent: what each does its own way
 * the operations reach through c->ops (kvc_recurrent_ops below; the two tables and
 * kvc_recurrent_init are in kvc_recurrent_ops.h). The cell table is kvc_rec_cells.h's; the
 * state codec is in kvc_recurrent_state.c.
 *
 * The K/V memory (per layer: `size` rows of K — the rolling state — and of V — the
 * recurrent state) is owned by the caller and attached with kvc_recurrent_set_layer_buffers;
 * NULL buffers make data operations no-ops. */
#ifndef KVC_RECURRENT_H
#define KVC_RECURRENT_H

#include "kvc_common.h"
#include "kvc_seqops.h"
#include "kvc_ubatch.h"
#include "kvc_seqset.h"
#include "kvc_rec_cells.h"
#include "kvc_state_plan.h"

#ifdef __cplusplus
extern "C" {
#endif

/* A layer (kvc_layer, kvc_common.h): il is its index; size rows of K (the rolling state part
 * included) and of V (the recurrent state part included). */

#define KVC_REC_WARN_CAP 1024
/* The most rollback snapshots a state keeps (llama.cpp sets no bound; each costs a copy of every
 * state). */
#define KVC_REC_MAX_RS_SEQ 64u

/* Which llama.cpp's recurrent memory a cache reproduces. */
enum kvc_rec_semantics {
    KVC_REC_2025 = 0,   /* llama_kv_cache_recurrent (mid-2025): s_copy / s_mask move `src` */
    KVC_REC_2026 = 1,   /* llama_memory_recurrent (today): s_copy reads `src0`, a zero row rs_z,
                         * rollback snapshots when n_rs_seq > 0 */
};

struct kvc_recurrent;
struct kvc_recurrent_params;

/* A recurrent cache type: what one semantics does its own way, for the operations and the layers
 * that serve both to call without asking which (the two types, kvc_recurrent_2025_ops and
 * kvc_recurrent_2026_ops, are in kvc_recurrent_ops.h). Both share the cell table, the sequence
 * operations, find_slot's placement and the state codec. */
typedef struct kvc_recurrent_ops {
    int32_t semantics;   /* enum kvc_rec_semantics: the llama.cpp the type follows (for its name) */
    /* construction: the parameters the type refuses (KVC_E_ARG with err) */
    int      (*check)(const struct kvc_recurrent_params *p, kvc_err *err);
    /* find_slot: what decides a search from cell 0 (the ubatch's sequences today, its tokens
     * mid-2025), and its end on table t once the groups' cells are [min, max] (today: the
     * sources s_copy reads, the zero row, the snapshot record; KVC_E_INTERNAL with err where
     * llama.cpp aborts) */
    uint32_t (*head_reset_count)(const kvc_ubatch *ub);
    int      (*stage)(const struct kvc_recurrent *c, kvc_rec_cells *t, uint32_t min, uint32_t max,
                      const kvc_ubatch *ub, kvc_err *err);
    /* seq_rm(s, p0, p1) on table t: the positions it rolls s's state back by, 0 when it is no
     * rollback (always, for a type without snapshots) */
    int32_t  (*rollback_len)(const kvc_rec_cells *t, int32_t s, int32_t p0, int64_t p1);
    /* the graph inputs (kvc_recurrent_s_copy / kvc_recurrent_s_mask) */
    int      (*s_copy)(struct kvc_recurrent *c, uint32_t count, int32_t *out);
    int      (*s_mask)(struct kvc_recurrent *c, uint32_t count, float *out);
    /* rules of the layers above */
    bool     checkpoints; /* the states may be checkpointed for prefix reuse (kvc_checkpoint.h) */
} kvc_recurrent_ops;

typedef struct kvc_recurrent {
    kvc_rec_cells  cells;       /* the live table */
    kvc_rec_cells  work;        /* same size; where find_slot / state_read build their result */
    uint32_t       n_seq_max;   /* valid sequence ids: [0, n_seq_max), n_seq_max <= size */
    int32_t        type_k;      /* ggml type id of K */
    int32_t        type_v;      /* ggml type id of V */
    uint32_t       n_layer;     /* number of layers */
    uint32_t       n_layer_model; /* the layer count its states say: n_layer, or the model's layers
                                   * when these are only its recurrent ones (a hybrid memory's
                                   * part; kvc_recurrent_set_model_layers) */
    kvc_layer     *layers;      /* [n_layer] */
    const kvc_recurrent_ops *ops; /* the cache's type: its semantics' rules */
    bool           can_unplace; /* work holds the table from before the last find_slot */
    uint32_t       n_rs_seq;    /* 2026: rollback snapshots per state; each layer's rows are
                                 * (1 + n_rs_seq) planes of size rows, plane p = the state p
                                 * tokens before the last one the cell's last ubatch saw */
    /* warnings of the last find_slot (the reference logs them), one per line */
    uint32_t       n_warn;      /* how many were raised (may exceed what fits in warn) */
    char           warn[KVC_REC_WARN_CAP]; /* NUL-terminated, lines separated by '\n' */
} kvc_recurrent;

typedef struct kvc_recurrent_params {
    uint32_t        kv_size;    /* number of cells, >= n_seq_max */
    uint32_t        n_seq_max;  /* 1..KVC_MAX_SEQ */
    int32_t         type_k, type_v;
    uint32_t        n_layer;    /* >= 1 */
    const uint32_t *n_embd_k;   /* [n_layer] K row widths, state part included */
    const uint32_t *n_embd_v;   /* [n_layer] V row widths, state part included */
    int32_t         semantics;  /* enum kvc_rec_semantics (0: 2025): the type kvc_recurrent_init makes */
    uint32_t        n_rs_seq;   /* 2026 only (0 for 2025): rollback snapshots per state, <= 64 */
} kvc_recurrent_params;

/* Validate params and initialise an empty cache of type ops (buffers NULL): KVC_OK, KVC_E_ARG (ops
 * NULL: p->semantics is unknown), KVC_E_NOMEM. kvc_recurrent_init (kvc_recurrent_ops.h) picks the
 * type p->semantics names. */
int  kvc_recurrent_construct(kvc_recurrent *c, const kvc_recurrent_params *p, const kvc_recurrent_ops *ops,
                             kvc_err *err);
void kvc_recurrent_free(kvc_recurrent *c);
/* Attach the K/V memory of layer il (size * (1 + n_rs_seq) rows each; either may be NULL). */
void kvc_recurrent_set_layer_buffers(kvc_recurrent *c, uint32_t il, uint8_t *k, uint8_t *v);
/* Make the layers the recurrent ones of a model of n_layer_model layers: layer k is the model's
 * model_il[k] (ascending, below n_layer_model). Its states then say n_layer_model layers and keep
 * records for its own (llama.cpp's recurrent memory skips the layers without a state), and
 * messages name the model's layers. KVC_OK, or KVC_E_ARG with err. */
int  kvc_recurrent_set_model_layers(kvc_recurrent *c, uint32_t n_layer_model, const uint32_t *model_il,
                                    kvc_err *err);

/* --- operations; sequence ids are validated by the caller (C5), positions are any int32 --- */
/* clear, seq_rm, seq_cp, seq_keep, seq_add and seq_div below, as the table of kvc_seqops.h. */
extern const kvc_seq_ops kvc_recurrent_seq_ops;
/* Empty every cell (pos, src, tail -1), head = used = 0, zero the K/V buffers; n is kept. */
void    kvc_recurrent_clear(kvc_recurrent *c);
/* Remove [p0, p1) of sequence s (s -1: every sequence, only for an empty or the whole range).
 * false when that would cut a state in two (nothing changes then). 2026: a range that takes
 * the tail of s's state from p0 > 0 on is a rollback to position p0 - 1 (kvc_recurrent_rollback_ok
 * says whether it is accepted); any other cut is refused as mid-2025's llama.cpp refused it
 * (rule C9: today's answers true and keeps the whole state). */
bool    kvc_recurrent_seq_rm(kvc_recurrent *c, int32_t s, int32_t p0, int32_t p1);
/* dst shares src's state (dst's own state is dropped). The range is not used. */
void    kvc_recurrent_seq_cp(kvc_recurrent *c, int32_t src, int32_t dst, int32_t p0, int32_t p1);
void    kvc_recurrent_seq_keep(kvc_recurrent *c, int32_t s);
/* Shift / divide the position of s's state when it lies in [p0, p1) (d 0 is ignored). */
void    kvc_recurrent_seq_add(kvc_recurrent *c, int32_t s, int32_t p0, int32_t p1, int32_t shift);
void    kvc_recurrent_seq_div(kvc_recurrent *c, int32_t s, int32_t p0, int32_t p1, int32_t d);
int32_t kvc_recurrent_seq_pos_min(const kvc_recurrent *c, int32_t s);
int32_t kvc_recurrent_seq_pos_max(const kvc_recurrent *c, int32_t s);

/* 2026: the number of positions seq_rm(s, p0, -1) rolls s's state back by (its position - p0 + 1),
 * 0 when the range is no rollback (p0 <= 0, no state, or p0 past the state). */
int32_t kvc_recurrent_rollback_len(const kvc_recurrent *c, int32_t s, int32_t p0);
/* 2026: whether a rollback of r positions of s's state is accepted. llama.cpp's rule: none
 * pending for s, 1 <= r <= n_rs_seq. kvcache's rule C9 on top: the state's last ubatch saw more
 * than r of its tokens (its snapshot plane r holds the state r tokens back; llama.cpp accepts a
 * rollback past them and reads an older plane), and no other sequence shares the state. */
bool    kvc_recurrent_rollback_ok(const kvc_recurrent *c, int32_t s, int32_t r);

/* Place a ubatch of n_seqs groups of n_seq_tokens tokens: group k's state ends up in cell
 * head + k. 1 = placed, 0 = the reference's sanity check failed (n < n_seqs; the cells are
 * changed as the reference changes them). Errors change nothing: KVC_E_ARG (empty ubatch, a
 * sequence id outside [0, n_seq_max), or a sequence in two groups), KVC_E_NOSPACE (no empty
 * cell for a sequence that needs one), KVC_E_INTERNAL (a sequence's tail cell does not hold it:
 * after seq_rm(-1, ...) without clear, or after a find_slot that lost its state; the reference
 * aborts). Warnings go to c->warn / c->n_warn. */
int     kvc_recurrent_find_slot(kvc_recurrent *c, const kvc_ubatch *ub, kvc_err *err);
/* Undo the last find_slot that placed (returned 0 or 1): the cells, counters and warnings as they
 * were before it. Valid only with no other change since (a composite cache whose other part then
 * failed); KVC_E_ARG (nothing changes) when no such find_slot is recorded. */
int     kvc_recurrent_unplace(kvc_recurrent *c);
/* The dry run of placing ubs[0 .. n_ub) in turn (each against the state holding the ones before
 * it), as llama.cpp's prepare: 1 every one placed, 0 one failed the sanity check, an error as
 * find_slot's (err). The cache is left exactly as it was. */
int     kvc_recurrent_prepare(kvc_recurrent *c, const kvc_ubatch *ubs, uint32_t n_ub, kvc_err *err);
void    kvc_recurrent_commit(kvc_recurrent *c);   /* nothing to commit */
void    kvc_recurrent_restore(kvc_recurrent *c);  /* nothing is ever pending: a no-op */
void    kvc_recurrent_set_full(kvc_recurrent *c); /* n = size, head = 0 */

/* The graph inputs for cells head + i, i in [0, count): s_copy is the cell to copy the state
 * from, s_mask 1.0 when the state is kept, 0.0 when it starts from zero. 2025: both update src in
 * place as the reference does (so a second call answers differently). 2026: s_copy is the row
 * (plane * size + src0) to read, the plane a pending rollback of the cell's first sequence
 * (which s_copy then consumes); s_mask is KVC_E_ARG (today's graph zeroes row rs_z instead).
 * KVC_E_ARG when head + count > size (nothing changes). */
int     kvc_recurrent_s_copy(kvc_recurrent *c, uint32_t count, int32_t *out);
int     kvc_recurrent_s_mask(kvc_recurrent *c, uint32_t count, float *out);
/* Index + 1 of the last cell with pos >= 0 and a sequence, or 0. */
uint32_t kvc_recurrent_cell_max(const kvc_recurrent *c);

/* Write rows [head, head + n_rows) of layer il: k holds n_rows rows of k_row_bytes, v of
 * v_row_bytes; either may be NULL. KVC_E_ARG when il or the rows are out of range. */
int     kvc_recurrent_store(kvc_recurrent *c, uint32_t il, uint32_t n_rows, const void *k, const void *v);
/* The same into snapshot plane `plane` (0 = the current states, as kvc_recurrent_store; p in
 * [1, n_rs_seq]: the states p tokens back). KVC_E_ARG when plane > n_rs_seq. */
int     kvc_recurrent_store_plane(kvc_recurrent *c, uint32_t il, uint32_t plane, uint32_t n_rows, const void *k,
                                  const void *v);

/* Give sequence seq_id, which holds no state, a cell whose state the caller then writes (its
 * position pos), placed as the sequence state reader places a state: *cell is that cell (the
 * rows of plane 0). KVC_OK; KVC_E_ARG (a bad id or position, or the sequence holds a state),
 * KVC_E_NOSPACE (no cell) with nothing changed. kvc_recurrent_unplace undoes it. */
int     kvc_recurrent_seq_restore(kvc_recurrent *c, int32_t seq_id, int32_t pos, uint32_t *cell, kvc_err *err);

/* --- state codec (the bytes: docs/format.md, "A section") ---------------------------------- */
/* Bytes state_write would produce for seq_id (-1 = whole cache). */
size_t  kvc_recurrent_state_size(const kvc_recurrent *c, int32_t seq_id);
/* Write the state of seq_id (-1 = all) into out[0, cap): KVC_OK with *written, or
 * KVC_E_NOSPACE when cap is too small. */
int     kvc_recurrent_state_write(const kvc_recurrent *c, int32_t seq_id, uint8_t *out, size_t cap, size_t *written);
/* Read one cache state from data[0, len) into seq_id (-1 = whole cache). KVC_OK with *consumed
 * (trailing bytes are not read). On failure KVC_E_STATE (or KVC_E_ARG for a bad seq_id), err
 * says why, and nothing at all has changed (cells, counters, every K/V byte). A single-sequence
 * part with cell_count 0 removes seq_id; one with more than one cell is rejected; negative
 * positions and sequence ids outside [0, n_seq_max) are rejected. */
int     kvc_recurrent_state_read(kvc_recurrent *c, int32_t seq_id, const uint8_t *data, size_t len,
                                 size_t *consumed, kvc_err *err);
/* The same with flags (enum kvc_state_flags of kvc_state.h; only KVC_STATE_EXACT applies: a
 * recurrent cache never stores V transposed). */
int     kvc_recurrent_state_read_ex(kvc_recurrent *c, int32_t seq_id, const uint8_t *data, size_t len,
                                    unsigned flags, size_t *consumed, kvc_err *err);
/* The rows of seq_id's single-sequence state, in the order the state lists them: for each layer
 * its K (R) row, then for each layer its V (S) row (2 * n_layer entries). Entry k: rows[k] the
 * row's address in the plane the state is written from (NULL without memory), offs[k] its offset
 * in the state without the sequence-blob prefix, lens[k] its bytes. Returns the cells the state
 * lists: 1, or 0 when seq_id (in [0, n_seq_max)) holds no state (no entry filled). A hand-off
 * moves these rows as regions and the rest of the state in its header. */
uint32_t kvc_recurrent_seq_rows(const kvc_recurrent *c, int32_t seq_id, const uint8_t **rows, uint64_t *offs,
                                uint64_t *lens);

/* --- two-phase reading: a recurrent part read together with other parts, all or nothing ---- */
/* Validate the part at data[0, len) (no sequence-blob prefix) for seq_id and build the cell table
 * it gives in c's work table. Nothing observable in c changes; only a kvc_recurrent_unplace is no
 * longer possible. KVC_OK with the part's fields of plan filled (data, seq_id, cell_count,
 * data_off, len; it owns nothing), or a negative code with err. */
int     kvc_recurrent_state_prepare(kvc_recurrent *c, int32_t seq_id, const uint8_t *data, size_t len,
                                    unsigned flags, kvc_state_plan *plan, kvc_err *err);
/* Apply a plan kvc_recurrent_state_prepare made against c, unchanged since. */
void    kvc_recurrent_state_apply(kvc_recurrent *c, const kvc_state_plan *plan);
/* Bytes [offset, offset + cap) of the blob state_write produces (see
 * kvc_unified_state_write_range). KVC_OK or KVC_E_NOMEM. */
int     kvc_recurrent_state_write_range(const kvc_recurrent *c, int32_t seq_id, uint64_t offset, uint8_t *out,
                                        size_t cap, size_t *written);
/* The same in a layout (enum kvc_layout_bits of kvc_state.h). A recurrent memory state has the
 * seed's shape in every layout: only KVC_LAYOUT_PREFIX applies (single sequences). The reader
 * takes a prefix when the layout has one or is KVC_LAYOUT_DETECT; an empty single-sequence state
 * removes the destination in every layout (llama.cpp's recurrent memory did so throughout). */
size_t  kvc_recurrent_state_size_lay(const kvc_recurrent *c, int32_t seq_id, unsigned layout);
int     kvc_recurrent_state_write_range_lay(const kvc_recurrent *c, int32_t seq_id, unsigned layout,
                                            uint64_t offset, uint8_t *out, size_t cap, size_t *written);
int     kvc_recurrent_state_read_lay(kvc_recurrent *c, int32_t seq_id, const uint8_t *data, size_t len,
                                     unsigned flags, unsigned layout, size_t *consumed, kvc_err *err);

/* --- for the recurrent cache's own modules (kvc_recurrent_state.c, kvc_recurrent_ops.c) ---- */
/* seq_rm on table t of c (the live table or the work copy). */
bool    kvc_recurrent_table_seq_rm(const kvc_recurrent *c, kvc_rec_cells *t, int32_t s, int32_t p0, int32_t p1);
/* Give sequence seq_id, which holds no state in w, a cell of w whose state is kept as it is, at
 * position pos: the reference's find_slot of one token, as its sequence state reader does.
 * KVC_OK, or KVC_E_STATE with err (no cell). */
int     kvc_recurrent_place_one(kvc_recurrent *c, kvc_rec_cells *w, int32_t seq_id, int32_t pos, kvc_err *err);
void    kvc_recurrent_swap_work(kvc_recurrent *c);   /* the work table becomes the live one */
void    kvc_recurrent_zero_data(kvc_recurrent *c);   /* every row of every plane of every layer */

#ifdef __cplusplus
}
#endif

#endif
