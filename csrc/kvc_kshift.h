/* kvcache — applying a unified cache's pending K-shift to its K memory.
 *
 * What llama.cpp's update() does with its K-shift graph: every kept layer's K rows
 * (one per cell, all cells) are rotated by the cell's accumulated shift with the
 * layer's RoPE parameters; quantized rows are decoded, rotated and re-encoded. */
#ifndef KVC_KSHIFT_H
#define KVC_KSHIFT_H

#include "kvc_unified.h"
#include "kvc_rope.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Rotate the K rows of every kept layer that has K memory by the cells' shifts.
 * p[l] and head_dim[l] are the RoPE parameters and the head size of kept layer l (index
 * into c->layers); a row of layer l holds n_embd_k / head_dim[l] heads. Everything is
 * checked and the scratch allocated before the first byte changes, so on KVC_E_ARG (err
 * says which layer) or KVC_E_NOMEM the memory is as it was. The shifts are not reset. */
int kvc_unified_apply_k_shift(kvc_unified *c, const kvc_rope_params *p, const uint32_t *head_dim,
                              kvc_err *err);

#ifdef __cplusplus
}
#endif

#endif
