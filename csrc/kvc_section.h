/* Internal to the C core: the one parser of a memory state's sections, used by the unified reader
 * (kvc_state.c), the recurrent reader (kvc_recurrent.c) and the description of a blob without a
 * cache (kvc_state_describe, kvc_state_describe_frame). The bytes of a section and of the framing:
 * docs/format.md.
 *
 * A stream section is the seed's memory state: u32 cell count; per cell i32 pos, u32 n_seq_id, the
 * per-cell extension of models that have one (layouts from 0.3.17: i32 x, i32 y, from 0.3.36 also
 * i32 tok), the ids; u32 V layout flag, u32 layer count; per layer K (i32 type, u64 row size, the rows), then
 * per layer V (i32 type and u64 row size, or when transposed u32 element size and u32 width, then
 * the data). Every field is checked against the bytes left before it is read; against a
 * destination's geometry when one is given. Errors name the byte and what was expected. */
#ifndef KVC_SECTION_H
#define KVC_SECTION_H

#include "kvc_cells.h"
#include "kvc_cursor.h"
#include "kvc_layout.h"

#ifdef __cplusplus
extern "C" {
#endif

/* What a destination cache holds a section to; a NULL destination checks the structure alone
 * (ids in [0, KVC_MAX_SEQ), V layout 0 or 1). */
typedef struct kvc_sec_dest {
    int32_t  seq_id;          /* -1: cells list their ids; else a single sequence's state */
    uint32_t size;            /* cells the destination has */
    uint32_t seq_cells_max;   /* single sequence: cells a state may hold (0: size) */
    uint32_t single_n_ids;    /* single sequence: the ids each cell lists (read and ignored) */
    uint32_t n_seq_max;       /* ids must be in [0, n_seq_max) */
    uint32_t seq_words;       /* words per cell of the parsed sequence sets */
    bool     ids_once;        /* an id listed twice by one cell is malformed */
    bool     seq_in_one_cell; /* a sequence listed by two cells is malformed */
    int32_t  type_k, type_v;
    bool     v_trans;         /* the destination's V layout */
    bool     convert_v;       /* accept the other V layout (the reader converts it) */
    bool     can_convert_v;   /* whether the destination converts at all (for the message) */
    uint32_t n_layer;         /* the layers with records */
    uint32_t n_layer_field;   /* the layer count the state must say, when not n_layer (0): the
                               * model's layers, of which a hybrid memory's recurrent part has
                               * records for its own only */
    const void *cache;        /* passed to layer() */
    void      (*layer)(const void *cache, uint32_t il, kvc_layer *out); /* the row sizes */
    /* Optional: the destination's own cell table, parsed straight into (no allocation, no
     * second pass over the cells). into_pos: the positions (room for every cell the checks let
     * through). Whole cache, both or neither: into_seq, word planes of `size` cells, all clear;
     * into_cell_of, [n_seq_max] all -1, becomes per id the (last) cell that lists it. */
    int32_t  *into_pos;
    uint64_t *into_seq;
    int32_t  *into_cell_of;
    uint32_t  ext_bytes;      /* bytes of the per-cell extension after n_seq_id (0, 8 or 12) */
} kvc_sec_dest;

/* One parsed stream section; offsets are the cursor's (from the start of its bytes). */
typedef struct kvc_section {
    uint32_t  cell_count;
    uint32_t  v_trans;      /* the section's V layout */
    uint32_t  n_layer;
    size_t    data_off;     /* where the V layout flag is */
    size_t    end;          /* where the section ends */
    uint32_t  n_seq_id_min; /* over the cells (0 when there is none) */
    uint32_t  n_seq_id_max;
    /* with a destination: taken from the bytes once (the apply never reads the cells again);
     * NULL where the destination gave its own table (into_pos, into_seq) */
    int32_t  *pos;          /* [cell_count] (owned; NULL without cells) */
    uint64_t *seq;          /* whole cache: [seq_words * cell_count] the cells' sets (owned), else NULL */
    kvc_cell_ext *ext;      /* with ext_bytes: [cell_count] the cells' extensions (owned), else NULL */
    /* without a destination, where to record, when given (set by the caller before the parse) */
    int32_t              *d_pos;      /* [d_pos_cap] */
    uint64_t             *d_seq;      /* [KVC_SEQ_WORDS * d_pos_cap] */
    kvc_cell_ext         *d_ext;      /* [d_pos_cap] (may be NULL) */
    uint32_t              d_ext_bytes;/* the extension's bytes in each cell record */
    uint32_t              d_pos_cap;
    kvc_state_layer_desc *d_layers;   /* [d_layers_cap] */
    uint32_t              d_layers_cap;
    uint32_t              d_n_records;/* the layer records when the count says more (a hybrid
                                       * memory's recurrent part; 0: the count) */
    bool                  records_final; /* the parse failed because the bytes cannot hold
                                       * d_n_records records or the count has fewer layers: no
                                       * larger d_n_records frames them either */
    bool                  d_ids_unchecked; /* the cells' ids are read, not checked (as a single
                                       * sequence's reader reads them) */
    bool                  d_ids_outside; /* then: a cell lists an id outside [0, KVC_MAX_SEQ),
                                       * which the checks refuse */
} kvc_section;

/* Parse the stream section at the cursor (moved past it on success). sec must be zeroed but for
 * the d_ fields. KVC_OK, KVC_E_STATE or KVC_E_NOMEM (err: what and where; err NULL: no message
 * is formatted, here and in the walks below); sec->pos and sec->seq are to be released with
 * kvc_sec_free in every case. */
int  kvc_sec_parse(kvc_cursor *r, const kvc_sec_dest *dest, kvc_section *sec, kvc_err *err);
void kvc_sec_free(kvc_section *sec);
/* KVC_OK when a state that ends at byte end takes all len bytes, else KVC_E_STATE naming the
 * trailing bytes (a reader asked for an exact parse). */
int  kvc_state_check_end(size_t end, size_t len, kvc_err *err);

/* The framing around the sections: in a layout with KVC_LAYOUT_STREAMS a u32 stream count, then
 * per stream a section, or for an empty stream its zero cell count alone; without, one section. */
typedef struct kvc_frame {
    uint32_t n_stream;
    bool     streams;       /* the layout has stream counts */
} kvc_frame;

/* Take the framing's head at the cursor: the stream count must be want (the destination's), or
 * with want 0 anything from 1 to KVC_MAX_SEQ; a layout without counts holds 1 stream, refused
 * when want is more. KVC_OK or KVC_E_STATE. */
int  kvc_frame_begin(kvc_cursor *r, unsigned layout, uint32_t want, kvc_frame *f, kvc_err *err);
/* True (and the count taken) when the next stream's section is an empty stream's. */
bool kvc_frame_take_empty(kvc_cursor *r, const kvc_frame *f);

/* --- describing a blob without a cache (public: the Python layer's inspection) ------------- */

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

/* kvc_state_describe_ext of a hybrid memory's recurrent part, whose layer count is the model's
 * while it has n_records layer records (its recurrent layers'; 0: as many as the count says):
 * d->n_layer is the count, layers[] gets the records. */
int kvc_state_describe_records(const uint8_t *data, size_t len, uint32_t ext_bytes, uint32_t n_records,
                               kvc_state_desc *d, int32_t *pos, uint64_t *seq, struct kvc_cell_ext *ext,
                               uint32_t pos_cap, kvc_state_layer_desc *layers, uint32_t layers_cap, kvc_err *err);

/* Walk the framed state at data[0, len) in layout (not DETECT; with KVC_LAYOUT_CELL_EXT the cell
 * records carry the layout's extension bytes). sec_off[s] / sec_cells[s] for the
 * first sec_cap streams: the offset of stream s's body (its cell count) and that count. KVC_OK
 * or KVC_E_STATE (err: what and where). */
int kvc_state_describe_frame(const uint8_t *data, size_t len, unsigned layout, bool allow_prefix,
                             kvc_state_frame *f, size_t *sec_off, uint32_t *sec_cells, uint32_t sec_cap,
                             kvc_err *err);

/* kvc_state_describe_frame (err may be NULL) with, when ids_unchecked, the cells' sequence ids read but not checked,
 * as a single sequence's reader reads them: f->ids_outside then says whether a cell lists one
 * outside [0, KVC_MAX_SEQ), which the checks refuse (the walk frames with them exactly when it
 * frames and that is false). */
int kvc_state_walk_frame(const uint8_t *data, size_t len, unsigned layout, bool allow_prefix, bool ids_unchecked,
                         kvc_state_frame *f, size_t *sec_off, uint32_t *sec_cells, uint32_t sec_cap, kvc_err *err);

/* The sequence-blob prefix in front of data[0, len) of a single sequence's state: *off = 8 when
 * it is there, 0 when not. KVC_OK, or KVC_E_STATE when it is cut short. */
int  kvc_state_prefix_skip(const uint8_t *data, size_t len, size_t *off, kvc_err *err);
/* The same for a reader into seq_id: a prefix in front of a state read as the whole cache
 * (seq_id < 0) is KVC_E_STATE (*off 0). */
int  kvc_state_prefix_take(const uint8_t *data, size_t len, int32_t seq_id, size_t *off, kvc_err *err);

#ifdef __cplusplus
}
#endif

#endif
