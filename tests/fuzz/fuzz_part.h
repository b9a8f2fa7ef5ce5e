/* The oracle's own reading of one part of a state in the seed's layout (u32 cell count, the
 * cells, the V layout, the layers' K and V), shared by the state targets: where its sections lie
 * once a cache accepted it, and the bytes state_write must give back for it. A section of a
 * state with stream counts that holds cells is such a part. The cell records of a cache with the
 * per-cell extension may carry it (0, 8 or 12 bytes after n_seq_id: x, y, tok). */
#ifndef KVC_FUZZ_PART_H
#define KVC_FUZZ_PART_H

#include "fuzz_common.h"
#include "kvc_state.h"
#include "kvc_types.h"
#include "kvc_unified.h"

enum { FP_MAX_LAYERS = 3, FP_DESC_CELLS = 256 };

/* Where the parts of a successfully read state lie (the oracle's own walk over the blob). */
typedef struct layout {
    const uint8_t *p;                /* the part */
    uint32_t cc;
    uint32_t ext;                    /* bytes of the extension in each cell record */
    bool vt;                         /* the part's V layout */
    size_t meta_end;                 /* offset of v_trans */
    size_t k_off[FP_MAX_LAYERS];        /* first K row of layer l */
    size_t v_off[FP_MAX_LAYERS];        /* first V byte of layer l */
    size_t end;
} layout;

static inline size_t v_elem(const kvc_unified *c) { return kvc_type_get(c->type_v)->type_size; }

/* Walk the part at p (of at most avail bytes) as cache c read it, ext bytes of extension in each
 * cell record. */
static inline layout walk(const kvc_unified *c, int32_t seq_id, const uint8_t *p, size_t avail, uint32_t ext) {
    layout L;
    memset(&L, 0, sizeof L);
    L.p = p;
    L.ext = ext;
    FUZZ_CHECK(avail >= 4, "a part of %zu bytes was accepted", avail);
    L.cc = kvc_le_get_u32(p);
    size_t off = 4;
    for (uint32_t i = 0; i < L.cc; i++) {
        FUZZ_CHECK(off + 8 + ext <= avail, "cell %u lies past the consumed bytes", i);
        const uint32_t n_ids = kvc_le_get_u32(p + off + 4);
        FUZZ_CHECK(seq_id < 0 || n_ids == 1, "a single-sequence cell with %u ids was accepted", n_ids);
        FUZZ_CHECK((uint64_t)n_ids * 4 <= avail - off - 8 - ext, "cell %u's ids lie past the consumed bytes", i);
        off += 8 + ext + 4 * (size_t)n_ids;
    }
    L.meta_end = off;
    FUZZ_CHECK(off + 8 <= avail, "the data section lies past the consumed bytes");
    const uint32_t vt = kvc_le_get_u32(p + off);
    FUZZ_CHECK(vt <= 1, "V layout flag %u was accepted", vt);
    /* (without layers there is no V to convert) */
    FUZZ_CHECK(vt == c->v_trans || c->n_layer == 0 || kvc_type_get(c->type_v)->blck_size == 1,
               "a V layout the cache cannot convert was accepted");
    L.vt = vt;
    L.end = fz_data_offsets(c->layers, c->n_layer, L.cc, off + 8, L.k_off, L.v_off);
    FUZZ_CHECK(L.end <= avail, "the part spans %zu bytes, %zu were consumed", L.end, avail);
    return L;
}

/* Byte address, in the part, of V element j of the part's cell k (one-element blocks). */
static inline const uint8_t *blob_v_elem(const kvc_unified *c, const layout *L, uint32_t l, uint32_t k, uint32_t j) {
    const size_t el = v_elem(c);
    return L->p + L->v_off[l] + (L->vt ? ((size_t)j * L->cc + k) * el : (size_t)k * c->layers[l].v_row_bytes + (size_t)j * el);
}

/* The bytes state_write must produce after the read: the consumed part with canonical ids
 * (per sequence: the destination id; whole cache: ascending, each once), ext bytes of each cell's
 * extension (those the part has, the defaults 0, 0, KVC_TOKEN_NULL for the rest), V in the cache's
 * layout and, without K/V memory, zero rows. */
