/* Internal to the C core: moving columns within the rows of a transposed buffer (a transposed V
 * holds a cell as one element in each of its rows; a defrag move of cells is the same gather in
 * every row). */
#ifndef KVC_COLS_H
#define KVC_COLS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct kvc_cols_op kvc_cols_op;

/* The moves of one plan, prepared once and applied to any number of rows. */
typedef struct kvc_cols {
    uint32_t        n_cells;   /* elements per row */
    uint32_t        el;        /* bytes per element */
    const uint32_t *pairs;     /* (dst, src) per moved element, borrowed */
    uint32_t        n_pairs;
    kvc_cols_op    *ops;       /* vector path: ops filling one chunk of a row each; NULL: scalar */
    uint32_t        n_ops;
    uint32_t       *blocks;    /* the 64-byte blocks of a row the moves touch (offsets / 64) */
    uint32_t        n_blocks;
} kvc_cols;

/* Whether the vector path may run: the processor has it (AVX-512BW) and the environment does not
 * ask for the scalar loop (KVCACHE_NO_AVX512 set and not "0", for testing it or as a way out).
 * Reads the environment: ask once (a cache does when it is made), not per move. */
bool kvc_cols_vector_available(void);

/* Prepare n_pairs (dst, src) pairs, no element both a destination and a source, for rows of
 * n_cells elements of el bytes (2 or 4), with the vector path when `vector` (and
 * kvc_cols_vector_available said so). The pairs must outlive cols. Without memory the moves still
 * work, without the vector path or prefetching. */
void kvc_cols_init(kvc_cols *cols, const uint32_t *pairs, uint32_t n_pairs, uint32_t n_cells, uint32_t el,
                   bool vector);
void kvc_cols_free(kvc_cols *cols);

/* Apply the moves to n_rows rows starting at base, stride bytes apart. */
void kvc_cols_apply(const kvc_cols *cols, uint8_t *base, size_t stride, uint32_t n_rows);

#ifdef __cplusplus
}
#endif

#endif
