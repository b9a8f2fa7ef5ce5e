#include "kvc_state.h"

#include "kvc_section.h"
#include "kvc_le.h"
#include "kvc_types.h"

#include <inttypes.h>
#include <string.h>

/* ---------------------------------------------------------------------------------------------
 * Writing. A state is produced as a sequence of pieces (scalars, metadata records, runs of rows);
 * an emitter copies the part of each piece that falls in the requested window [lo, hi) of the blob,
 * so that one code path writes whole blobs and streams them in bounded chunks. Pieces entirely
 * before the window are skipped by their size alone.
 * ------------------------------------------------------------------------------------------- */

typedef struct emitter {
    uint64_t pos;    /* blob offset of the next piece */
    uint64_t lo, hi; /* the window */
    uint8_t *out;    /* out[0] is blob byte lo */
    bool     stream; /* K/V data with non-temporal stores (a window of KVC_STREAM_BYTES or more) */
} emitter;

/* Copy n bytes from src (streamed from 256 bytes on when stream), or zeros when the layer has no
 * memory attached. */
static void copy_or_zero(uint8_t *dst, const uint8_t *src, size_t n, bool stream) {
    if (src) {
        kvc_copy(dst, src, n, stream && n >= 256);
    } else {
        memset(dst, 0, n);
    }
}

static void emit(emitter *e, const uint8_t *src, size_t n) {
    const uint64_t a = e->pos, b = e->pos + n;
    if (b > e->lo && a < e->hi) {
        const uint64_t s = a > e->lo ? a : e->lo;
        const uint64_t t = b < e->hi ? b : e->hi;
        copy_or_zero(e->out + (size_t)(s - e->lo), src ? src + (size_t)(s - a) : NULL, (size_t)(t - s), e->stream);
    }
    e->pos = b;
}

/* True (and the piece of n bytes is passed over) when it lies outside the window. */
static bool emit_skip(emitter *e, uint64_t n) {
    if (e->pos + n <= e->lo || e->pos >= e->hi) {
        e->pos += n;
        return true;
    }
    return false;
}

static void emit_u32(emitter *e, uint32_t v) {
    uint8_t q[4];
    kvc_le_put_u32(q, v);
    emit(e, q, 4);
}

static bool src_listed(const kvc_state_src *s, uint32_t i) {
    if (s->seq_id >= 0) {
        return (s->empty_is_no_seq || s->pos[i] != -1) && kvc_seqs_has(s->seq, s->size, i, s->seq_id) &&
               !(s->swa && kvc_unified_is_masked_swa(s->swa, s->pos[i], s->swa_pmax));
    }
    return s->empty_is_no_seq ? !kvc_seqs_none(s->seq, s->size, s->seq_words, i) : s->pos[i] != -1;
}

/* Bytes of listed cell i's metadata record: pos, n_seq_id, the extension, the ids. */
static size_t src_meta_bytes(const kvc_state_src *s, uint32_t i) {
    if (s->seq_id >= 0) {
        return (s->single_writes_id ? 12 : 8) + s->ext_bytes;
    }
    return 8 + s->ext_bytes + 4 * (size_t)kvc_seqs_count(s->seq, s->size, s->seq_words, i);
}

/* Count the listed cells, their runs of consecutive cells and their metadata bytes. */
static void src_count(const kvc_state_src *s, uint32_t *cells, uint32_t *runs, uint64_t *meta) {
    uint32_t nc = 0, nr = 0;
    uint64_t m = 0;
    bool prev = false;
    for (uint32_t i = 0; i < s->size; i++) {
        const bool l = src_listed(s, i);
        if (l) {
            nc++;
            nr += !prev;
            m += src_meta_bytes(s, i);
        }
        prev = l;
    }
    *cells = nc;
    *runs = nr;
    *meta = m;
}

static uint64_t k_piece_bytes(const kvc_layer *l, uint32_t cc) { return 12 + (uint64_t)cc * l->k_row_bytes; }

static uint64_t v_piece_bytes(const kvc_state_src *s, const kvc_layer *l, uint32_t cc) {
    if (s->v_trans) {
        return 12 + (uint64_t)l->n_embd_v * cc * s->v_el;
    }
    return 12 + (uint64_t)cc * l->v_row_bytes;
}

static uint64_t src_total(const kvc_state_src *s, uint32_t cc, uint64_t meta) {
    uint64_t n = 4 + meta + 8;
    for (uint32_t il = 0; il < s->n_layer; il++) {
        kvc_layer l;
        s->layer(s->cache, il, &l);
        n += k_piece_bytes(&l, cc) + v_piece_bytes(s, &l, cc);
    }
    return n;
}

int kvc_state_check_sizes(uint32_t size, uint32_t n_seq_max, int32_t type_k, int32_t type_v, uint32_t n_layer,
                          const uint32_t *n_embd_k, const uint32_t *n_embd_v, kvc_err *err) {
    /* the state: cell count, per cell position, id count and ids, V layout, layer count, per
     * layer two 12-byte headers; the K/V memory: what the state's data sections hold at most */
    uint64_t meta, total = 4 + 4 + 4;
    bool ok = kvc_size_mul(size, 8 + 4 * (uint64_t)n_seq_max, &meta) && kvc_size_add(total, meta, &total);
    for (uint32_t l = 0; ok && l < n_layer; l++) {
        const uint64_t k_row = kvc_row_size(type_k, n_embd_k[l]), v_row = kvc_row_size(type_v, n_embd_v[l]);
        uint64_t kb, vb;
        ok = (k_row || !n_embd_k[l]) && (v_row || !n_embd_v[l]) && kvc_size_mul(k_row, size, &kb) &&
             kvc_size_mul(v_row, size, &vb) && kvc_size_add(total, 24, &total) && kvc_size_add(total, kb, &total) &&
             kvc_size_add(total, vb, &total);
    }
    if (!ok) {
        return kvc_err_set(err, KVC_E_ARG, "a cache of %" PRIu32 " cells and %" PRIu32 " layers of these row "
                           "widths has more bytes of K/V memory or state than a size_t can count (%zu)",
                           size, n_layer, (size_t)SIZE_MAX);
    }
    return KVC_OK;
}

size_t kvc_state_src_size(const kvc_state_src *s) {
    uint32_t cc, nr;
    uint64_t meta;
    src_count(s, &cc, &nr, &meta);
    return (size_t)src_total(s, cc, meta);
}

/* Rows of the listed cells: runs[2k, 2k+1) are the runs [b, e) in cell order. */
static void emit_rows(emitter *e, const uint32_t *runs, uint32_t nr, const uint8_t *base, size_t row) {
    for (uint32_t k = 0; k < nr && e->pos < e->hi; k++) {
        const uint32_t b = runs[2 * k], n = runs[2 * k + 1] - b;
        emit(e, base ? base + (size_t)b * row : NULL, (size_t)n * row);
    }
}

/* Runs of fewer cells than this on average: a transposed V row is gathered element by element
 * (a copy call for a run of a cell or two costs several times its bytes' time). */
#define GATHER_RUN 16u
/* Bytes of the tile a gathered row goes through before it is streamed out. */
#define GATHER_TILE 4096u

/* Elements idx[0, n) of el bytes of row into d. */
static void gather_elems(uint8_t *d, const uint8_t *row, const uint32_t *idx, uint32_t n, size_t el) {
    if (el == 2) {
        for (uint32_t i = 0; i < n; i++) {
            memcpy(d + 2 * (size_t)i, row + 2 * (size_t)idx[i], 2);
        }
    } else if (el == 4) {
        for (uint32_t i = 0; i < n; i++) {
            memcpy(d + 4 * (size_t)i, row + 4 * (size_t)idx[i], 4);
        }
    } else {
        for (uint32_t i = 0; i < n; i++) {
            memcpy(d + el * i, row + el * idx[i], el);
        }
    }
}

/* The elements of the listed cells idx[0, cc) of one row of a transposed V into out; with
 * stream through a tile that stays in the first-level cache and is then streamed out, so that
 * the row's reads and the blob's writes both go in address order. */
static void gather_row(uint8_t *out, const uint8_t *row, const uint32_t *idx, uint32_t cc, size_t el, bool stream) {
    if (!stream) {
        gather_elems(out, row, idx, cc, el);
        return;
    }
    uint8_t tile[GATHER_TILE];
    const uint32_t per = (uint32_t)(GATHER_TILE / el);
    for (uint32_t i = 0; i < cc; i += per) {
        const uint32_t m = cc - i < per ? cc - i : per;
        gather_elems(tile, row, idx + i, m, el);
        kvc_copy(out, tile, (size_t)m * el, true);
        out += (size_t)m * el;
    }
}

