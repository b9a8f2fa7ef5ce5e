/* kvcache — the hybrid memory of models that mix attention and recurrent layers
 * (llama_memory_hybrid of today's llama.cpp: Granite 4, LFM2, Jamba, Falcon-H1, Nemotron-H,
 * Qwen3-Next, PLaMo 2; llama_memory_hybrid_iswa when the attention layers have a sliding window:
 * LFM2 with attention.sliding_window).
 *
 * A hybrid memory is a unified KV cache of semantics 2026 (or, with a sliding window, an iSWA
 * pair of semantics 2026) for the attention layers and a recurrent memory of semantics 2026 for
 * the recurrent ones, driven by the same ubatches. The attention part's own rules apply inside it
 * (an iSWA pair: a ubatch in both caches or neither, positions the SWA cache's). The
 * rules the pair adds: the recurrent memory is prepared and asked first; a ubatch is placed in
 * both or in neither; a seq_rm the recurrent memory refuses (a cut inside a state, a rollback it
 * cannot make exactly) changes neither; a sequence's smallest position is the larger of the two
 * parts' and its largest the smaller. */
#ifndef KVC_HYBRID_H
#define KVC_HYBRID_H

#include "kvc_common.h"
#include "kvc_iswa.h"
#include "kvc_recurrent.h"
#include "kvc_unified.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct kvc_hybrid {
    kvc_unified   *attn;   /* the attention layers' cache (owned by the caller); with iswa, its base cache */
    kvc_iswa      *iswa;   /* NULL, or the iSWA pair of the attention layers (owned by the caller) */
    kvc_recurrent *recr;   /* the recurrent layers' memory (owned by the caller) */
} kvc_hybrid;

/* Bind the two parts: KVC_E_ARG with err unless both are of semantics 2026 and have the same
 * n_seq_max. */
int     kvc_hybrid_init(kvc_hybrid *h, kvc_unified *attn, kvc_recurrent *recr, kvc_err *err);
/* The same with an iSWA pair (of semantics 2026) as the attention part. */
int     kvc_hybrid_init_iswa(kvc_hybrid *h, kvc_iswa *iswa, kvc_recurrent *recr, kvc_err *err);

/* --- the layer table: a model layer may be in both parts (Falcon-H1), or in neither ------- */

/* The attention cache holding model layer il: the unified cache, or the iSWA pair's cache that
 * holds it (kvc_iswa_layer); *index its index in that cache's layer table. NULL and *index = -1
 * when the attention part does not hold il. */
kvc_unified *kvc_hybrid_attn_layer(const kvc_hybrid *h, int64_t il, int64_t *index);
/* The index of model layer il in the recurrent part's layer table (numbered as the model's by
 * kvc_hybrid_state_init), or -1 when il is not a recurrent layer. */
int64_t kvc_hybrid_recr_layer(const kvc_hybrid *h, int64_t il);

/* Place a ubatch in both parts: 1 placed; 0 one part had no room or failed llama.cpp's sanity
 * check (nothing changed in either); an error code with err (nothing changed). */
int     kvc_hybrid_find_slot(kvc_hybrid *h, const kvc_ubatch *ub, kvc_err *err);

void    kvc_hybrid_clear(kvc_hybrid *h);
/* The recurrent part first: when it refuses, false and nothing changed in either part. */
bool    kvc_hybrid_seq_rm(kvc_hybrid *h, int32_t s, int32_t p0, int32_t p1);
/* Both parts, or neither: KVC_E_ARG with err when the attention part refuses the copy. */
int     kvc_hybrid_seq_cp(kvc_hybrid *h, int32_t src, int32_t dst, int32_t p0, int32_t p1, kvc_err *err);
void    kvc_hybrid_seq_keep(kvc_hybrid *h, int32_t s);
void    kvc_hybrid_seq_add(kvc_hybrid *h, int32_t s, int32_t p0, int32_t p1, int32_t shift);
void    kvc_hybrid_seq_div(kvc_hybrid *h, int32_t s, int32_t p0, int32_t p1, int32_t d);
/* The larger of the parts' smallest positions, the smaller of their largest (-1: none); an iSWA
 * pair's are its SWA cache's. */
int32_t kvc_hybrid_seq_pos_min(const kvc_hybrid *h, int32_t s);
int32_t kvc_hybrid_seq_pos_max(const kvc_hybrid *h, int32_t s);

#ifdef __cplusplus
}
#endif

#endif
