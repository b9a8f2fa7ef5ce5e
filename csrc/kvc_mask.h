/* Row kernels of the KQ mask: one row of one sequence from its key positions, and the rows
 * that see nothing. The cache decides which rows and windows (kvc_unified_kq_mask); these
 * only write values, so each output type's encoding lives here and nowhere else. */
#ifndef KVC_MASK_H
#define KVC_MASK_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum kvc_mask_dtype {
    KVC_MASK_F32  = 0,  /* 0.0f (or -|p0-p1| with alibi) / -INFINITY */
    KVC_MASK_F16  = 1,  /* the same values as IEEE half */
    KVC_MASK_BOOL = 2,  /* 1 where the token attends the cell, 0 elsewhere (alibi ignored) */
} kvc_mask_dtype;

/* Bytes per mask element of dtype. */
size_t kvc_mask_elsize(int dtype);

/* row[i] for i < n: visible where lo <= vis[i] <= hi (vis[i] is the key position of cell i in
 * the query's sequence, -1 where the cell is empty or not in it; lo >= 0). Visible is 0 (f32,
 * f16; -|vis[i]-p1| with alibi) or 1 (bool); hidden is -inf or 0. `stream` writes with
 * non-temporal stores (for outputs larger than the caches; kvc_stream_fence() afterwards). */
void kvc_mask_row(void *row, int dtype, const int32_t *vis, uint32_t n, int32_t lo, int32_t hi,
                  int32_t p1, bool alibi, bool stream);

/* n elements that see nothing (-inf or 0). */
void kvc_mask_fill_hidden(void *out, int dtype, size_t n, bool stream);

/* The key positions of sequence s: v[i] = pos[i] where bit s of seq[i] is set, else -1
 * (i < n). Returns how many of them are edges: within [edge[0], edge[1]) or (edge[2], edge[3]]. */
uint32_t kvc_mask_key_positions(int32_t *v, const int32_t *pos, const uint64_t *seq, uint32_t n, unsigned s,
                                const int32_t edge[4]);

/* The indices i < n of the edges of v (as counted above), ascending, into out. Returns the count. */
uint32_t kvc_mask_edges(uint32_t *out, const int32_t *v, uint32_t n, const int32_t edge[4]);

/* Element i of a row: visible (0 or 1, never ALiBi) or hidden. */
void kvc_mask_set(void *row, int dtype, uint32_t i, bool visible);

#ifdef __cplusplus
}
#endif

#endif
