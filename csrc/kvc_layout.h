/* kvcache — the memory state's wire format as constants and descriptors: the layout bits, the
 * sequence-blob magic, the records a description of a blob fills, and the byte counts a cache
 * is checked against. The bottom of the state codec: the section parser (kvc_section.h) and the
 * codec (kvc_state.h) both build on it. The byte layout itself: docs/format.md. */
#ifndef KVC_LAYOUT_H
#define KVC_LAYOUT_H

#include "kvc_common.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* --- layouts ---------------------------------------------------------------------------------
 * llama.cpp's memory state changed shape over time (docs/state.md has the table of layouts and
 * llama.cpp versions). A layout is given to the codec as a set of these bits; 0 is the seed's
 * layout (llama-cpp-python 0.3.10-0.3.14), and the functions without a layout argument use it. */
enum kvc_layout_bits {
    KVC_LAYOUT_STREAMS  = 1u, /* u32 n_stream, then per stream a u32 cell count and, when it is not
                               * 0, the seed's body for that stream (an empty stream is its count) */
    KVC_LAYOUT_PREFIX   = 2u, /* single-sequence blobs start with u32 KVC_SEQ_MAGIC, i32 seq id */
    KVC_LAYOUT_SWA_TRIM = 4u, /* single-sequence blobs leave out the cells SWA-masked against the
                               * sequence's largest position */
    KVC_LAYOUT_EXT_XY   = 8u, /* the cell records of a cache with the per-cell extension (kvc_cells.h)
                               * carry it after n_seq_id: i32 x, i32 y */
    KVC_LAYOUT_EXT_TOK  = 16u,/* ... and i32 tok after them (with KVC_LAYOUT_EXT_XY) */
    KVC_LAYOUT_CELL_EXT = 32u,/* readers without a cache: the cells have the extension (the model's) */
    KVC_LAYOUT_FRESH_OUT = 0x40000000u, /* writers only: out is memory just allocated, whose pages the
                                         * first stores fault in (zeroed by the system): plain stores,
                                         * which find those lines in the caches. Else a window of
                                         * KVC_STREAM_BYTES or more gets its K/V data streamed */
    KVC_LAYOUT_DETECT   = 0x80000000u, /* readers only: find the layout (see the _lay readers) */
};

/* Bytes of a cell's extension in a layout, for a cache that has one: 0, 8 or 12. */
static inline uint32_t kvc_layout_ext_bytes(unsigned layout) {
    return (layout & KVC_LAYOUT_EXT_XY) ? ((layout & KVC_LAYOUT_EXT_TOK) ? 12u : 8u) : 0u;
}

/* The first word of a sequence blob in the layouts with KVC_LAYOUT_PREFIX. */
#define KVC_SEQ_MAGIC 0xaf143cd8u
/* Bytes of that prefix: the magic and the source sequence id. */
#define KVC_SEQ_PREFIX_BYTES 8u

/* The most parts (one per cache) a composite cache's state holds: an iSWA pair, with room. */
#define KVC_STATE_MAX_PARTS 8

/* --- what a description of a blob without a cache records ---------------------------------- */

typedef struct kvc_state_layer_desc {
    int32_t  k_type;
    uint64_t k_row_size;
    uint64_t k_offset;      /* blob offset of the layer's K header */
    int32_t  v_type;
    uint64_t v_row_size;    /* v_trans 0 */
    uint32_t v_elem_size;   /* v_trans 1 */
    uint32_t v_width;       /* v_trans 1: n_embd_v_gqa */
    uint64_t v_offset;      /* blob offset of the layer's V header */
    uint64_t k_bytes, v_bytes; /* data bytes of K and V (headers excluded) */
} kvc_state_layer_desc;

typedef struct kvc_state_desc {
    uint32_t cell_count;
    uint32_t v_trans;
    uint32_t n_layer;
    size_t   data_off;       /* offset of the V layout flag */
    size_t   end;            /* bytes of the state */
    uint32_t n_seq_id_min;   /* over the cells (0 when there is none) */
    uint32_t n_seq_id_max;
    bool     records_final;  /* failed: no larger n_records frames the state either (the bytes
                              * cannot hold that many layer records, or it has fewer layers) */
} kvc_state_desc;

/* The framing of a memory state, walked without a cache: whether a sequence-blob prefix leads
 * (allowed only with allow_prefix and a layout with KVC_LAYOUT_PREFIX), the stream count, and
 * per stream where its section starts and how many cells it lists. */
typedef struct kvc_state_frame {
    bool     prefixed;
    int32_t  src_seq_id;   /* the prefix's sequence id */
    uint32_t n_stream;     /* 1 in a layout without KVC_LAYOUT_STREAMS */
    size_t   end;          /* bytes of the framed state */
    bool     ids_outside;  /* a walk that left the ids unchecked: a cell lists one outside
                            * [0, KVC_MAX_SEQ) */
} kvc_state_frame;

/* The byte counts of a cache, checked once at its construction: its K/V memory (size cells of
 * the rows of n_layer layers: n_embd_k[l] elements of type_k, n_embd_v[l] of type_v) and its
 * largest state (every cell listing n_seq_max ids) fit in a size_t. KVC_OK, or KVC_E_ARG with
 * err saying which count does not. */
int kvc_state_check_sizes(uint32_t size, uint32_t n_seq_max, int32_t type_k, int32_t type_v, uint32_t n_layer,
                          const uint32_t *n_embd_k, const uint32_t *n_embd_v, kvc_err *err);

#ifdef __cplusplus
}
#endif

#endif
