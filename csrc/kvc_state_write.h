/* kvcache — writing memory states: the blob writer the cache variants share (a cache described
 * as a kvc_state_src, framed by a layout) and the unified cache's writes through it, whole or in
 * windows of bounded size. The byte layout: docs/format.md. */
#ifndef KVC_STATE_WRITE_H
#define KVC_STATE_WRITE_H

#include "kvc_common.h"
#include "kvc_layout.h"
#include "kvc_seqset.h"
#include "kvc_types.h"
#include "kvc_unified.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Bytes state_write would produce for seq_id (-1 = whole cache); 0 for an id outside
 * [-1, n_seq_max). */
size_t kvc_unified_state_size(const kvc_unified *c, int32_t seq_id);

/* Write the state of seq_id (-1 = all) into out[0, cap). KVC_OK with *written set, or
 * KVC_E_NOSPACE when cap is too small (nothing meaningful written), KVC_E_ARG for an id outside
 * [-1, n_seq_max). Layers without K/V memory write zeros for their data. A pending defrag is
 * settled first (kvc_defrag.h), hence the non-const cache. */
int kvc_unified_state_write(kvc_unified *c, int32_t seq_id, uint8_t *out, size_t cap, size_t *written);

/* The same in a layout (enum kvc_layout_bits; KVC_LAYOUT_PREFIX is honoured only for a single
 * sequence: a whole-cache state has no prefix). */
size_t kvc_unified_state_size_lay(const kvc_unified *c, int32_t seq_id, unsigned layout);
int kvc_unified_state_write_range_lay(kvc_unified *c, int32_t seq_id, unsigned layout, uint64_t offset,
                                      uint8_t *out, size_t cap, size_t *written);

/* Bytes [offset, offset + cap) of the blob kvc_unified_state_write produces, into out (for
 * streaming a state in pieces of bounded size). *written = bytes produced: cap, or fewer at the
 * end of the blob (0 at or past its end). KVC_OK, KVC_E_ARG (bad seq_id), KVC_E_NOMEM. */
int kvc_unified_state_write_range(kvc_unified *c, int32_t seq_id, uint64_t offset, uint8_t *out,
                                  size_t cap, size_t *written);

/* listed[i] = 1 for each cell i of stream `stream` that a state of seq_id (>= 0: a single
 * sequence; -1: the whole cache) lists in layout, else 0 (a single sequence's state leaves out,
 * in layouts with KVC_LAYOUT_SWA_TRIM, the cells SWA-masked against its largest position);
 * listed holds the stream's size entries. Returns how many are listed. */
uint32_t kvc_unified_state_listed(const kvc_unified *c, int32_t seq_id, unsigned layout, uint32_t stream,
                                  uint8_t *listed);
/* --- the blob writer shared by the cache variants ----------------------------------------- */

/* A cache as the writer sees it. The listed cells are, for seq_id -1, every cell that is not
 * empty (empty: pos -1, or with empty_is_no_seq no sequence bit), else the cells holding seq_id. */