/* The state into the emitter's window; idx: the listed cells one by one, for gathering a
 * transposed V (NULL: each row copied by runs). */
static void emit_state(const kvc_state_src *s, uint32_t cc, uint64_t meta, const uint32_t *runs, uint32_t nr,
                       const uint32_t *idx, emitter *e) {
    emit_u32(e, cc);
    if (!emit_skip(e, meta)) {
        uint8_t rec[8 + 12 + 4 * KVC_MAX_SEQ];
        for (uint32_t k = 0; k < nr && e->pos < e->hi; k++) {
            for (uint32_t i = runs[2 * k]; i < runs[2 * k + 1]; i++) {
                size_t n = 8 + s->ext_bytes;
                kvc_le_put_i32(rec, s->pos[i]);
                if (s->ext_bytes) {
                    kvc_le_put_i32(rec + 8, s->ext[i].x);
                    kvc_le_put_i32(rec + 12, s->ext[i].y);
                    if (s->ext_bytes == 12) {
                        kvc_le_put_i32(rec + 16, s->ext[i].tok);
                    }
                }
                if (s->seq_id >= 0) {
                    kvc_le_put_u32(rec + 4, s->single_writes_id ? 1u : 0u);
                    if (s->single_writes_id) {
                        kvc_le_put_i32(rec + n, s->seq_id);
                        n += 4;
                    }
                } else {
                    /* the ids ascending, as the reference's std::set */
                    uint32_t count = 0;
                    for (int32_t id = kvc_seqs_next(s->seq, s->size, s->seq_words, i, -1); id >= 0;
                         id = kvc_seqs_next(s->seq, s->size, s->seq_words, i, id), n += 4, count++) {
                        kvc_le_put_i32(rec + n, id);
                    }
                    kvc_le_put_u32(rec + 4, count);
                }
                emit(e, rec, n);
            }
        }
    }
    emit_u32(e, s->v_trans ? 1u : 0u);
    emit_u32(e, s->n_layer);
    for (uint32_t il = 0; il < s->n_layer && e->pos < e->hi; il++) {
        kvc_layer l;
        s->layer(s->cache, il, &l);
        if (emit_skip(e, k_piece_bytes(&l, cc))) {
            continue;
        }
        uint8_t h[12];
        kvc_le_put_i32(h, s->type_k);
        kvc_le_put_u64(h + 4, (uint64_t)l.k_row_bytes);
        emit(e, h, 12);
        emit_rows(e, runs, nr, l.k, l.k_row_bytes);
    }
    for (uint32_t il = 0; il < s->n_layer && e->pos < e->hi; il++) {
        kvc_layer l;
        s->layer(s->cache, il, &l);
        if (emit_skip(e, v_piece_bytes(s, &l, cc))) {
            continue;
        }
        uint8_t h[12];
        kvc_le_put_i32(h, s->type_v);
        if (!s->v_trans) {
            kvc_le_put_u64(h + 4, (uint64_t)l.v_row_bytes);
            emit(e, h, 12);
            emit_rows(e, runs, nr, l.v, l.v_row_bytes);
            continue;
        }
        kvc_le_put_u32(h + 4, (uint32_t)s->v_el);
        kvc_le_put_u32(h + 8, l.n_embd_v);
        emit(e, h, 12);
        /* row j of the transposed V holds the listed cells' elements j: with every cell listed,
         * the rows are the layer's V as it is */
        const size_t stride = (size_t)s->size * s->v_el;
        if (nr == 1 && runs[0] == 0 && runs[1] == s->size) {
            emit(e, l.v, (size_t)l.n_embd_v * stride);
            continue;
        }
        const uint64_t row_bytes = (uint64_t)cc * s->v_el;
        for (uint32_t j = 0; j < l.n_embd_v && e->pos < e->hi; j++) {
            if (emit_skip(e, row_bytes)) {
                continue;
            }
            if (idx && l.v && e->pos >= e->lo && e->pos + row_bytes <= e->hi) {
                /* the whole row is in the window */
                gather_row(e->out + (size_t)(e->pos - e->lo), l.v + (size_t)j * stride, idx, cc, s->v_el, e->stream);
                e->pos += row_bytes;
            } else {
                emit_rows(e, runs, nr, l.v ? l.v + (size_t)j * stride : NULL, s->v_el);
            }
        }
    }
}

/* kvc_state_src_write; may_stream: a window of KVC_STREAM_BYTES or more streams its K/V data. */
static int src_write(const kvc_state_src *s, uint64_t offset, uint8_t *out, size_t cap, size_t *written,
                     bool may_stream) {
    *written = 0;
    uint32_t cc, nr;
    uint64_t meta;
    src_count(s, &cc, &nr, &meta);
    const uint64_t total = src_total(s, cc, meta);
    if (offset >= total || cap == 0) {
        return KVC_OK;
    }
    const uint64_t n = total - offset < cap ? total - offset : cap;
    uint32_t *runs = NULL;
    if (nr) {
        runs = kvc_malloc_n((uint64_t)nr * 2, sizeof *runs);
        if (!runs) {
            return KVC_E_NOMEM;
        }
        uint32_t k = 0;
        bool prev = false;
        for (uint32_t i = 0; i < s->size; i++) {
            const bool l = src_listed(s, i);
            if (l && !prev) {
                runs[2 * k] = i;
            } else if (!l && prev) {
                runs[2 * k++ + 1] = i;
            }
            prev = l;
        }
        if (prev) {
            runs[2 * k++ + 1] = s->size;
        }
    }
    /* short runs of a transposed V are gathered cell by cell (without memory for the list, by runs) */
    uint32_t *idx = NULL;
    if (s->v_trans && nr && cc < GATHER_RUN * nr && (idx = kvc_malloc_n(cc, sizeof *idx)) != NULL) {
        for (uint32_t k = 0, m = 0; k < nr; k++) {
            for (uint32_t i = runs[2 * k]; i < runs[2 * k + 1]; i++) {
                idx[m++] = i;
            }
        }
    }
    emitter e = { 0, offset, offset + n, out, may_stream && n >= KVC_STREAM_BYTES };
    emit_state(s, cc, meta, runs, nr, idx, &e);
    if (e.stream) {
        kvc_stream_fence();
    }
    kvc_free(idx);
    kvc_free(runs);
    *written = (size_t)n;
    return KVC_OK;
}

int kvc_state_src_write(const kvc_state_src *s, uint64_t offset, uint8_t *out, size_t cap, size_t *written) {
    return src_write(s, offset, out, cap, written, true);
}

/* --- framing: prefix, stream count, per-stream sections --------------------------------------- */

static bool src_empty(const kvc_state_src *s) {
    for (uint32_t i = 0; i < s->size; i++) {
        if (src_listed(s, i)) {
            return false;
        }
    }
    return true;
}

/* Bytes of stream k's section: its body, or in the stream layout its count alone when empty. */
static uint64_t framed_section_bytes(const kvc_state_framed *f, uint32_t k) {
    if ((f->layout & KVC_LAYOUT_STREAMS) && src_empty(&f->streams[k])) {
        return 4;
    }
    return kvc_state_src_size(&f->streams[k]);
}

static uint64_t framed_head_bytes(const kvc_state_framed *f) {
    return (f->prefix ? KVC_SEQ_PREFIX_BYTES : 0) + ((f->layout & KVC_LAYOUT_STREAMS) ? 4 : 0);
}

size_t kvc_state_framed_size(const kvc_state_framed *f) {
    uint64_t n = framed_head_bytes(f);
    for (uint32_t k = 0; k < f->n_stream; k++) {
        n += framed_section_bytes(f, k);
    }
    return (size_t)n;
}

