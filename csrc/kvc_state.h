/* kvcache — the state codec of the unified cache, byte-identical to llama.cpp's
 * llama_kv_cache_unified::state_write / state_read (layout: tests/golden/FORMAT.md,
 * "state_write / state_read blobs").
 *
 * Reading is transactional: the whole blob is parsed and validated before anything
 * changes; on any failure the cache (cells, head, n, recovery, defrag state, every
 * K/V byte) is exactly as it was, and err says what is wrong and where. */
#ifndef KVC_STATE_H
#define KVC_STATE_H

#include "kvc_common.h"
#include "kvc_unified.h"
#include "kvc_seqset.h"

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

/* Bytes state_write would produce for seq_id (-1 = whole cache); 0 for an id outside
 * [-1, n_seq_max). */
size_t kvc_unified_state_size(const kvc_unified *c, int32_t seq_id);

/* Write the state of seq_id (-1 = all) into out[0, cap). KVC_OK with *written set, or
 * KVC_E_NOSPACE when cap is too small (nothing meaningful written), KVC_E_ARG for an id outside
 * [-1, n_seq_max). Layers without K/V memory write zeros for their data. A pending defrag is
 * settled first (kvc_defrag.h), hence the non-const cache. */
int kvc_unified_state_write(kvc_unified *c, int32_t seq_id, uint8_t *out, size_t cap, size_t *written);

/* Read one cache state from data[0, len) into seq_id (-1 = whole cache). On success KVC_OK and
 * *consumed = bytes of the state (trailing bytes are not read). On failure a negative code,
 * err filled, and no change at all. A single-sequence part with cell_count 0 removes seq_id
 * (contract C1b). Negative positions and out-of-range sequence ids are rejected. Codes:
 * KVC_E_STATE (malformed or incompatible blob, or no run of free cells for a single sequence),
 * KVC_E_NOMEM, KVC_E_ARG (seq_id outside [-1, n_seq_max)). A successful read leaves nothing
 * placed (kvc_slot.h); a whole-cache read also empties the undo log, so that a restore()
 * afterwards cannot empty cells the read filled (a single sequence's read commits when it
 * places cells, as llama.cpp's). */
int kvc_unified_state_read(kvc_unified *c, int32_t seq_id, const uint8_t *data, size_t len,
                           size_t *consumed, kvc_err *err);

/* The same in a layout (enum kvc_layout_bits; KVC_LAYOUT_PREFIX is honoured only for a single
 * sequence: a whole-cache state has no prefix). */
size_t kvc_unified_state_size_lay(const kvc_unified *c, int32_t seq_id, unsigned layout);
int kvc_unified_state_write_range_lay(kvc_unified *c, int32_t seq_id, unsigned layout, uint64_t offset,
                                      uint8_t *out, size_t cap, size_t *written);

/* Flags of the _ex readers. */
enum kvc_state_flags {
    KVC_STATE_CONVERT_V = 1u, /* accept V in the other layout (transposed <-> rows) and convert it */
    KVC_STATE_EXACT     = 2u, /* the state must end exactly at len: trailing bytes are an error */
};

/* kvc_unified_state_read with flags (enum kvc_state_flags). With KVC_STATE_CONVERT_V a blob whose
 * V layout differs from the cache's is accepted when the V type stores one element per block,
 * and its V data is transposed on the way in; everything else is checked as without it. */
int kvc_unified_state_read_ex(kvc_unified *c, int32_t seq_id, const uint8_t *data, size_t len, unsigned flags,
                              size_t *consumed, kvc_err *err);

/* Bytes [offset, offset + cap) of the blob kvc_unified_state_write produces, into out (for
 * streaming a state in pieces of bounded size). *written = bytes produced: cap, or fewer at the
 * end of the blob (0 at or past its end). KVC_OK, KVC_E_ARG (bad seq_id), KVC_E_NOMEM. */
int kvc_unified_state_write_range(kvc_unified *c, int32_t seq_id, uint64_t offset, uint8_t *out,
                                  size_t cap, size_t *written);

/* --- the blob writer shared by the cache variants ----------------------------------------- */


/* A cache as the writer sees it. The listed cells are, for seq_id -1, every cell that is not
 * empty (empty: pos -1, or with empty_is_no_seq no sequence bit), else the cells holding seq_id. */
