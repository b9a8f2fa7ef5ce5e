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

/* Rotate the K rows of every kept layer that has K memory by the cells' shifts (the rows of
 * every stream).
 * p[l] and head_dim[l] are the RoPE parameters and the head size of kept layer l (index
 * into c->layers); a row of layer l holds n_embd_k / head_dim[l] heads. Everything is
 * checked and the scratch allocated before the first byte changes, so on KVC_E_ARG (err
 * says which layer) or KVC_E_NOMEM the memory is as it was. The shifts are not reset. */
int kvc_unified_apply_k_shift(kvc_unified *c, const kvc_rope_params *p, const uint32_t *head_dim,
                              kvc_err *err);

/* The same in two steps, for callers that must check and allocate for several caches before
 * changing any: kvc_unified_k_shift_prepare checks the arguments and allocates the scratch
 * (KVC_OK, KVC_E_ARG, KVC_E_NOMEM; c unchanged), kvc_unified_k_shift_run rotates with it (it
 * cannot fail once prepared against the same c, p and head_dim) and releases it.
 * kvc_kshift_work_free releases a prepared work that is not run. */
typedef struct kvc_kshift_work {
    int32_t *shift;     /* [n_stream * size] */
    float   *scratch;   /* the largest scratch any layer needs */
} kvc_kshift_work;
int  kvc_unified_k_shift_prepare(const kvc_unified *c, const kvc_rope_params *p, const uint32_t *head_dim,
                                 kvc_kshift_work *w, kvc_err *err);
int  kvc_unified_k_shift_run(kvc_unified *c, const kvc_rope_params *p, const uint32_t *head_dim,
                             kvc_kshift_work *w, kvc_err *err);
void kvc_kshift_work_free(kvc_kshift_work *w);

#ifdef __cplusplus
}
#endif

#endif
