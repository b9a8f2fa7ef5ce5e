/* kvcache benchmark baseline: the seed's loops, transcribed as they are (std::set used-cell and
 * per-sequence position sets, cell-by-cell slot search, a full triple loop for the mask, the
 * quadratic defrag scan, per-range state copies). Not part of kvcache's fast paths: it exists
 * only so that `kvcache bench` can measure them side by side in one process. */
#ifndef KVC_BASELINE_H
#define KVC_BASELINE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct kvb_cache kvb_cache;

/* One layer's buffers (owned by the caller). */
typedef struct kvb_layer {
    uint8_t *k;
    uint8_t *v;
    uint32_t k_row_bytes;
    uint32_t v_row_bytes;   /* non-transposed V */
    uint32_t v_el_bytes;    /* transposed V: element size */
    uint32_t n_embd_v;
    int32_t  type_k, type_v;
} kvb_layer;

kvb_cache *kvb_new(uint32_t size, uint32_t n_pad, uint32_t n_swa, int32_t swa_type, int v_trans);
void       kvb_free(kvb_cache *c);
void       kvb_set_layers(kvb_cache *c, uint32_t n_layer, const kvb_layer *layers);
uint32_t   kvb_head(const kvb_cache *c);
uint32_t   kvb_n(const kvb_cache *c);
uint32_t   kvb_used(const kvb_cache *c);
uint32_t   kvb_size(const kvb_cache *c);
/* The cells: pos[size] (-1 empty) and seq[size] (bit s: sequence s holds the cell). */
void       kvb_cells(const kvb_cache *c, int32_t *pos, uint64_t *seq);
/* The plan of the last kvb_defrag_prepare (ids[i]: where cell i goes); returns its length.
 * ids may be NULL. */
uint32_t   kvb_defrag_ids(const kvb_cache *c, uint32_t *ids);

/* One sequence id per token. Returns 1 placed / 0 no slot. */
int  kvb_find_slot(kvb_cache *c, uint32_t n_tokens, const int32_t *pos, const int32_t *seq);
void kvb_commit(kvb_cache *c);
/* The seed's cpy_k / cpy_v: the K and V rows of the n_tokens tokens placed at head, for layer il
 * (rows of k_row_bytes / v_row_bytes; V scattered into its rows when transposed). */
void kvb_store(kvb_cache *c, uint32_t il, uint32_t n_tokens, const uint8_t *k, const uint8_t *v);
/* One decode step as the seed's llama_decode runs it for a ubatch of one sequence id per token:
 * the ubatch's per-token vectors (as the simple split builds them), find_slot, the K/V rows of
 * every layer (k_rows[il], v_rows[il]), the padded f32 KQ mask into mask (pad(n_tokens, 64) rows
 * of n), commit. Returns 1 placed / 0 no slot (then nothing is written). */
int  kvb_step(kvb_cache *c, uint32_t n_tokens, const int32_t *pos, const int32_t *seq,
              const uint8_t *const *k_rows, const uint8_t *const *v_rows, float *mask);
int  kvb_seq_rm(kvb_cache *c, int32_t s, int32_t p0, int32_t p1);
int32_t kvb_seq_pos_max(const kvb_cache *c, int32_t s);
void kvb_kq_mask(const kvb_cache *c, uint32_t n_tokens, const int32_t *pos, const int32_t *seq, int causal, float *out);
int  kvb_defrag_prepare(kvb_cache *c, int32_t n_max_nodes, uint32_t n_layer);
size_t kvb_state_write(const kvb_cache *c, int32_t seq_id, uint8_t *out, size_t cap);
int  kvb_state_read(kvb_cache *c, int32_t seq_id, const uint8_t *data, size_t len);

#ifdef __cplusplus
}
#endif
#endif