typedef struct kvc_state_src {
    uint32_t        size;
    const int32_t  *pos;             /* [size] */
    const uint64_t *seq;             /* [seq_words * size] the cells' sets as word planes (kvc_seqset.h) */
    uint32_t        seq_words;
    int32_t         seq_id;          /* -1 = whole cache */
    bool            empty_is_no_seq; /* recurrent: a cell is empty when it has no sequence */
    bool            single_writes_id;/* single sequence: n_seq_id 1 + the id (unified), or 0 (recurrent) */
    int32_t         type_k, type_v;
    bool            v_trans;
    size_t          v_el;            /* bytes per V element when transposed */
    uint32_t        n_layer;
    const void     *cache;           /* passed to layer() */
    /* layer il as kvc_layer (kvc_common.h): its rows of this source (k / v NULL: zeros are
     * written); transposed, n_embd_v rows of size elements */
    void          (*layer)(const void *cache, uint32_t il, kvc_layer *out);
    const struct kvc_cell_ext *ext;  /* [size] the cells' extensions (ext_bytes > 0) */
    uint32_t        ext_bytes;       /* bytes of it in each cell record: 0, 8 (x, y) or 12 (x, y, tok) */
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

/* The byte counts of a cache, checked once at its construction: its K/V memory (size cells of
 * the rows of n_layer layers: n_embd_k[l] elements of type_k, n_embd_v[l] of type_v) and its
 * largest state (every cell listing n_seq_max ids) fit in a size_t. KVC_OK, or KVC_E_ARG with
 * err saying which count does not. */
int kvc_state_check_sizes(uint32_t size, uint32_t n_seq_max, int32_t type_k, int32_t type_v, uint32_t n_layer,
                          const uint32_t *n_embd_k, const uint32_t *n_embd_v, kvc_err *err);

/* Bytes of the state src describes. */
size_t kvc_state_src_size(const kvc_state_src *src);
/* Bytes [offset, offset + cap) of that state into out; *written as kvc_unified_state_write_range.
 * KVC_OK or KVC_E_NOMEM. */
int kvc_state_src_write(const kvc_state_src *src, uint64_t offset, uint8_t *out, size_t cap, size_t *written);

/* --- describing a blob without a cache ------------------------------------------------------ */

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
} kvc_state_desc;

/* Walk one cache state at data[0, len) with the same checks of structure as the readers (every
 * count against the bytes left, sequence ids in [0, KVC_MAX_SEQ), v_trans 0 or 1) but none
 * against a cache. Fills d, and, when given, pos[i] and seq[KVC_SEQ_WORDS * i + w] (bit b of
 * word w: cell i lists sequence 64 * w + b) for the first pos_cap cells and layers[il] for the
 * first layers_cap layers. KVC_OK or KVC_E_STATE. */
int kvc_state_describe(const uint8_t *data, size_t len, kvc_state_desc *d, int32_t *pos, uint64_t *seq,
                       uint32_t pos_cap, kvc_state_layer_desc *layers, uint32_t layers_cap, kvc_err *err);

/* kvc_state_describe of a state whose cell records carry ext_bytes (0, 8 or 12) of the per-cell
 * extension; ext (may be NULL) gets the first pos_cap cells' (tok KVC_TOKEN_NULL with 8 bytes). */
int kvc_state_describe_ext(const uint8_t *data, size_t len, uint32_t ext_bytes, kvc_state_desc *d, int32_t *pos,
                           uint64_t *seq, struct kvc_cell_ext *ext, uint32_t pos_cap, kvc_state_layer_desc *layers,
                           uint32_t layers_cap, kvc_err *err);

/* The framing of a memory state, walked without a cache: whether a sequence-blob prefix leads
 * (allowed only with allow_prefix and a layout with KVC_LAYOUT_PREFIX), the stream count, and
 * per stream where its section starts and how many cells it lists. */
typedef struct kvc_state_frame {
    bool     prefixed;
    int32_t  src_seq_id;   /* the prefix's sequence id */
    uint32_t n_stream;     /* 1 in a layout without KVC_LAYOUT_STREAMS */
    size_t   end;          /* bytes of the framed state */
} kvc_state_frame;