int kvc_state_framed_write(const kvc_state_framed *f, uint64_t offset, uint8_t *out, size_t cap,
                           size_t *written) {
    *written = 0;
    uint8_t head[KVC_SEQ_PREFIX_BYTES + 4];
    size_t nh = 0;
    if (f->prefix) {
        kvc_le_put_u32(head, KVC_SEQ_MAGIC);
        kvc_le_put_i32(head + 4, f->seq_id);
        nh = KVC_SEQ_PREFIX_BYTES;
    }
    if (f->layout & KVC_LAYOUT_STREAMS) {
        kvc_le_put_u32(head + nh, f->n_stream);
        nh += 4;
    }
    const uint64_t end = offset + cap;
    size_t done = 0;
    /* the header, then each section, each copied where it meets [offset, end) */
    if (offset < nh) {
        const size_t n = (size_t)((end < nh ? end : nh) - offset);
        memcpy(out, head + offset, n);
        done += n;
    }
    uint64_t at = nh;
    for (uint32_t k = 0; k < f->n_stream && at < end; k++) {
        const uint64_t nb = framed_section_bytes(f, k);
        if (at + nb > offset) {
            const uint64_t lo = offset > at ? offset - at : 0;
            const uint64_t hi = end - at < nb ? end - at : nb;
            if (nb == 4 && (f->layout & KVC_LAYOUT_STREAMS) && src_empty(&f->streams[k])) {
                uint8_t zero[4] = { 0, 0, 0, 0 };
                memcpy(out + done, zero + lo, (size_t)(hi - lo));
            } else {
                size_t w = 0;
                const int rc = src_write(&f->streams[k], lo, out + done, (size_t)(hi - lo), &w,
                                         !(f->layout & KVC_LAYOUT_FRESH_OUT));
                if (rc != KVC_OK) {
                    return rc;
                }
            }
            done += (size_t)(hi - lo);
        }
        at += nb;
    }
    *written = done;
    return KVC_OK;
}

/* --- the unified cache as a writer source --------------------------------------------------- */

/* Bytes of V element of a transposed V (its type has block size 1). */
static size_t v_elem_bytes(const kvc_unified *c) {
    const kvc_type_info *t = kvc_type_get(c->type_v);
    return t ? t->type_size : 0;
}

static bool seq_id_valid(const kvc_unified *c, int32_t seq_id) {
    return seq_id >= -1 && (seq_id < 0 || (uint32_t)seq_id < c->n_seq_max);
}

/* One stream of a cache, as the writer's layer callback sees it. */
typedef struct stream_ref {
    const kvc_unified *c;
    uint32_t           stream;
} stream_ref;

/* Layer il of one stream: K rows (and V rows) of stream s start at row s * size; a transposed V
 * keeps per stream n_embd_v rows of size elements, the same bytes as size rows. */
static void unified_layer(const void *cache, uint32_t il, kvc_layer *out) {
    const stream_ref *ref = cache;
    const kvc_layer *l = &ref->c->layers[il];
    const size_t rows = (size_t)ref->stream * ref->c->cells.size;
    *out = *l;
    out->k = l->k ? l->k + rows * l->k_row_bytes : NULL;
    out->v = l->v ? l->v + rows * l->v_row_bytes : NULL;
}

/* Stream `ref->stream` of the cache as a writer source, with the cells a layout leaves out of a
 * single sequence's state. A sequence's cells are in its stream only, so the other streams of
 * its state come out empty. */
static void unified_src(const stream_ref *ref, int32_t seq_id, unsigned layout, kvc_state_src *s) {
    const kvc_unified *c = ref->c;
    const kvc_cells *cells = kvc_unified_stream_cells_c(c, ref->stream);
    s->swa = NULL;
    s->swa_pmax = -1;
    if (seq_id >= 0 && (layout & KVC_LAYOUT_SWA_TRIM) && c->swa_type != KVC_SWA_NONE) {
        s->swa = c;
        s->swa_pmax = kvc_unified_seq_pos_max(c, seq_id);
    }
    s->size = cells->size;
    s->pos = cells->pos;
    s->seq = cells->seq;
    s->seq_words = cells->seq_words;
    s->seq_id = seq_id;
    s->empty_is_no_seq = false;
    s->single_writes_id = true;
    s->type_k = c->type_k;
    s->type_v = c->type_v;
    s->v_trans = c->v_trans;
    s->v_el = v_elem_bytes(c);
    s->n_layer = c->n_layer;
    s->cache = ref;
    s->layer = unified_layer;
    s->ext = cells->ext;
    s->ext_bytes = cells->ext ? kvc_layout_ext_bytes(layout) : 0;
}

uint32_t kvc_unified_state_listed(const kvc_unified *c, int32_t seq_id, unsigned layout, uint32_t stream,
                                  uint8_t *listed) {
    const stream_ref ref = { c, stream };
    kvc_state_src src;
    unified_src(&ref, seq_id, layout, &src);
    uint32_t n = 0;
    for (uint32_t i = 0; i < src.size; i++) {
        listed[i] = src_listed(&src, i);
        n += listed[i];
    }
    return n;
}

/* The writer's view of a cache in a layout: a source per stream, framed. */
typedef struct unified_view {
    stream_ref       refs[KVC_MAX_SEQ];
    kvc_state_src    src[KVC_MAX_SEQ];
    kvc_state_framed f;
} unified_view;

/* Whether the layout can hold the cache's streams (a layout without stream counts holds one) and
 * its cells' extensions (the layouts before 0.3.17 have none: writing them there would lose them). */
static bool layout_fits(const kvc_unified *c, unsigned layout) {
    return ((layout & KVC_LAYOUT_STREAMS) || kvc_unified_n_stream(c) == 1) &&
           ((layout & KVC_LAYOUT_EXT_XY) || !kvc_unified_has_ext(c));
}

static void unified_framed(const kvc_unified *c, int32_t seq_id, unsigned layout, unified_view *v) {
    kvc_state_framed *f = &v->f;
    f->layout = layout & ~(unsigned)KVC_LAYOUT_DETECT;
    f->seq_id = seq_id;
    f->prefix = seq_id >= 0 && (layout & KVC_LAYOUT_PREFIX);
    f->n_stream = kvc_unified_n_stream(c);
    for (uint32_t k = 0; k < f->n_stream; k++) {
        v->refs[k].c = c;
        v->refs[k].stream = k;
        unified_src(&v->refs[k], seq_id, layout, &v->src[k]);
    }
    f->streams = v->src;
}

size_t kvc_unified_state_size_lay(const kvc_unified *c, int32_t seq_id, unsigned layout) {
    if (!seq_id_valid(c, seq_id) || !layout_fits(c, layout)) {
        return 0;
    }
    unified_view v; /* on the stack (some 32 KiB): sizing and writing a state allocate nothing */
    unified_framed(c, seq_id, layout, &v);
    return kvc_state_framed_size(&v.f);
}

size_t kvc_unified_state_size(const kvc_unified *c, int32_t seq_id) { return kvc_unified_state_size_lay(c, seq_id, 0); }

/* One thread's share of a state window: bytes [offset, offset + n) of the blob. */
typedef struct state_share {
    const kvc_state_framed *f;
    uint64_t                offset;
    uint8_t                *out;
    size_t                  n, written;
    int                     rc;
} state_share;

static void state_share_run(void *arg) {
    state_share *s = arg;
    s->rc = kvc_state_framed_write(s->f, s->offset, s->out, s->n, &s->written);
}

size_t kvc_state_share_bytes(size_t n, unsigned width) {
    /* n / width rounded up before the pages are: rounded down, `width` shares can fall short */
    const size_t each = n / width + (n % width != 0);
    return (each + 4095) & ~(size_t)4095;
}

/* The window [offset, offset + n) of the blob written as at most `width` windows of whole pages,
 * one a thread: the writer copies any window on its own, reading the cache only. */
static int state_write_shared(const kvc_state_framed *f, uint64_t offset, uint8_t *out, size_t n, unsigned width,
                              size_t *written) {
    state_share shares[KVC_MAX_THREADS];
    const size_t per = kvc_state_share_bytes(n, width);
    unsigned k = 0;
    for (size_t done = 0; done < n && k < width; k++) {
        const size_t m = n - done < per || k == width - 1 ? n - done : per;
        shares[k] = (state_share){ f, offset + done, out + done, m, 0, KVC_OK };
        done += m;
    }
    kvc_parallel(state_share_run, shares, sizeof shares[0], k);
    size_t total = 0;
    for (unsigned i = 0; i < k; i++) {
        if (shares[i].rc != KVC_OK) {
            return shares[i].rc;
        }
        total += shares[i].written;
    }
    *written = total;
    return KVC_OK;
}

