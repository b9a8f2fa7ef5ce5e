/* kvcache — writing memory states (see kvc_state_write.h). */
#include "kvc_state_write.h"

#include "kvc_defrag.h"
#include "kvc_le.h"

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

/* Cell i's sequences: its owner (with one), or its planes. */
static bool src_has(const kvc_state_src *s, uint32_t i, int32_t id) {
    return s->cells ? kvc_cells_seq_has(s->cells, i, id) : kvc_seqs_has(s->seq, s->size, i, id);
}
static uint32_t src_seq_count(const kvc_state_src *s, uint32_t i) {
    return s->cells ? kvc_cells_seq_count(s->cells, i) : kvc_seqs_count(s->seq, s->size, s->seq_words, i);
}
/* The smallest id > after holding cell i, or -1. */
static int32_t src_next(const kvc_state_src *s, uint32_t i, int32_t after) {
    return s->cells ? kvc_cells_seq_next(s->cells, i, after) : kvc_seqs_next(s->seq, s->size, s->seq_words, i, after);
}

static bool src_listed(const kvc_state_src *s, uint32_t i) {
    if (s->seq_id >= 0) {
        return (s->empty_is_no_seq || s->pos[i] != -1) && src_has(s, i, s->seq_id) &&
               !(s->swa && kvc_unified_is_masked_swa(s->swa, s->pos[i], s->swa_pmax));
    }
    return s->empty_is_no_seq ? src_seq_count(s, i) != 0 : s->pos[i] != -1;
}

/* Bytes of listed cell i's metadata record: pos, n_seq_id, the extension, the ids. */
static size_t src_meta_bytes(const kvc_state_src *s, uint32_t i) {
    if (s->seq_id >= 0) {
        return (s->single_writes_id ? 12 : 8) + s->ext_bytes;
    }
    return 8 + s->ext_bytes + 4 * (size_t)src_seq_count(s, i);
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

/* The same where each cell's rows lie in its snapshot plane (s->plane): a run is cut where the
 * plane changes. */
static void emit_plane_rows(emitter *e, const kvc_state_src *s, const uint32_t *runs, uint32_t nr,
                            const uint8_t *base, size_t row) {
    if (!s->plane || !base) {
        emit_rows(e, runs, nr, base, row);
        return;
    }
    for (uint32_t k = 0; k < nr && e->pos < e->hi; k++) {
        uint32_t b = runs[2 * k];
        while (b < runs[2 * k + 1] && e->pos < e->hi) {
            const uint32_t p = s->plane(s, b);
            uint32_t end = b + 1;
            while (end < runs[2 * k + 1] && s->plane(s, end) == p) {
                end++;
            }
            emit(e, base + ((size_t)p * s->size + b) * row, (size_t)(end - b) * row);
            b = end;
        }
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
                    for (int32_t id = src_next(s, i, -1); id >= 0; id = src_next(s, i, id), n += 4, count++) {
                        kvc_le_put_i32(rec + n, id);
                    }
                    kvc_le_put_u32(rec + 4, count);
                }
                emit(e, rec, n);
            }
        }
    }
    emit_u32(e, s->v_trans ? 1u : 0u);
    emit_u32(e, s->n_layer_field);
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
        emit_plane_rows(e, s, runs, nr, l.k, l.k_row_bytes);
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
            emit_plane_rows(e, s, runs, nr, l.v, l.v_row_bytes);
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

/* Stream `ref->stream` of the cache as a writer source, with the cells a layout leaves out of a
 * single sequence's state. A sequence's cells are in its stream only, so the other streams of
 * its state come out empty. */
static void unified_src(const kvc_state_stream *ref, int32_t seq_id, unsigned layout, kvc_state_src *s) {
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
    s->cells = cells;
    s->seq_words = cells->seq_words;
    s->seq_id = seq_id;
    s->empty_is_no_seq = false;
    s->single_writes_id = true;
    s->type_k = c->type_k;
    s->type_v = c->type_v;
    s->v_trans = c->v_trans;
    s->v_el = kvc_state_v_el(c);
    s->n_layer = c->n_layer;
    s->n_layer_field = c->n_layer;
    s->cache = ref;
    s->layer = kvc_state_stream_layer;
    s->ext = cells->ext;
    s->ext_bytes = cells->ext ? kvc_layout_ext_bytes(layout) : 0;
    s->plane = NULL;
}

uint32_t kvc_unified_state_listed(const kvc_unified *c, int32_t seq_id, unsigned layout, uint32_t stream,
                                  uint8_t *listed) {
    const kvc_state_stream ref = { c, stream };
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
    kvc_state_stream       refs[KVC_MAX_SEQ];
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
    if (!kvc_state_seq_valid(c, seq_id) || !layout_fits(c, layout)) {
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
    if (!kvc_state_seq_valid(c, seq_id) || !layout_fits(c, layout)) {
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
    if (!kvc_state_seq_valid(c, seq_id)) {
        return KVC_E_ARG;
    }
    const size_t total = kvc_unified_state_size(c, seq_id);
    if (cap < total) {
        return KVC_E_NOSPACE;
    }
    return kvc_unified_state_write_range(c, seq_id, 0, out, total, written);
}