/* Walk the framed state at data[0, len) in layout (not DETECT; with KVC_LAYOUT_CELL_EXT the cell
 * records carry the layout's extension bytes). sec_off[s] / sec_cells[s] for the
 * first sec_cap streams: the offset of stream s's body (its cell count) and that count. KVC_OK
 * or KVC_E_STATE (err: what and where). */
int kvc_state_describe_frame(const uint8_t *data, size_t len, unsigned layout, bool allow_prefix,
                             kvc_state_frame *f, size_t *sec_off, uint32_t *sec_cells, uint32_t sec_cap,
                             kvc_err *err);

/* --- two-phase reading: several parts into several caches, all or nothing ------------------
 * A state may be made of consecutive parts, one per cache (an iSWA cache writes the part of its
 * base cache, then the part of its SWA cache). Reading it must leave every cache unchanged when
 * any part fails, including a later part failing after an earlier one was fine: so every part
 * is first prepared (parsed, validated and, for a single sequence, given a slot by a dry run of
 * the slot search) while nothing changes, and only then are the parts applied, which cannot fail. */

#define KVC_STATE_MAX_PARTS 8

/* One validated stream section of a part read into a cache of semantics 2026. */
typedef struct kvc_state_sec {
    uint32_t  stream;     /* the cache's stream it goes to */
    uint32_t  cell_count;
    size_t    data_off;   /* offset in the part of its data section (the V layout flag) */
    uint32_t  v_trans;    /* the section's V layout (differs from the cache's only when converting) */
    int32_t  *pos;        /* the cells' validated positions (owned) */
    uint64_t *seq;        /* whole cache: the cells' sequence sets (owned), else NULL */
    struct kvc_cell_ext *ext; /* the cells' extensions when the section has them (owned), else NULL */
} kvc_state_sec;

/* listed[i] = 1 for each cell i of stream `stream` that a state of seq_id (>= 0: a single
 * sequence; -1: the whole cache) lists in layout, else 0 (a single sequence's state leaves out,
 * in layouts with KVC_LAYOUT_SWA_TRIM, the cells SWA-masked against its largest position);
 * listed holds the stream's size entries. Returns how many are listed. */
uint32_t kvc_unified_state_listed(const kvc_unified *c, int32_t seq_id, unsigned layout, uint32_t stream,
                                  uint8_t *listed);
/* Semantics 2026: the placement a single sequence's state section of cc cells at positions pos
 * gets when read into seq_id: the sequence removed from its stream, then the cells placed as one
 * ubatch of it (find_slot with cont false). 1 placed (kvc_unified_slot_cell tells where), 0 no
 * room; c is changed in either case. */
int kvc_unified_state_place_2026(kvc_unified *c, int32_t seq_id, uint32_t cc, const int32_t *pos);
/* After kvc_unified_state_place_2026 placed cc cells in stream `stream`: the saved extensions
 * ext[0, cc) (token order; NULL: none saved, the cells keep what the placement gave them) into
 * the cells it placed, as a sequence's state read puts them back. No-op for a cache without the
 * extension. */
void kvc_unified_state_put_ext_2026(kvc_unified *c, uint32_t stream, uint32_t cc, const struct kvc_cell_ext *ext);
/* The dry run of placing secs[0, n_sec) (their cell counts and positions) into seq_id in turn; c
 * is left as it was. 1 all placed (cells, when not NULL, gets the last section's cells in its
 * stream, in token order), 0 section *failed found no room (*used: the stream's used cells
 * then), KVC_E_NOMEM. */
int kvc_unified_state_try_place_2026(kvc_unified *c, int32_t seq_id, const struct kvc_state_sec *secs,
                                     uint32_t n_sec, int32_t *cells, uint32_t *failed, uint32_t *used);