int kvc_unified_state_write_range_lay(kvc_unified *c, int32_t seq_id, unsigned layout, uint64_t offset,
                                      uint8_t *out, size_t cap, size_t *written) {
    *written = 0;
    if (!seq_id_valid(c, seq_id) || !layout_fits(c, layout)) {
        return KVC_E_ARG;
    }
    kvc_unified_defrag_settle(c);
    unified_view v;
    unified_framed(c, seq_id, layout, &v);
    const uint64_t total = kvc_state_framed_size(&v.f);
    if (offset >= total || cap == 0) {
        return KVC_OK;
    }
    const size_t n = total - offset < cap ? (size_t)(total - offset) : cap;
    /* threads only when the caller set n_threads, and only while each share still streams */
    unsigned width = c->n_threads > KVC_MAX_THREADS ? KVC_MAX_THREADS : c->n_threads;
    while (width > 1 && n / width < KVC_STREAM_BYTES) {
        width--;
    }
    if (width > 1) {
        return state_write_shared(&v.f, offset, out, n, width, written);
    }
    return kvc_state_framed_write(&v.f, offset, out, n, written);
}

int kvc_unified_state_write_range(kvc_unified *c, int32_t seq_id, uint64_t offset, uint8_t *out,
                                  size_t cap, size_t *written) {
    return kvc_unified_state_write_range_lay(c, seq_id, 0, offset, out, cap, written);
}

int kvc_unified_state_write(kvc_unified *c, int32_t seq_id, uint8_t *out, size_t cap, size_t *written) {
    *written = 0;
    if (!seq_id_valid(c, seq_id)) {
        return KVC_E_ARG;
    }
    const size_t total = kvc_unified_state_size(c, seq_id);
    if (cap < total) {
        return KVC_E_NOSPACE;
    }
    return kvc_unified_state_write_range(c, seq_id, 0, out, total, written);
}

/* ---------------------------------------------------------------------------------------------
 * Reading: the section parser (kvc_section.h) validates a state against the cache while nothing
 * changes, then the apply.
 * ------------------------------------------------------------------------------------------- */

/* The cache as the section parser holds a state to it (every stream has one geometry: ref names
 * stream 0, and must outlive d). */
static void unified_dest(const stream_ref *ref, int32_t seq_id, unsigned flags, unsigned layout, kvc_sec_dest *d) {
    const kvc_unified *c = ref->c;
    memset(d, 0, sizeof *d);
    d->ext_bytes = kvc_unified_has_ext(c) ? kvc_layout_ext_bytes(layout) : 0;
    d->seq_id = seq_id;
    d->size = c->cells.size;
    d->single_n_ids = 1;
    d->n_seq_max = c->n_seq_max;
    d->seq_words = c->cells.seq_words;
    d->ids_once = c->semantics == KVC_SEM_2026;
    d->type_k = c->type_k;
    d->type_v = c->type_v;
    d->v_trans = c->v_trans;
    d->convert_v = (flags & KVC_STATE_CONVERT_V) != 0;
    d->can_convert_v = true;
    d->n_layer = c->n_layer;
    d->cache = ref;
    d->layer = unified_layer;
}

/* Validate one cache's memory state in a layout (a cache of the seed's semantics: one stream).
 * With streams, an empty section changes nothing of a single sequence; a whole-cache read has
 * cleared the cache (llama.cpp clears once, before the sections). sec->pos and sec->seq must be
 * released by the caller in every case. */
static int parse_state(const kvc_unified *c, int32_t seq_id, const uint8_t *data, size_t len, unsigned flags,
                       unsigned layout, kvc_section *sec, bool *noop, kvc_err *err) {
    kvc_cursor r = { data, data ? len : 0, 0 };
    const stream_ref ref = { c, 0 };
    kvc_sec_dest d;
    kvc_frame f;
    unified_dest(&ref, seq_id, flags, layout, &d);
    *noop = false;
    int rc = kvc_frame_begin(&r, layout, kvc_unified_n_stream(c), &f, err);
    for (uint32_t s = 0; rc == KVC_OK && s < f.n_stream; s++) {
        if (kvc_frame_take_empty(&r, &f)) {
            *noop = seq_id >= 0;
            sec->end = r.off;
            continue;
        }
        rc = kvc_sec_parse(&r, &d, sec, err);
    }
    return rc;
}

/* Scatter cc cells of V given as n_embd_v rows of cc elements (a transposed blob) into rows of
 * the cache (row of cell i at dst + i, or at cells[i] when cells is not NULL), or gather the
 * reverse: rows of the blob into the cache's transposed V. el is 2 or 4 for every type a
 * transposed V can have; memcpy of a constant size compiles to a plain load and store. */
static void v_transpose_in(uint8_t *v, size_t row, const uint8_t *src, uint32_t cc, uint32_t width, size_t el,
                           uint32_t dst, const int32_t *cells) {
    if (cells) {
        for (uint32_t i = 0; i < cc; i++) {
            uint8_t *d = v + (size_t)cells[i] * row;
            for (uint32_t j = 0; j < width; j++) {
                memcpy(d + (size_t)j * el, src + ((size_t)j * cc + i) * el, el);
            }
        }
        return;
    }
    for (uint32_t j = 0; j < width; j++) {
        const uint8_t *s = src + (size_t)j * cc * el;
        uint8_t *d = v + (size_t)dst * row + (size_t)j * el;
        if (el == 2) {
            for (uint32_t i = 0; i < cc; i++) {
                memcpy(d + (size_t)i * row, s + (size_t)i * 2, 2);
            }
        } else if (el == 4) {
            for (uint32_t i = 0; i < cc; i++) {
                memcpy(d + (size_t)i * row, s + (size_t)i * 4, 4);
            }
        } else {
            for (uint32_t i = 0; i < cc; i++) {
                memcpy(d + (size_t)i * row, s + (size_t)i * el, el);
            }
        }
    }
}

static void v_untranspose_in(uint8_t *v, uint32_t size, const uint8_t *src, size_t row, uint32_t cc,
                             uint32_t width, size_t el, uint32_t dst, const int32_t *cells) {
    if (cells) {
        for (uint32_t j = 0; j < width; j++) {
            uint8_t *d = v + (size_t)j * size * el;
            for (uint32_t i = 0; i < cc; i++) {
                memcpy(d + (size_t)cells[i] * el, src + (size_t)i * row + (size_t)j * el, el);
            }
        }
        return;
    }
    for (uint32_t j = 0; j < width; j++) {
        uint8_t *d = v + ((size_t)j * size + dst) * el;
        const uint8_t *s = src + (size_t)j * el;
        if (el == 2) {
            for (uint32_t i = 0; i < cc; i++) {
                memcpy(d + (size_t)i * 2, s + (size_t)i * row, 2);
            }
        } else if (el == 4) {
            for (uint32_t i = 0; i < cc; i++) {
                memcpy(d + (size_t)i * 4, s + (size_t)i * row, 4);
            }
        } else {
            for (uint32_t i = 0; i < cc; i++) {
                memcpy(d + (size_t)i * el, s + (size_t)i * row, el);
            }
        }
    }
}

/* Whether a read copies the K/V data of cc cells with non-temporal stores: from KVC_STREAM_BYTES
 * on (data that does not stay in the caches anyway). */
static bool stream_data(const kvc_unified *c, uint32_t cc) {
    uint64_t n = 0;
    for (uint32_t il = 0; il < c->n_layer; il++) {
        n += (uint64_t)cc * (c->layers[il].k_row_bytes + c->layers[il].v_row_bytes);
    }
    return n >= KVC_STREAM_BYTES;
}

/* n_rows transposed V rows of cc elements el, src's one after the other, into rows of `size`
 * elements from element dst (one copy when the rows are the whole buffer). */
static void v_rows_in(uint8_t *v, uint32_t size, const uint8_t *src, uint32_t cc, uint32_t n_rows, size_t el,
                      uint32_t dst, bool stream) {
    if (cc == size && dst == 0) {
        kvc_copy(v, src, (size_t)n_rows * cc * el, stream);
        return;
    }
    for (uint32_t j = 0; j < n_rows; j++) {
        kvc_copy(v + ((size_t)j * size + dst) * el, src + (size_t)j * cc * el, (size_t)cc * el, stream);
    }
}

/* Copy the validated K/V data of the blob into cells [dst, dst + cc), converting the V layout
 * when the blob's differs from the cache's. */
