/* kvcache — the unified KV cache (llama_kv_cache_unified): its state, construction, the
 * sequence operations, the sliding window and the per-layer K/V buffers it manages.
 *
 * The struct and its field accessors are in kvc_unified_types.h, below this header. The rest of
 * the cache is declared by concept: kvc_defrag.h (defragmentation, below the operations: each
 * settles a pending plan first), and above this header kvc_slot.h (slot search, the undo log,
 * snapshots, storing a ubatch's rows), kvc_mask.h (the KQ mask), kvc_kshift.h (the K-shift of
 * the K memory), kvc_state.h (the state codec), and at the top kvc_unified_ops.h (the two cache
 * types, one per semantics, and kvc_unified_init). csrc/LAYERS lists the order.
 *
 * The K/V memory is not allocated here: the owner (the Python layer) attaches
 * one K and one V buffer per kept layer with kvc_unified_set_layer_buffers, or
 * leaves them NULL for a metadata-only cache (then data operations are no-ops). */
#ifndef KVC_UNIFIED_H
#define KVC_UNIFIED_H

#include "kvc_common.h"
#include "kvc_seqops.h"
#include "kvc_cells.h"
#include "kvc_ubatch.h"
#include "kvc_unified_types.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The construction both cache types share (kvc_unified_init, kvc_unified_ops.h, picks the type):
 * validate params and initialise a cache of type ops (buffers NULL); ops NULL: params name no
 * semantics. KVC_OK, KVC_E_ARG (err says why), KVC_E_NOMEM. */
int  kvc_unified_construct(kvc_unified *c, const kvc_unified_params *p, const kvc_unified_ops *ops, kvc_err *err);
/* The seed's type refuses what only today's cells have: streams and the per-cell extension
 * (KVC_E_ARG with err; KVC_OK otherwise). */
int  kvc_unified_refuse_streams(const kvc_unified_params *p, kvc_err *err);
/* Today's type adds its streams, the buffers of its scattered placement and stream copies, and
 * the per-cell extension when params ask for it: KVC_OK or KVC_E_NOMEM. */
int  kvc_unified_streams_init(kvc_unified *c, const kvc_unified_params *p);
void kvc_unified_free(kvc_unified *c);
/* Attach the K/V memory of kept layer `ikv` (index into layers, not the model index). */
void kvc_unified_set_layer_buffers(kvc_unified *c, uint32_t ikv, uint8_t *k, uint8_t *v);
/* The index into layers of model layer il, or -1 when the cache does not keep it (the table is
 * in model order: ascending il). */
int64_t kvc_unified_layer_index(const kvc_unified *c, int64_t il);
/* The threads a K/V move of 16 MiB or more may share its layers among (never more than there
 * are layers): 1..KVC_MAX_THREADS, or 0 for kvc_parallel_width() (the default). KVC_OK or
 * KVC_E_ARG. */
int  kvc_unified_set_n_threads(kvc_unified *c, uint32_t n, kvc_err *err);

/* 2026: the cells the attention of stream s spans: min(size, max(P, pad(used_max_p1, P))),
 * P = max(n_pad, KVC_N_KV_PAD_MIN). */
uint32_t kvc_unified_stream_n_kv(const kvc_unified *c, uint32_t s);
/* The cells the attention of stream 0 spans (kvc_unified_ops.n_kv): the seed's n, or today's
 * kvc_unified_stream_n_kv(c, 0). */
uint32_t kvc_unified_n_kv_seed(const kvc_unified *c);
uint32_t kvc_unified_n_kv_streams(const kvc_unified *c);
/* Whether any stream has a pending shift. */
bool     kvc_unified_any_shift(const kvc_unified *c);

/* --- operations; sequence ids and positions are validated by the caller ---------------- */
/* clear, seq_rm, seq_cp, seq_keep, seq_add and seq_div below, as the table of kvc_seqops.h. */
extern const kvc_seq_ops kvc_unified_seq_ops;
void    kvc_unified_clear(kvc_unified *c);           /* also zeroes the K/V buffers; n kept */
/* kvc_unified_clear but the K/V buffers, which keep their bytes (for a caller that writes or
 * zeroes every cell's data itself). */
void    kvc_unified_clear_cells(kvc_unified *c);
/* Zero the K/V data of cells [from, to) of stream `stream` (every layer; columns of a
 * transposed V). */
void    kvc_unified_zero_cells(kvc_unified *c, uint32_t stream, uint32_t from, uint32_t to);
bool    kvc_unified_seq_rm(kvc_unified *c, int32_t s, int32_t p0, int32_t p1); /* s -1 = any */
/* seq_rm on stream st alone, the placement kept (the purge of a 2026 placement). */
void    kvc_unified_stream_seq_rm(kvc_unified *c, uint32_t st, int32_t s, int32_t p0, int32_t p1);
void    kvc_unified_seq_cp(kvc_unified *c, int32_t src, int32_t dst, int32_t p0, int32_t p1);
void    kvc_unified_seq_keep(kvc_unified *c, int32_t s);
void    kvc_unified_seq_add(kvc_unified *c, int32_t s, int32_t p0, int32_t p1, int32_t shift);
void    kvc_unified_seq_div(kvc_unified *c, int32_t s, int32_t p0, int32_t p1, int32_t d); /* d > 0 */
/* 2026: whether seq_cp(src, dst, p0, p1) is allowed (across streams only whole sequences) and
 * room for the stream copy it queues. KVC_OK, KVC_E_ARG or KVC_E_NOMEM with err; c unchanged. */
int     kvc_unified_seq_cp_check(kvc_unified *c, int32_t src, int32_t dst, int32_t p0, int32_t p1, kvc_err *err);
/* 2026 update, before a decode: the queued stream copies (kvc_unified_stream_copies), then, with
 * drop_shifts, the shifts of every stream are dropped (a model without RoPE, or the owner
 * rotates; else kvc_unified_update rotates K by them next). *copies: how many copies ran;
 * returns whether a shift was pending. kvc_unified_update with opts.stream_copies does both. */
bool    kvc_unified_update_2026(kvc_unified *c, uint32_t *copies, bool drop_shifts);
/* The queued stream copies of seq_cp across streams (every layer's K and V slab of the stream,
 * in order), then the queue emptied; returns how many ran. */
uint32_t kvc_unified_stream_copies(kvc_unified *c);

/* Slide the window of sequence s after a batch spanning [pmin, pmax] (iSWA commit): the cells of
 * s that no position up to pmax can see lose s. Returns 1 when fewer than min(n_swa, pmin)
 * cells of s were visible from pmin (a partial SWA cache: information may be lost), 0 otherwise,
 * KVC_E_ARG for a cache without a sliding window. */
int     kvc_unified_prune_swa(kvc_unified *c, int32_t s, int32_t pmin, int32_t pmax);

/* T5 relative position buckets into out[n_tokens][c->n]. */
void    kvc_unified_pos_bucket(const kvc_unified *c, const kvc_ubatch *ub, uint32_t n_buckets, int32_t *out);
int32_t kvc_relative_position_bucket(int32_t p0, int32_t p1, uint32_t n_buckets);
/* The per-cell shift input: out[s * size + i] = shift of cell i of stream s (0 when empty). */
void    kvc_unified_k_shift(const kvc_unified *c, int32_t *out);

#ifdef __cplusplus
}
#endif

#endif
