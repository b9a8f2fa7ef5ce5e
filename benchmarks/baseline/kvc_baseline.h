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

/* One sequence id per token. Returns 1 placed / 0 no slot. */
int  kvb_find_slot(kvb_cache *c, uint32_t n_tokens, const int32_t *pos, const int32_t *seq);
void kvb_commit(kvb_cache *c);
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