static void apply_data(kvc_unified *c, const kvc_state_plan *ps, uint32_t dst) {
    const uint32_t cc = ps->cell_count;
    const uint32_t size = c->cells.size;
    const bool blob_vt = ps->v_trans != 0;
    const bool stream = stream_data(c, cc);
    const uint8_t *p = ps->data + ps->data_off + 8;
    for (uint32_t ikv = 0; ikv < c->n_layer; ikv++) {
        const kvc_layer *l = &c->layers[ikv];
        if (l->k && cc) {
            kvc_copy(l->k + (size_t)dst * l->k_row_bytes, p + 12, (size_t)cc * l->k_row_bytes, stream);
        }
        p += 12 + (size_t)cc * l->k_row_bytes;
    }
    const size_t el = v_elem_bytes(c);
    for (uint32_t ikv = 0; ikv < c->n_layer; ikv++) {
        const kvc_layer *l = &c->layers[ikv];
        const uint8_t *src = p + 12;
        if (l->v && cc) {
            if (blob_vt && c->v_trans) {
                v_rows_in(l->v, size, src, cc, l->n_embd_v, el, dst, stream);
            } else if (blob_vt) {
                v_transpose_in(l->v, l->v_row_bytes, src, cc, l->n_embd_v, el, dst, NULL);
            } else if (c->v_trans) {
                v_untranspose_in(l->v, size, src, l->v_row_bytes, cc, l->n_embd_v, el, dst, NULL);
            } else {
                kvc_copy(l->v + (size_t)dst * l->v_row_bytes, src, (size_t)cc * l->v_row_bytes, stream);
            }
        }
        /* both layouts hold cc * v_row_bytes bytes of data after a 12-byte header */
        p += 12 + (size_t)cc * l->v_row_bytes;
    }
    if (stream) {
        kvc_stream_fence();
    }
}

/* Whole cache: clear, cell k of the state into cell k, head 0 (the reference's order). The data
 * of cells [0, cell_count) is overwritten below, so only the rest is zeroed. */
static void apply_whole(kvc_unified *c, const kvc_state_plan *ps) {
    /* the cache is replaced: a placement or an undo log from before would refer to cells that
     * now hold the state's (a restore() would empty them) */
    kvc_unified_slot_drop(c);
    kvc_unified_commit(c);
    kvc_cells_reset(&c->cells);
    c->head = 0;
    kvc_unified_zero_cells(c, 0, ps->cell_count, c->cells.size);
    const uint32_t nw = c->cells.seq_words;
    kvc_seqset touched;
    kvc_seqset_clear(&touched);
    for (uint32_t i = 0; i < ps->cell_count; i++) {
        const uint64_t *set = ps->seq + (size_t)i * nw;
        kvc_cells_set_raw(&c->cells, i, ps->pos[i], set);
        for (uint32_t w = 0; w < nw; w++) {
            touched.w[w] |= set[w];
        }
    }
    kvc_cells_rebuild_seq_pos(&c->cells, &touched);
    c->head = 0;
    if (ps->cell_count) {
        apply_data(c, ps, 0);
    }
}

/* Single sequence, as the reference restores one: remove the destination sequence, then let the
 * slot search place the state's cells as one ubatch of cell_count tokens of seq_id. Returns 1
 * when placed (at c->head), 0 when there is no room, KVC_E_NOMEM; c is changed in every case. */
static int place_cells(kvc_unified *c, const kvc_state_plan *ps) {
    const uint32_t cc = ps->cell_count;
    const int32_t seq_id = ps->seq_id;
    const uint32_t seq_off[2] = { 0, 1 };
    const int32_t seq_ids[1] = { seq_id };
    const kvc_ubatch ub = { cc, cc, 1, ps->pos, seq_off, seq_ids, NULL, NULL, NULL };
    kvc_unified_seq_rm(c, seq_id, -1, -1);
    const int found = kvc_unified_find_slot(c, &ub);
    if (found == 1 && c->head + cc > c->cells.size) {
        return KVC_E_INTERNAL; /* find_slot places a ubatch as one run at head */
    }
    return found;
}

/* The dry run of place_cells: is there room? Nothing observable changes (the recovery arrays may
 * grow, which is what lets the apply's own slot search succeed without allocating). */
static int check_room(kvc_unified *c, const kvc_state_plan *ps, kvc_err *err) {
    const uint32_t cc = ps->cell_count;
    kvc_unified_snapshot snap;
    if (kvc_unified_snapshot_take(c, &snap) != KVC_OK) {
        return kvc_err_set(err, KVC_E_NOMEM, "out of memory restoring %" PRIu32 " cells", cc);
    }
    /* the dry run is undone: it must not settle a pending defrag (move rows) either */
    c->defrag_pending = false;
    const int found = place_cells(c, ps);
    const uint32_t head = c->head;
    kvc_unified_snapshot_restore(c, &snap);
    kvc_unified_snapshot_free(&snap);
    if (found == 1) {
        return KVC_OK;
    }
    if (found == 0) {
        return kvc_err_set(err, KVC_E_STATE,
                           "no room: sequence %" PRId32 " needs %" PRIu32
                           " contiguous free cells, the cache has no such run (%" PRIu32 " cells, %" PRIu32
                           " used)",
                           ps->seq_id, cc, c->cells.size, c->cells.used);
    }
    if (found == KVC_E_INTERNAL) {
        return kvc_err_set(err, found, "slot at %" PRIu32 " for %" PRIu32 " cells exceeds the cache", head, cc);
    }
    return kvc_err_set(err, found, "out of memory restoring %" PRIu32 " cells", cc);
}

/* --- semantics 2026: a section per stream, scattered placement ----------------------------- */

/* Elements src[0, n) of el bytes into row at element cells[i] (constant-size moves for 2 and 4). */
static void scatter_elems(uint8_t *row, const int32_t *cells, const uint8_t *src, uint32_t n, size_t el) {
    if (el == 2) {
        for (uint32_t i = 0; i < n; i++) {
            memcpy(row + 2 * (size_t)cells[i], src + 2 * (size_t)i, 2);
        }
    } else if (el == 4) {
        for (uint32_t i = 0; i < n; i++) {
            memcpy(row + 4 * (size_t)cells[i], src + 4 * (size_t)i, 4);
        }
    } else {
        for (uint32_t i = 0; i < n; i++) {
            memcpy(row + el * (size_t)cells[i], src + el * i, el);
        }
    }
}

/* Copy the validated K/V data of section sec into cells[i] of its stream (cells NULL: cell i),
 * converting the V layout when the section's differs from the cache's. */
static void apply_data_2026(kvc_unified *c, const uint8_t *data, const kvc_state_sec *sec, const int32_t *cells) {
    const uint32_t cc = sec->cell_count;
    const size_t size = c->cells.size, base = (size_t)sec->stream * size;
    const size_t el = v_elem_bytes(c);
    const bool stream = stream_data(c, cc);
    const uint8_t *p = data + sec->data_off + 8;
    for (uint32_t ikv = 0; ikv < c->n_layer; ikv++) {
        const kvc_layer *l = &c->layers[ikv];
        const size_t row = l->k_row_bytes;
        const uint8_t *src = p + 12;
        if (l->k && !cells) {
            kvc_copy(l->k + base * row, src, (size_t)cc * row, stream);
        } else if (l->k) {
            for (uint32_t i = 0; i < cc; i++) {
                kvc_copy(l->k + (base + (size_t)cells[i]) * row, src + (size_t)i * row, row, stream);
            }
        }
        p += 12 + (size_t)cc * row;
    }
    for (uint32_t ikv = 0; ikv < c->n_layer; ikv++) {
        const kvc_layer *l = &c->layers[ikv];
        const size_t row = l->v_row_bytes;
        const uint8_t *src = p + 12;
        if (l->v && (sec->v_trans != 0) != c->v_trans) {
            if (sec->v_trans) {
                v_transpose_in(l->v + base * row, row, src, cc, l->n_embd_v, el, 0, cells);
            } else {
                v_untranspose_in(l->v + base * row, (uint32_t)size, src, row, cc, l->n_embd_v, el, 0, cells);
            }
        } else if (l->v && c->v_trans && !cells) {
            /* per stream n_embd_v rows of size elements; the blob: n_embd_v rows of cc */
            v_rows_in(l->v + base * row, (uint32_t)size, src, cc, l->n_embd_v, el, 0, stream);
        } else if (l->v && c->v_trans) {
            uint8_t *v = l->v + base * row;
            for (uint32_t j = 0; j < l->n_embd_v; j++) {
                const uint8_t *sj = src + (size_t)j * cc * el;
                uint8_t *dj = v + (size_t)j * size * el;
                scatter_elems(dj, cells, sj, cc, el);
            }
        } else if (l->v && !cells) {
            kvc_copy(l->v + base * row, src, (size_t)cc * row, stream);
        } else if (l->v) {
            for (uint32_t i = 0; i < cc; i++) {
                kvc_copy(l->v + (base + (size_t)cells[i]) * row, src + (size_t)i * row, row, stream);
            }
        }
        /* both layouts hold cc * v_row_bytes bytes of data after a 12-byte header */
        p += 12 + (size_t)cc * row;
    }
    if (stream) {
        kvc_stream_fence();
    }
}

