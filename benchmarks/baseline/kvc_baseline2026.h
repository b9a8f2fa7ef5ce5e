/* kvcache benchmark baseline of today's llama.cpp (the cache of llama-cpp-python 0.3.36): the
 * team's transcription of its loops with its containers (per stream: std::set of used cells,
 * std::bitset<256> per cell, a std::set of (position, cell) pairs per sequence), the slot search
 * with cont=false (usable cells one at a time from the head, wrapping around), apply_ubatch (with
 * the purge that keeps a sequence's positions contiguous) and the KQ mask per stream without
 * padding rows. Not part of kvcache: it exists so that `kvcache bench` can time today's loop
 * beside kvcache's semantics="2026" cache, and it is checked against
 * kvcache.reference2026.UnifiedReference2026 in the tests. */
#ifndef KVC_BASELINE2026_H
#define KVC_BASELINE2026_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define KVB26_MAX_SEQ 256

typedef struct kvb26_cache kvb26_cache;

/* n_stream 1 (kv_unified) or n_seq_max (sequence s in stream s); size cells per stream. */
kvb26_cache *kvb26_new(uint32_t size, uint32_t n_stream, uint32_t n_seq_max, uint32_t n_pad, uint32_t n_swa,
                       int32_t swa_type);
void     kvb26_free(kvb26_cache *c);
uint32_t kvb26_head(const kvb26_cache *c, uint32_t stream);
uint32_t kvb26_used(const kvb26_cache *c, uint32_t stream);
/* The cells of a stream: pos[size] (-1 empty), seq[size * 4] (256 bits per cell, word w of cell i
 * at seq[4 * i + w]). */
void     kvb26_cells(const kvb26_cache *c, uint32_t stream, int32_t *pos, uint64_t *seq);

/* A ubatch: n_tokens tokens, token t at pos[t] with the sequence ids seq_ids[seq_off[t] ..
 * seq_off[t + 1]) (several streams: one id per token, the tokens of each sequence together, as
 * many for each). find_slot(ubatch, cont=false) then apply_ubatch: 1 placed, 0 no slot (nothing
 * changed), -1 a ubatch the cache cannot take (nothing changed). */
int      kvb26_find_slot(kvb26_cache *c, uint32_t n_tokens, const int32_t *pos, const uint32_t *seq_off,
                         const int32_t *seq_ids);
/* Where the last successful find_slot put each token (ubatch order): its stream and cell;
 * returns the number of tokens (0 after a failed one). */
uint32_t kvb26_slot(const kvb26_cache *c, int32_t *streams, int32_t *cells);
int      kvb26_seq_rm(kvb26_cache *c, int32_t s, int32_t p0, int32_t p1);
int32_t  kvb26_seq_pos_min(const kvb26_cache *c, int32_t s);
int32_t  kvb26_seq_pos_max(const kvb26_cache *c, int32_t s);

/* The mask's shape for a ubatch: streams (1, or one block per sequence with several streams),
 * rows per block and n_kv (the largest over the ubatch's streams of min(size, max(P, pad(used_max_p1,
 * P))), P = max(n_pad, 256)). 0, or -1 for a ubatch the cache cannot take. */
int      kvb26_mask_shape(const kvb26_cache *c, uint32_t n_tokens, const uint32_t *seq_off, const int32_t *seq_ids,
                          uint32_t *n_blocks, uint32_t *rows, uint32_t *n_kv);
/* The f32 KQ mask [n_blocks][rows][n_kv] as today's set_input_kq_mask writes it (no padding rows;
 * the rows of a sequence's later tokens start from its first token's row). */
int      kvb26_kq_mask(const kvb26_cache *c, uint32_t n_tokens, const int32_t *pos, const uint32_t *seq_off,
                       const int32_t *seq_ids, int causal, float *out);

#ifdef __cplusplus
}
#endif
#endif