static inline uint8_t *canonical(const kvc_unified *c, int32_t seq_id, const layout *L, bool meta_only, uint32_t ext,
                                 size_t *len) {
    const uint8_t defaults[12] = { 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 0xff, 0xff };
    FUZZ_CHECK(ext <= sizeof defaults, "an extension of %u bytes", ext);
    uint8_t *out = fz_alloc(L->end + (size_t)L->cc * ext);
    size_t o = 4, i_off = 4;
    memcpy(out, L->p, 4);
    for (uint32_t i = 0; i < L->cc; i++) {
        const uint32_t n_ids = kvc_le_get_u32(L->p + i_off + 4);
        const size_t kept = L->ext < ext ? L->ext : ext;
        memcpy(out + o, L->p + i_off, 4);
        memcpy(out + o + 8, L->p + i_off + 8, kept);
        memcpy(out + o + 8 + kept, defaults + kept, ext - kept);
        const size_t ids = i_off + 8 + L->ext;
        if (seq_id >= 0) {
            kvc_le_put_u32(out + o + 4, 1);
            kvc_le_put_u32(out + o + 8 + ext, (uint32_t)seq_id);
            o += 12 + ext;
        } else {
            uint64_t bits = 0;
            for (uint32_t j = 0; j < n_ids; j++) {
                bits |= (uint64_t)1 << kvc_le_get_u32(L->p + ids + 4 * (size_t)j);
            }
            kvc_le_put_u32(out + o + 4, kvc_popcount64(bits));
            o += 8 + ext;
            for (; bits; bits &= bits - 1) {
                kvc_le_put_u32(out + o, kvc_ctz64(bits));
                o += 4;
            }
        }
        i_off = ids + 4 * (size_t)n_ids;
    }
    kvc_le_put_u32(out + o, c->v_trans);
    memcpy(out + o + 4, L->p + L->meta_end + 4, 4);
    o += 8;
    for (uint32_t l = 0; l < c->n_layer; l++) {
        const size_t n = (size_t)L->cc * c->layers[l].k_row_bytes;
        memcpy(out + o, L->p + L->k_off[l] - 12, 12);
        if (meta_only) {
            memset(out + o + 12, 0, n);
        } else {
            memcpy(out + o + 12, L->p + L->k_off[l], n);
        }
        o += 12 + n;
    }
    for (uint32_t l = 0; l < c->n_layer; l++) {
        const kvc_layer *ly = &c->layers[l];
        const size_t n = (size_t)L->cc * ly->v_row_bytes, el = v_elem(c);
        memcpy(out + o, L->p + L->v_off[l] - 12, 4); /* the type */
        if (c->v_trans) {
            kvc_le_put_u32(out + o + 4, (uint32_t)el);
            kvc_le_put_u32(out + o + 8, ly->n_embd_v);
        } else {
            const uint64_t row = ly->v_row_bytes;
            kvc_le_put_u32(out + o + 4, (uint32_t)row);
            kvc_le_put_u32(out + o + 8, (uint32_t)(row >> 32));
        }
        uint8_t *d = out + o + 12;
        if (meta_only) {
            memset(d, 0, n);
        } else if (L->vt == c->v_trans) {
            memcpy(d, L->p + L->v_off[l], n);
        } else {
            for (uint32_t k = 0; k < L->cc; k++) {
                for (uint32_t j = 0; j < ly->n_embd_v; j++) {
                    const size_t at = c->v_trans ? ((size_t)j * L->cc + k) * el : (size_t)k * ly->v_row_bytes + (size_t)j * el;
                    memcpy(d + at, blob_v_elem(c, L, l, k, j), el);
                }
            }
        }
        o += 12 + n;
    }
    *len = o;
    return out;
}

/* kvc_state_describe_ext of the part at p (of at most avail bytes), its cell records carrying ext
 * bytes of the extension: fails cleanly, or describes something inside the input; when `read` is
 * given (a whole-cache read of that part into cache c put its cells into `cells`, cell k into
 * cell k) it must agree with it, the cells' extensions included. */
static inline void fp_check_describe(const uint8_t *p, size_t avail, uint32_t ext, const kvc_unified *c,
                                     const kvc_cells *cells, const layout *read) {
    static int32_t pos[FP_DESC_CELLS];
    static uint64_t seq[FP_DESC_CELLS * KVC_SEQ_WORDS];   /* a cell's set in KVC_SEQ_WORDS words */
    static kvc_cell_ext exts[FP_DESC_CELLS];
    kvc_state_layer_desc layers[FP_MAX_LAYERS + 1];
    kvc_state_desc d;
    kvc_err err = { 0, "" };
    const int rc = kvc_state_describe_ext(p, avail, ext, &d, pos, seq, exts, FP_DESC_CELLS, layers, FP_MAX_LAYERS + 1,
                                          &err);
    if (rc != KVC_OK) {
        FUZZ_CHECK(rc == KVC_E_STATE && err.msg[0], "describe failed with %d (%s)", rc, err.msg);
        FUZZ_CHECK(!read, "describe refused a part a whole-cache read accepted: %s", err.msg);
        return;
    }
    FUZZ_CHECK(d.end <= avail && d.data_off < d.end && d.v_trans <= 1, "describe: end %zu, data at %zu, of %zu bytes",
               d.end, d.data_off, avail);
    if (!read) {
        return;
    }
#define FP_SAME(a, b, what)                                                                                    \
    FUZZ_CHECK((a) == (b), "describe after a whole-cache read: %s %lld != %lld", what, (long long)(a), (long long)(b))
    FP_SAME(d.cell_count, read->cc, "cell count");
    FP_SAME(d.end, read->end, "end");
    FP_SAME(d.data_off, read->meta_end, "data offset");
    FP_SAME(d.v_trans, read->vt, "V layout");
    FP_SAME(d.n_layer, c->n_layer, "layer count");
    for (uint32_t i = 0; i < read->cc && i < FP_DESC_CELLS; i++) {
        FP_SAME(pos[i], cells->pos[i], "cell position");
        for (uint32_t w = 0; w < KVC_SEQ_WORDS; w++) {
            FP_SAME(seq[KVC_SEQ_WORDS * i + w], w < cells->seq_words ? kvc_cells_seq_word(cells, i, w) : 0,
                    "cell sequence set");
        }
        if (ext) {
            FP_SAME(exts[i].x, cells->ext[i].x, "cell x");
            FP_SAME(exts[i].y, cells->ext[i].y, "cell y");
            FP_SAME(exts[i].tok, cells->ext[i].tok, "cell token");
        }
    }
    for (uint32_t l = 0; l < c->n_layer; l++) {
        FP_SAME(layers[l].k_offset + 12, read->k_off[l], "K offset");
        FP_SAME(layers[l].v_offset + 12, read->v_off[l], "V offset");
        FP_SAME(layers[l].k_row_size, c->layers[l].k_row_bytes, "K row size");
        FP_SAME(layers[l].k_bytes + layers[l].v_bytes,
                (uint64_t)read->cc * (c->layers[l].k_row_bytes + c->layers[l].v_row_bytes), "data bytes");
    }
#undef FP_SAME
}

#endif