/* One section of a single sequence's state, as the reference reads it: remove the destination
 * sequence from its stream, then place the cells as one ubatch of it (find_slot, cont false). */
int kvc_unified_state_place_2026(kvc_unified *c, int32_t seq_id, uint32_t cc, const int32_t *pos) {
    const uint32_t seq_off[2] = { 0, 1 };
    const int32_t seq_ids[1] = { seq_id };
    const kvc_ubatch ub = { cc, cc, 1, pos, seq_off, seq_ids, NULL, NULL, NULL };
    kvc_unified_seq_rm(c, seq_id, -1, -1);
    if (cc == 0) {
        return 1;
    }
    return kvc_unified_find_slot_2026(c, &ub, NULL);
}

void kvc_unified_state_put_ext_2026(kvc_unified *c, uint32_t stream, uint32_t cc, const kvc_cell_ext *ext) {
    /* the saved extensions go back as they were (llama.cpp puts them back after placing) */
    kvc_cells *cells = kvc_unified_stream_cells(c, stream);
    for (uint32_t i = 0; ext && cells->ext && i < cc; i++) {
        cells->ext[c->scatter.idx[i]] = ext[i];
    }
}

int kvc_unified_state_try_place_2026(kvc_unified *c, int32_t seq_id, const kvc_state_sec *secs, uint32_t n_sec,
                                     int32_t *cells, uint32_t *failed, uint32_t *used) {
    const uint32_t st = kvc_unified_stream_of(c, seq_id);
    kvc_cells saved;
    const kvc_slot slot = c->slot;
    const kvc_scatter scat = c->scatter;
    const uint32_t head = kvc_unified_stream_head_c(c, st);
    int32_t *idx = kvc_malloc_n(slot.n ? slot.n : 1, sizeof *idx);
    uint32_t *strm = kvc_malloc_n(c->n_stream, sizeof *strm);
    if (!idx || !strm || kvc_cells_init_like(&saved, kvc_unified_stream_cells(c, st)) != KVC_OK) {
        kvc_free(idx);
        kvc_free(strm);
        return KVC_E_NOMEM;
    }
    kvc_cells_copy(&saved, kvc_unified_stream_cells(c, st));
    memcpy(idx, scat.idx, (size_t)slot.n * sizeof *idx);
    memcpy(strm, scat.strm, (size_t)c->n_stream * sizeof *strm);
    int found = 1;
    uint32_t k;
    for (k = 0; k < n_sec && found == 1; k++) {
        found = kvc_unified_state_place_2026(c, seq_id, secs[k].cell_count, secs[k].pos);
    }
    if (found == 1 && cells && n_sec > 0) {
        memcpy(cells, c->scatter.idx, (size_t)secs[n_sec - 1].cell_count * sizeof *cells);
    }
    *failed = k - 1;
    *used = kvc_unified_stream_cells_c(c, st)->used;
    kvc_cells_copy(kvc_unified_stream_cells(c, st), &saved);
    *kvc_unified_stream_head(c, st) = head;
    memcpy(c->scatter.idx, idx, (size_t)slot.n * sizeof *idx);
    memcpy(c->scatter.strm, strm, (size_t)c->n_stream * sizeof *strm);
    c->scatter.n_groups = scat.n_groups;
    c->scatter.n_seq_tokens = scat.n_seq_tokens;
    c->slot = slot;
    kvc_cells_free(&saved);
    kvc_free(idx);
    kvc_free(strm);
    return found;
}

/* The dry run of a single sequence's sections: is there room for each in turn? */
static int check_room_2026(kvc_unified *c, const kvc_state_plan *plan, kvc_err *err) {
    uint32_t failed = 0, used = 0;
    const int found = kvc_unified_state_try_place_2026(c, plan->seq_id, plan->secs, plan->n_sec, NULL, &failed, &used);
    if (found == 1) {
        return KVC_OK;
    }
    if (found < 0) {
        return kvc_err_set(err, found, "out of memory restoring sequence %" PRId32, plan->seq_id);
    }
    return kvc_err_set(err, KVC_E_STATE,
                       "no room: sequence %" PRId32 " needs %" PRIu32 " free cells in stream %" PRIu32
                       " (%" PRIu32 " cells, %" PRIu32 " used without the sequence)",
                       plan->seq_id, plan->secs[failed].cell_count, kvc_unified_stream_of(c, plan->seq_id),
                       c->cells.size, used);
}

/* Validate a state for a cache of semantics 2026: a section per stream (one in a layout without
 * stream counts), each against a stream of the cache; for a single sequence, find room. */
static int prepare_2026(kvc_unified *c, int32_t seq_id, const uint8_t *data, size_t len, unsigned flags,
                        unsigned layout, kvc_state_plan *plan, kvc_err *err) {
    kvc_cursor r = { data, data ? len : 0, 0 };
    const stream_ref ref = { c, 0 };
    kvc_sec_dest d;
    kvc_frame f;
    int rc;
    plan->data = data;
    plan->seq_id = seq_id;
    unified_dest(&ref, seq_id, flags, layout, &d);
    if ((rc = kvc_frame_begin(&r, layout, c->n_stream, &f, err)) != KVC_OK) {
        return rc;
    }
    plan->secs = kvc_calloc(f.n_stream, sizeof *plan->secs);
    if (!plan->secs) {
        return kvc_err_set(err, KVC_E_NOMEM, "out of memory reading %" PRIu32 " streams", f.n_stream);
    }
    for (uint32_t s = 0; s < f.n_stream; s++) {
        const size_t at = r.off;
        if (kvc_frame_take_empty(&r, &f)) {
            continue;
        }
        kvc_section ps;
        memset(&ps, 0, sizeof ps);
        rc = kvc_sec_parse(&r, &d, &ps, err);
        kvc_state_sec *sec = &plan->secs[plan->n_sec++];
        sec->stream = seq_id < 0 ? s : kvc_unified_stream_of(c, seq_id);
        sec->cell_count = ps.cell_count;
        sec->data_off = ps.data_off;
        sec->v_trans = ps.v_trans;
        sec->pos = ps.pos; /* owned by the plan from here */
        sec->seq = ps.seq;
        sec->ext = ps.ext;
        if (rc != KVC_OK) {
            if (f.n_stream > 1) {
                kvc_err_wrap(err, rc, "stream %" PRIu32 " (from byte %zu)", s, at);
            }
            return rc;
        }
    }
    plan->len = r.off;
    /* a single sequence's state of empty sections only keeps the destination's cells */
    plan->noop = seq_id >= 0 && plan->n_sec == 0;
    if (seq_id >= 0 && plan->n_sec > 0) {
        return check_room_2026(c, plan, err);
    }
    return KVC_OK;
}

static void apply_2026(kvc_unified *c, const kvc_state_plan *plan) {
    if (plan->seq_id < 0) {
        /* clear (every stream, heads 0; queued stream copies stay), then cell k of section s into
         * cell k of stream s; of the K/V data only what no section overwrites is zeroed (the
         * K/V bytes end as llama.cpp's clear and read leave them) */
        kvc_unified_clear_cells(c);
        uint32_t filled[KVC_MAX_SEQ] = { 0 };
        for (uint32_t k = 0; k < plan->n_sec; k++) {
            filled[plan->secs[k].stream] = plan->secs[k].cell_count;
        }
        for (uint32_t s = 0; s < c->n_stream; s++) {
            kvc_unified_zero_cells(c, s, filled[s], c->cells.size);
        }
        const uint32_t nw = c->cells.seq_words;
        for (uint32_t k = 0; k < plan->n_sec; k++) {
            const kvc_state_sec *sec = &plan->secs[k];
            kvc_cells *cells = kvc_unified_stream_cells(c, sec->stream);
            kvc_seqset touched;
            kvc_seqset_clear(&touched);
            for (uint32_t i = 0; i < sec->cell_count; i++) {
                const uint64_t *set = sec->seq + (size_t)i * nw;
                kvc_cells_set_raw(cells, i, sec->pos[i], set);
                if (sec->ext) {
                    cells->ext[i] = sec->ext[i];
                }
                for (uint32_t w = 0; w < nw; w++) {
                    touched.w[w] |= set[w];
                }
            }
            kvc_cells_rebuild_seq_pos(cells, &touched);
            if (sec->cell_count) {
                apply_data_2026(c, plan->data, sec, NULL);
            }
        }
        return;
    }
    /* the same steps on the same cells as the prepare's dry run: the same cells, room found */
    for (uint32_t k = 0; k < plan->n_sec; k++) {
        const kvc_state_sec *sec = &plan->secs[k];
        if (kvc_unified_state_place_2026(c, plan->seq_id, sec->cell_count, sec->pos) == 1 && sec->cell_count) {
            apply_data_2026(c, plan->data, sec, c->scatter.idx);
            kvc_unified_state_put_ext_2026(c, sec->stream, sec->cell_count, sec->ext);
        }
    }
    kvc_unified_slot_drop(c);
}