/* One validated part, ready to apply to the cache it was prepared against. */
typedef struct kvc_state_plan {
    const uint8_t *data;       /* the part (borrowed: must outlive the plan) */
    int32_t        seq_id;     /* destination: -1 = whole cache */
    uint32_t       cell_count; /* cells the part holds */
    size_t         data_off;   /* offset of its data section (the V layout flag) */
    size_t         len;        /* bytes of the part */
    int32_t       *pos;        /* the cells' validated positions (owned; NULL without cells) */
    uint32_t       v_trans;    /* the part's V layout (differs from the cache's only when converting) */
    uint64_t      *seq;        /* whole cache: the cells' validated sequence sets, the cache's
                                * seq_words words per cell (owned), else NULL */
    bool           noop;       /* a single sequence's empty stream section (layouts with streams):
                                * the destination keeps its cells */
    uint32_t       n_sec;      /* semantics 2026: the part's non-empty stream sections, in order */
    kvc_state_sec *secs;       /* [n_sec] (owned); the fields above describe no cells then */
} kvc_state_plan;

/* Validate the part at data[0, len) for seq_id and, for a single sequence, check that its cells
 * find room. Nothing observable in c changes (internal capacities may grow, so that the apply
 * cannot run out of memory). KVC_OK with plan filled (release it with kvc_state_plan_free), or
 * a negative code with err and nothing to release. */
int  kvc_unified_state_prepare(kvc_unified *c, int32_t seq_id, const uint8_t *data, size_t len,
                               kvc_state_plan *plan, kvc_err *err);
/* Apply a plan to the cache it was prepared against, unchanged since: KVC_OK. (A negative code
 * only when c was changed in between, which breaks the contract.) The cells come from the plan,
 * not from the data again, so data changed since the prepare (a buffer another thread writes
 * into) cannot make the apply read or write out of bounds; only K/V bytes are copied from it. */
int  kvc_unified_state_apply(kvc_unified *c, const kvc_state_plan *plan);
void kvc_state_plan_free(kvc_state_plan *plan);   /* safe on a zeroed plan */

/* Read n_parts (1..KVC_STATE_MAX_PARTS) consecutive parts from data[0, len), part k into
 * caches[k] (distinct caches), for seq_id (-1 = whole caches). All or nothing: on failure
 * every cache is exactly as it was and err names the part. *consumed = bytes of all parts. */
int  kvc_unified_state_read_parts(kvc_unified *const *caches, uint32_t n_parts, int32_t seq_id,
                                  const uint8_t *data, size_t len, size_t *consumed, kvc_err *err);

/* The same with flags (enum kvc_state_flags): KVC_STATE_CONVERT_V for every part; with
 * KVC_STATE_EXACT the last part must end at len. */
int  kvc_unified_state_prepare_ex(kvc_unified *c, int32_t seq_id, const uint8_t *data, size_t len, unsigned flags,
                                  kvc_state_plan *plan, kvc_err *err);
int  kvc_unified_state_read_parts_ex(kvc_unified *const *caches, uint32_t n_parts, int32_t seq_id,
                                     const uint8_t *data, size_t len, unsigned flags, size_t *consumed,
                                     kvc_err *err);

/* The readers in a layout (enum kvc_layout_bits). With KVC_LAYOUT_STREAMS the stream count must
 * be the cache's ("n_stream mismatch" otherwise), and a single sequence's state may start with
 * the sequence-blob prefix (its magic checked, its id ignored, as llama.cpp does). With
 * KVC_LAYOUT_DETECT the layout is found: a leading KVC_SEQ_MAGIC means the stream layout, else
 * the state must parse to exactly len bytes in one of the two (seed, streams); when both do,
 * KVC_E_STATE asks for the layout. *used (may be NULL) = the layout read. */
int  kvc_unified_state_prepare_lay(kvc_unified *c, int32_t seq_id, const uint8_t *data, size_t len,
                                   unsigned flags, unsigned layout, kvc_state_plan *plan, kvc_err *err);
int  kvc_unified_state_read_parts_lay(kvc_unified *const *caches, uint32_t n_parts, int32_t seq_id,
                                      const uint8_t *data, size_t len, unsigned flags, unsigned layout,
                                      size_t *consumed, unsigned *used, kvc_err *err);

/* The sequence-blob prefix in front of data[0, len) of a single sequence's state: *off = 8 when
 * it is there, 0 when not. KVC_OK, or KVC_E_STATE when it is cut short. */
int  kvc_state_prefix_skip(const uint8_t *data, size_t len, size_t *off, kvc_err *err);

#ifdef __cplusplus
}
#endif

#endif