typedef struct kvc_state_src {
    uint32_t        size;
    const int32_t  *pos;             /* [size] */
    const uint64_t *seq;             /* [seq_words * size] the cells' sets as word planes (kvc_seqset.h) */
    const struct kvc_cells *cells;   /* the unified cache's table (the owners of the cells one
                                      * sequence holds: kvc_cells_owner), or NULL: the planes alone */
    uint32_t        seq_words;
    int32_t         seq_id;          /* -1 = whole cache */
    bool            empty_is_no_seq; /* recurrent: a cell is empty when it has no sequence */
    bool            single_writes_id;/* single sequence: n_seq_id 1 + the id (unified), or 0 (recurrent) */
    int32_t         type_k, type_v;
    bool            v_trans;
    size_t          v_el;            /* bytes per V element when transposed */
    uint32_t        n_layer;         /* the layers with records */
    uint32_t        n_layer_field;   /* the layer count the state says: n_layer, or the model's layers
                                      * when the records are those of some (a hybrid memory's
                                      * recurrent part) */
    const void     *cache;           /* passed to layer() */
    /* layer il as kvc_layer (kvc_common.h): its rows of this source (k / v NULL: zeros are
     * written); transposed, n_embd_v rows of size elements */
    void          (*layer)(const void *cache, uint32_t il, kvc_layer *out);
    const struct kvc_cell_ext *ext;  /* [size] the cells' extensions (ext_bytes > 0) */
    uint32_t        ext_bytes;       /* bytes of it in each cell record: 0, 8 (x, y) or 12 (x, y, tok) */
    /* the snapshot plane cell i's rows are read from: row plane * size + i of the layer's memory
     * (a recurrent memory's pending rollback); NULL: plane 0 */
    uint32_t      (*plane)(const struct kvc_state_src *s, uint32_t i);
    const kvc_unified *swa;          /* single sequence: leave out the cells this cache's window
                                      * masks against swa_pmax (NULL: none left out) */
    int32_t         swa_pmax;
} kvc_state_src;

/* A memory state as the writer sees it: the streams of a cache, framed by a layout. */
typedef struct kvc_state_framed {
    unsigned             layout;     /* enum kvc_layout_bits */
    int32_t              seq_id;     /* -1 = whole cache; the id of the prefix */
    bool                 prefix;     /* write the sequence-blob prefix first */
    uint32_t             n_stream;   /* 1 without KVC_LAYOUT_STREAMS */
    const kvc_state_src *streams;    /* [n_stream] */
} kvc_state_framed;

/* Bytes of a framed state, and bytes [offset, offset + cap) of it (as kvc_state_src_write). */
size_t kvc_state_framed_size(const kvc_state_framed *f);
int    kvc_state_framed_write(const kvc_state_framed *f, uint64_t offset, uint8_t *out, size_t cap,
                              size_t *written);

/* The bytes of each of up to `width` threads' shares of an n-byte window: whole 4 KiB pages
 * (the last share takes the rest), never more than `width` shares (width >= 1). */
size_t kvc_state_share_bytes(size_t n, unsigned width);

/* Bytes of the state src describes. */
size_t kvc_state_src_size(const kvc_state_src *src);
/* Bytes [offset, offset + cap) of that state into out; *written as kvc_unified_state_write_range.
 * KVC_OK or KVC_E_NOMEM. */
int kvc_state_src_write(const kvc_state_src *src, uint64_t offset, uint8_t *out, size_t cap, size_t *written);

/* --- the unified cache as the writers and the readers see it (internal to the codec) ------- */

/* Bytes of V element of a transposed V (its type has block size 1). */
static inline size_t kvc_state_v_el(const kvc_unified *c) {
    const kvc_type_info *t = kvc_type_get(c->type_v);
    return t ? t->type_size : 0;
}

static inline bool kvc_state_seq_valid(const kvc_unified *c, int32_t seq_id) {
    return seq_id >= -1 && (seq_id < 0 || (uint32_t)seq_id < c->n_seq_max);
}

/* One stream of a cache, as the writer's layer callback sees it. */
typedef struct kvc_state_stream {
    const kvc_unified *c;
    uint32_t           stream;
} kvc_state_stream;

/* Layer il of one stream: K rows (and V rows) of stream s start at row s * size; a transposed V
 * keeps per stream n_embd_v rows of size elements, the same bytes as size rows. */
static inline void kvc_state_stream_layer(const void *cache, uint32_t il, kvc_layer *out) {
    const kvc_state_stream *ref = (const kvc_state_stream *)cache;
    const kvc_layer *l = &ref->c->layers[il];
    const size_t rows = (size_t)ref->stream * ref->c->cells.size;
    *out = *l;
    out->k = l->k ? l->k + rows * l->k_row_bytes : NULL;
    out->v = l->v ? l->v + rows * l->v_row_bytes : NULL;
}

#ifdef __cplusplus
}
#endif

#endif