void kvc_state_plan_free(kvc_state_plan *plan) {
    for (uint32_t k = 0; k < plan->n_sec; k++) {
        kvc_free(plan->secs[k].pos);
        kvc_free(plan->secs[k].seq);
        kvc_free(plan->secs[k].ext);
    }
    kvc_free(plan->secs);
    kvc_free(plan->pos);
    kvc_free(plan->seq);
    memset(plan, 0, sizeof *plan);
}

int kvc_unified_state_prepare(kvc_unified *c, int32_t seq_id, const uint8_t *data, size_t len,
                              kvc_state_plan *plan, kvc_err *err) {
    return kvc_unified_state_prepare_lay(c, seq_id, data, len, 0, 0, plan, err);
}

int kvc_unified_state_prepare_ex(kvc_unified *c, int32_t seq_id, const uint8_t *data, size_t len, unsigned flags,
                                 kvc_state_plan *plan, kvc_err *err) {
    return kvc_unified_state_prepare_lay(c, seq_id, data, len, flags, 0, plan, err);
}

int kvc_unified_state_prepare_lay(kvc_unified *c, int32_t seq_id, const uint8_t *data, size_t len, unsigned flags,
                                  unsigned layout, kvc_state_plan *plan, kvc_err *err) {
    memset(plan, 0, sizeof *plan);
    if (!seq_id_valid(c, seq_id)) {
        return kvc_err_set(err, KVC_E_ARG, "seq_id %" PRId32 " out of range [-1, %" PRIu32 ")", seq_id,
                           c->n_seq_max);
    }
    if (layout & KVC_LAYOUT_DETECT) {
        return kvc_err_set(err, KVC_E_ARG, "a part is prepared in a known layout (detection reads whole states)");
    }
    if (c->semantics == KVC_SEM_2026) {
        const int rc = prepare_2026(c, seq_id, data, len, flags, layout, plan, err);
        if (rc != KVC_OK) {
            kvc_state_plan_free(plan);
        }
        return rc;
    }
    kvc_section ps;
    memset(&ps, 0, sizeof ps);
    bool noop;
    int rc = parse_state(c, seq_id, data, len, flags, layout, &ps, &noop, err);
    plan->data = data;
    plan->seq_id = seq_id;
    plan->cell_count = ps.cell_count;
    plan->data_off = ps.data_off;
    plan->len = ps.end;
    plan->pos = ps.pos; /* owned by the plan from here */
    plan->seq = ps.seq;
    plan->v_trans = ps.v_trans;
    plan->noop = noop;
    if (rc == KVC_OK && noop) {
        plan->cell_count = 0;
    }
    /* an empty single-sequence part only removes the sequence (contract C1b): always possible */
    if (rc == KVC_OK && seq_id >= 0 && plan->cell_count > 0) {
        rc = check_room(c, plan, err);
    }
    if (rc != KVC_OK) {
        kvc_state_plan_free(plan);
    }
    return rc;
}

int kvc_unified_state_apply(kvc_unified *c, const kvc_state_plan *plan) {
    if (plan->noop) {
        return KVC_OK;
    }
    if (c->semantics == KVC_SEM_2026) {
        apply_2026(c, plan);
        return KVC_OK;
    }
    kvc_unified_defrag_settle(c);
    if (plan->seq_id < 0) {
        apply_whole(c, plan);
        return KVC_OK;
    }
    if (plan->cell_count == 0) {
        kvc_unified_seq_rm(c, plan->seq_id, -1, -1);
        return KVC_OK;
    }
    /* the same search on the same cells as the prepare's dry run: same slot, no allocation */
    const int found = place_cells(c, plan);
    if (found != 1) {
        return found < 0 ? found : KVC_E_INTERNAL;
    }
    kvc_unified_commit(c);
    kvc_unified_slot_drop(c);
    apply_data(c, plan, c->head);
    return KVC_OK;
}

int kvc_unified_state_read_parts(kvc_unified *const *caches, uint32_t n_parts, int32_t seq_id, const uint8_t *data,
                                 size_t len, size_t *consumed, kvc_err *err) {
    return kvc_unified_state_read_parts_lay(caches, n_parts, seq_id, data, len, 0, 0, consumed, NULL, err);
}

int kvc_unified_state_read_parts_ex(kvc_unified *const *caches, uint32_t n_parts, int32_t seq_id,
                                    const uint8_t *data, size_t len, unsigned flags, size_t *consumed,
                                    kvc_err *err) {
    return kvc_unified_state_read_parts_lay(caches, n_parts, seq_id, data, len, flags, 0, consumed, NULL, err);
}

/* Phase 1 of a read: validate every part from data[base, len) (and find room for it) while nothing
 * changes. KVC_OK with plans[0, n_parts) ready and *end = where the last part ends. */
static int prepare_parts(kvc_unified *const *caches, uint32_t n_parts, int32_t seq_id, const uint8_t *data,
                         size_t len, size_t base, unsigned flags, unsigned layout, kvc_state_plan *plans,
                         size_t *end, kvc_err *err) {
    size_t off = base;
    int rc = KVC_OK;
    uint32_t k;
    for (k = 0; k < n_parts && rc == KVC_OK; k++) {
        rc = kvc_unified_state_prepare_lay(caches[k], seq_id, off ? data + off : data, len - off, flags, layout,
                                           &plans[k], err);
        if (rc == KVC_OK) {
            off += plans[k].len;
        } else if (n_parts > 1) {
            kvc_err_wrap(err, rc, "part %" PRIu32 " of %" PRIu32 " (from byte %zu)", k, n_parts, off);
        } else if (off) {
            kvc_err_wrap(err, rc, "memory state (from byte %zu)", off);
        }
    }
    if (rc == KVC_OK && (flags & KVC_STATE_EXACT)) {
        rc = kvc_state_check_end(off, len, err);
    }
    if (rc != KVC_OK) {
        for (uint32_t j = 0; j < k && j < n_parts; j++) {
            kvc_state_plan_free(&plans[j]);
        }
        return rc;
    }
    *end = off;
    return KVC_OK;
}

static void free_plans(kvc_state_plan *plans, uint32_t n) {
    for (uint32_t k = 0; k < n; k++) {
        kvc_state_plan_free(&plans[k]);
    }
}

/* Whether data[0, len) is exactly n_parts memory states framed by layout (no prefix). */
static bool frames_exactly(const uint8_t *data, size_t len, unsigned layout, uint32_t n_parts, kvc_err *err) {
    size_t off = 0;
    for (uint32_t k = 0; k < n_parts; k++) {
        kvc_state_frame f;
        if (kvc_state_describe_frame(off ? data + off : data, len - off, layout, false, &f, NULL, NULL, 0, err) !=
            KVC_OK) {
            return false;
        }
        off += f.end;
    }
    return kvc_state_check_end(off, len, err) == KVC_OK;
}

/* Where the parts start: after the sequence-blob prefix when the layout has one and it is there. */
static int parts_base(int32_t seq_id, const uint8_t *data, size_t len, unsigned layout, size_t *base, kvc_err *err) {
    *base = 0;
    if (!(layout & KVC_LAYOUT_PREFIX)) {
        return KVC_OK;
    }
    int rc = kvc_state_prefix_skip(data, len, base, err);
    if (rc == KVC_OK && *base && seq_id < 0) {
        *base = 0;
        return kvc_err_set(err, KVC_E_STATE,
                           "the state starts with the sequence-blob magic 0x%08x (byte 0): a sequence's state "
                           "is read into a sequence (seq_id >= 0), not as the whole cache", KVC_SEQ_MAGIC);
    }
    return rc;
}

/* Whether prepared plans hold any cell (without one, the size of a cell's extension is moot). */
static bool plans_have_cells(const kvc_state_plan *plans, uint32_t n) {
    for (uint32_t k = 0; k < n; k++) {
        for (uint32_t s = 0; s < plans[k].n_sec; s++) {
            if (plans[k].secs[s].cell_count) {
                return true;
            }
        }
    }
    return false;
}

/* Detection for caches with the per-cell extension: the layouts a state of theirs may be in (the
 * newest first; with the prefix, those that have one), each tried against the caches; exactly
 * one must take the input whole (a state without cells reads alike in each: the first is
 * taken). KVC_OK with plans ready, *end and *layout set. */
static int detect_ext(kvc_unified *const *caches, uint32_t n_parts, int32_t seq_id, const uint8_t *data, size_t len,
                      size_t base, unsigned flags, unsigned streams, kvc_state_plan *plans, size_t *end,
                      unsigned *layout, kvc_err *err) {
    const unsigned xy = streams | KVC_LAYOUT_EXT_XY;
    const unsigned cand[4] = { xy | KVC_LAYOUT_EXT_TOK, xy, streams, 0 };
    const uint32_t n_cand = base ? 2 : 4;
    kvc_state_plan other[KVC_STATE_MAX_PARTS];
    kvc_err fail, first;
    uint32_t n_ok = 0, n_framed = 0;
    fail.msg[0] = first.msg[0] = 0;
    for (uint32_t k = 0; k < n_cand; k++) {
        kvc_err e, scratch;
        size_t e_end = 0;
        e.msg[0] = 0;
        const int rc = prepare_parts(caches, n_parts, seq_id, data, len, base, flags | KVC_STATE_EXACT, cand[k],
                                     n_ok ? other : plans, &e_end, &e);
        if (rc != KVC_OK) {
            /* the error worth telling: the one of the layout whose framing the bytes have */
            if (k == 0) {
                first = e;
            }
            if (frames_exactly(base ? data + base : data, len - base, cand[k] | KVC_LAYOUT_CELL_EXT, n_parts, &scratch)) {
                n_framed++;
                fail = e;
            }
            continue;
        }
        if (n_ok++) {
            free_plans(plans, n_parts);
            free_plans(other, n_parts);
            return kvc_err_set(err, KVC_E_STATE,
                               "the state reads in more than one layout (%zu bytes; cells with and without their "
                               "extension, or with streams and without): pass the layout to say which", len);
        }
        *end = e_end;
        *layout = cand[k];
        if (!plans_have_cells(plans, n_parts)) {
            break;
        }
    }
    if (n_ok == 0 && n_framed == 1) {
        return kvc_err_set(err, KVC_E_STATE, "%s", fail.msg);
    }
    if (n_ok == 0) {
        return kvc_err_set(err, KVC_E_STATE, "in no layout; as today's (12-byte cell extensions): %.200s", first.msg);
    }
    return KVC_OK;
}

int kvc_unified_state_read_parts_lay(kvc_unified *const *caches, uint32_t n_parts, int32_t seq_id,
                                     const uint8_t *data, size_t len, unsigned flags, unsigned layout,
                                     size_t *consumed, unsigned *used, kvc_err *err) {
    kvc_state_plan plans[KVC_STATE_MAX_PARTS];
    size_t end = 0, base = 0;
    int rc;
    *consumed = 0;
    if (n_parts == 0 || n_parts > KVC_STATE_MAX_PARTS) {
        return kvc_err_set(err, KVC_E_ARG, "%" PRIu32 " parts: expected 1 to %d", n_parts, KVC_STATE_MAX_PARTS);
    }
    for (uint32_t k = 0; k < n_parts; k++) {
        for (uint32_t j = 0; j < k; j++) {
            if (caches[j] == caches[k]) {
                /* a prepared plan is only valid for the cache as it was */
                return kvc_err_set(err, KVC_E_ARG, "parts %" PRIu32 " and %" PRIu32 " name the same cache", j, k);
            }
        }
    }
    if (layout & KVC_LAYOUT_DETECT) {
        const unsigned streams = layout & ~(unsigned)KVC_LAYOUT_DETECT;
        if ((rc = parts_base(seq_id, data, len, KVC_LAYOUT_PREFIX, &base, err)) != KVC_OK) {
            return rc;
        }
        bool ext = false;
        for (uint32_t k = 0; k < n_parts; k++) {
            ext = ext || kvc_unified_has_ext(caches[k]);
        }
        if (ext) {
            rc = detect_ext(caches, n_parts, seq_id, data, len, base, flags, KVC_LAYOUT_STREAMS, plans, &end,
                            &layout, err);
            if (rc == KVC_OK && base) {
                layout |= KVC_LAYOUT_PREFIX;
            }
        } else if (base) {
            layout = streams; /* only the stream layouts have the prefix */
            rc = prepare_parts(caches, n_parts, seq_id, data, len, base, flags, layout, plans, &end, err);
        } else {
            /* no mark in the bytes: the layout whose read against these caches takes exactly the
             * input (the checks against the caches tell far more apart than the structure) */
            kvc_state_plan other[KVC_STATE_MAX_PARTS];
            kvc_err e_seed, e_streams;
            size_t end_seed = 0;
            e_seed.msg[0] = e_streams.msg[0] = 0;
            const int r_streams = prepare_parts(caches, n_parts, seq_id, data, len, 0, flags | KVC_STATE_EXACT,
                                                streams, plans, &end, &e_streams);
            const int r_seed = prepare_parts(caches, n_parts, seq_id, data, len, 0, flags | KVC_STATE_EXACT, 0,
                                             other, &end_seed, &e_seed);
            if (r_streams == KVC_OK && r_seed == KVC_OK) {
                free_plans(plans, n_parts);
                free_plans(other, n_parts);
                return kvc_err_set(err, KVC_E_STATE,
                                   "the state reads both with and without stream counts (%zu bytes): pass the "
                                   "layout to say which", len);
            }
            if (r_seed == KVC_OK) {
                memcpy(plans, other, sizeof plans);
                end = end_seed;
                layout = 0;
            } else if (r_streams == KVC_OK) {
                layout = streams;
            } else {
                /* neither: the error of the framing the bytes have, when only one fits them */
                kvc_err scratch;
                const bool is_streams = frames_exactly(data, len, KVC_LAYOUT_STREAMS, n_parts, &scratch);
                const bool is_seed = frames_exactly(data, len, 0, n_parts, &scratch);
                if (is_streams != is_seed) {
                    const kvc_err *e = is_streams ? &e_streams : &e_seed;
                    return kvc_err_set(err, is_streams ? r_streams : r_seed, "%s", e->msg);
                }
                if (!is_streams) {
                    /* the bytes are no state's in either framing: what either read made of its
                     * counts would be numbers read from garbage, so say what the bytes are not */
                    return kvc_err_set(err, KVC_E_STATE,
                                       "not a cache state (%zu bytes): it frames as one in no layout, with or "
                                       "without stream counts (damaged, truncated or other data; pass the "
                                       "layout to see where a read of it stops)", len);
                }
                const int code = r_streams == KVC_E_STATE || r_seed != KVC_E_STATE ? r_streams : r_seed;
                return kvc_err_set(err, code, "in no layout: with stream counts, %.100s; without, %.100s",
                                   e_streams.msg, e_seed.msg);
            }
            rc = KVC_OK;
        }
    } else {
        if ((rc = parts_base(seq_id, data, len, layout, &base, err)) != KVC_OK) {
            return rc;
        }
        rc = prepare_parts(caches, n_parts, seq_id, data, len, base, flags, layout, plans, &end, err);
    }
    if (rc != KVC_OK) {
        return rc;
    }
    /* phase 2: apply them all; a prepared plan applies without failing */
    for (uint32_t k = 0; k < n_parts && rc == KVC_OK; k++) {
        rc = kvc_unified_state_apply(caches[k], &plans[k]);
        if (rc != KVC_OK) {
            kvc_err_set(err, rc, "part %" PRIu32 ": the cache changed after it was prepared", k);
        }
    }
    free_plans(plans, n_parts);
    if (rc == KVC_OK) {
        *consumed = end;
        if (used) {
            *used = layout;
        }
    }
    return rc;
}

int kvc_unified_state_read(kvc_unified *c, int32_t seq_id, const uint8_t *data, size_t len, size_t *consumed,
                           kvc_err *err) {
    return kvc_unified_state_read_ex(c, seq_id, data, len, 0, consumed, err);
}

int kvc_unified_state_read_ex(kvc_unified *c, int32_t seq_id, const uint8_t *data, size_t len, unsigned flags,
                              size_t *consumed, kvc_err *err) {
    kvc_unified *const caches[1] = { c };
    return kvc_unified_state_read_parts_ex(caches, 1, seq_id, data, len, flags, consumed, err);
}
