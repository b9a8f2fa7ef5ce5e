#include "kvc_state.h"

#include "kvc_cursor.h"
#include "kvc_le.h"
#include "kvc_types.h"

#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
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
} emitter;

/* Copy n bytes from src, or zeros when the layer has no memory attached. */
static void copy_or_zero(uint8_t *dst, const uint8_t *src, size_t n) {
    if (src) {
        memcpy(dst, src, n);
    } else {
        memset(dst, 0, n);
    }
}

static void emit(emitter *e, const uint8_t *src, size_t n) {
    const uint64_t a = e->pos, b = e->pos + n;
    if (b > e->lo && a < e->hi) {
        const uint64_t s = a > e->lo ? a : e->lo;
        const uint64_t t = b < e->hi ? b : e->hi;
        copy_or_zero(e->out + (size_t)(s - e->lo), src ? src + (size_t)(s - a) : NULL, (size_t)(t - s));
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

/* Bytes of listed cell i's metadata record: pos, n_seq_id, the ids. */
static size_t src_meta_bytes(const kvc_state_src *s, uint32_t i) {
    if (s->seq_id >= 0) {
        return s->single_writes_id ? 12 : 8;
    }
    return 8 + 4 * (size_t)kvc_seqs_count(s->seq, s->size, s->seq_words, i);
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

static uint64_t k_piece_bytes(const kvc_state_layer_src *l, uint32_t cc) { return 12 + (uint64_t)cc * l->k_row; }

static uint64_t v_piece_bytes(const kvc_state_src *s, const kvc_state_layer_src *l, uint32_t cc) {
    if (s->v_trans) {
        return 12 + (uint64_t)l->n_embd_v * cc * s->v_el;
    }
    return 12 + (uint64_t)cc * l->v_row;
}

static uint64_t src_total(const kvc_state_src *s, uint32_t cc, uint64_t meta) {
    uint64_t n = 4 + meta + 8;
    for (uint32_t il = 0; il < s->n_layer; il++) {
        kvc_state_layer_src l;
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

static void emit_state(const kvc_state_src *s, uint32_t cc, uint64_t meta, const uint32_t *runs, uint32_t nr,
                       emitter *e) {
    emit_u32(e, cc);
    if (!emit_skip(e, meta)) {
        uint8_t rec[8 + 4 * KVC_MAX_SEQ];
        for (uint32_t k = 0; k < nr && e->pos < e->hi; k++) {
            for (uint32_t i = runs[2 * k]; i < runs[2 * k + 1]; i++) {
                size_t n = 8;
                kvc_le_put_i32(rec, s->pos[i]);
                if (s->seq_id >= 0) {
                    kvc_le_put_u32(rec + 4, s->single_writes_id ? 1u : 0u);
                    if (s->single_writes_id) {
                        kvc_le_put_i32(rec + 8, s->seq_id);
                        n = 12;
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
        kvc_state_layer_src l;
        s->layer(s->cache, il, &l);
        if (emit_skip(e, k_piece_bytes(&l, cc))) {
            continue;
        }
        uint8_t h[12];
        kvc_le_put_i32(h, s->type_k);
        kvc_le_put_u64(h + 4, (uint64_t)l.k_row);
        emit(e, h, 12);
        emit_rows(e, runs, nr, l.k, l.k_row);
    }
    for (uint32_t il = 0; il < s->n_layer && e->pos < e->hi; il++) {
        kvc_state_layer_src l;
        s->layer(s->cache, il, &l);
        if (emit_skip(e, v_piece_bytes(s, &l, cc))) {
            continue;
        }
        uint8_t h[12];
        kvc_le_put_i32(h, s->type_v);
        if (!s->v_trans) {
            kvc_le_put_u64(h + 4, (uint64_t)l.v_row);
            emit(e, h, 12);
            emit_rows(e, runs, nr, l.v, l.v_row);
            continue;
        }
        kvc_le_put_u32(h + 4, (uint32_t)s->v_el);
        kvc_le_put_u32(h + 8, l.n_embd_v);
        emit(e, h, 12);
        /* row j of the transposed V holds the listed cells' elements j */
        const size_t stride = (size_t)s->size * s->v_el;
        for (uint32_t j = 0; j < l.n_embd_v && e->pos < e->hi; j++) {
            if (!emit_skip(e, (uint64_t)cc * s->v_el)) {
                emit_rows(e, runs, nr, l.v ? l.v + (size_t)j * stride : NULL, s->v_el);
            }
        }
    }
}

int kvc_state_src_write(const kvc_state_src *s, uint64_t offset, uint8_t *out, size_t cap, size_t *written) {
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
    emitter e = { 0, offset, offset + n, out };
    emit_state(s, cc, meta, runs, nr, &e);
    kvc_free(runs);
    *written = (size_t)n;
    return KVC_OK;
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
                const int rc = kvc_state_src_write(&f->streams[k], lo, out + done, (size_t)(hi - lo), &w);
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
static void unified_layer(const void *cache, uint32_t il, kvc_state_layer_src *out) {
    const stream_ref *ref = cache;
    const kvc_layer *l = &ref->c->layers[il];
    const size_t rows = (size_t)ref->stream * ref->c->cells.size;
    out->k = l->k ? l->k + rows * l->k_row_bytes : NULL;
    out->v = l->v ? l->v + rows * l->v_row_bytes : NULL;
    out->k_row = l->k_row_bytes;
    out->v_row = l->v_row_bytes;
    out->n_embd_v = l->n_embd_v;
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

/* Whether the layout can hold the cache's streams (a layout without stream counts holds one). */
static bool layout_fits(const kvc_unified *c, unsigned layout) {
    return (layout & KVC_LAYOUT_STREAMS) || kvc_unified_n_stream(c) == 1;
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
    return kvc_state_framed_write(&v.f, offset, out, total - offset < cap ? (size_t)(total - offset) : cap, written);
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
 * Reading: a bounds-checked cursor, a validating parse that changes nothing, then the apply.
 * ------------------------------------------------------------------------------------------- */

/* "truncated at byte X of N while reading <what>" (X: where the failed read starts). */
int kvc_cur_truncated(kvc_err *err, const kvc_cursor *r, size_t need, const char *fmt, ...) {
    char what[160];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof what, fmt, ap);
    va_end(ap);
    if (!need) {
        return kvc_err_set(err, KVC_E_STATE, "state truncated at byte %zu of %zu while reading %s", r->off, r->len,
                           what);
    }
    return kvc_err_set(err, KVC_E_STATE, "state truncated at byte %zu of %zu while reading %s (%zu bytes)",
                       r->off, r->len, what, need);
}

static const char *type_name(int32_t id) {
    const kvc_type_info *t = kvc_type_get(id);
    return t ? t->name : "unknown";
}

/* What the parse learned; offsets are into the blob. With cache NULL (describing a blob) the
 * fields the cache would be checked against are recorded in desc, pos, seq, layers instead. */
typedef struct parsed {
    uint32_t cell_count;
    uint32_t v_trans;    /* the blob's V layout */
    size_t   data_off;   /* where v_trans is */
    size_t   end;        /* bytes of the state */
    int32_t *pos;        /* with a cache: the positions (kvc_malloc'ed), else NULL */
    uint64_t *seq;       /* with a cache, whole: the sequence sets, seq_words words per cell
                          * (kvc_malloc'ed), else NULL */
    /* describing */
    kvc_state_desc       *desc;
    int32_t              *d_pos;
    uint64_t             *d_seq;          /* KVC_SEQ_WORDS words per cell */
    uint32_t              d_pos_cap;
    kvc_state_layer_desc *d_layers;
    uint32_t              d_layers_cap;
} parsed;

static int parse_meta(const kvc_unified *c, int32_t seq_id, kvc_cursor *r, parsed *ps, kvc_err *err) {
    const uint32_t cc = ps->cell_count;
    const size_t min_rec = seq_id >= 0 ? 12 : 8;
    /* nothing is allocated for more cells than the bytes left can describe */
    if ((r->len - r->off) / min_rec < cc) {
        return kvc_err_set(err, KVC_E_STATE,
                           "state truncated at byte %zu of %zu: %" PRIu32
                           " cells need at least %zu bytes of metadata, %zu remain",
                           r->off, r->len, cc, (size_t)cc * min_rec, r->len - r->off);
    }
    /* the apply takes the cells from here, never from the blob again (it may change meanwhile) */
    const uint32_t nw = c ? c->cells.seq_words : KVC_SEQ_WORDS;
    if (c && cc > 0) {
        ps->pos = kvc_malloc_n(cc, sizeof *ps->pos);
        if (seq_id < 0) {
            ps->seq = kvc_malloc_n((uint64_t)cc * nw, sizeof *ps->seq);
        }
        if (!ps->pos || (seq_id < 0 && !ps->seq)) {
            return kvc_err_set(err, KVC_E_NOMEM, "out of memory reading a state of %" PRIu32 " cells", cc);
        }
    }
    const uint32_t id_limit = c ? c->n_seq_max : KVC_MAX_SEQ;
    for (uint32_t i = 0; i < cc; i++) {
        int32_t pos;
        uint32_t n_seq_id;
        if (!kvc_cur_i32(r, &pos)) {
            return kvc_cur_truncated(err, r, 4, "the position of cell %" PRIu32 " of %" PRIu32, i, cc);
        }
        if (pos < 0) {
            return kvc_err_set(err, KVC_E_STATE, "cell %" PRIu32 " (byte %zu): negative position %" PRId32, i,
                               r->off - 4, pos);
        }
        if (!kvc_cur_u32(r, &n_seq_id)) {
            return kvc_cur_truncated(err, r, 4, "the sequence count of cell %" PRIu32 " of %" PRIu32, i, cc);
        }
        if (!c) {
            kvc_state_desc *d = ps->desc;
            d->n_seq_id_min = i == 0 || n_seq_id < d->n_seq_id_min ? n_seq_id : d->n_seq_id_min;
            d->n_seq_id_max = n_seq_id > d->n_seq_id_max ? n_seq_id : d->n_seq_id_max;
            if (i < ps->d_pos_cap) {
                ps->d_pos[i] = pos;
            }
        }
        if (c && seq_id >= 0) {
            if (n_seq_id != 1) {
                return kvc_err_set(err, KVC_E_STATE,
                                   "cell %" PRIu32 " (byte %zu): %" PRIu32
                                   " sequence ids in a single-sequence state (must be 1)",
                                   i, r->off - 4, n_seq_id);
            }
            int32_t ignored; /* the source sequence id: the destination replaces it */
            if (!kvc_cur_i32(r, &ignored)) {
                return kvc_cur_truncated(err, r, 4, "the sequence id of cell %" PRIu32 " of %" PRIu32, i, cc);
            }
            ps->pos[i] = pos;
            continue;
        }
        if ((r->len - r->off) / 4 < n_seq_id) {
            return kvc_err_set(err, KVC_E_STATE,
                               "state truncated at byte %zu of %zu: cell %" PRIu32 " lists %" PRIu32
                               " sequence ids, %zu bytes remain",
                               r->off, r->len, i, n_seq_id, r->len - r->off);
        }
        kvc_seqset bits;
        kvc_seqset_clear(&bits);
        for (uint32_t j = 0; j < n_seq_id; j++) {
            int32_t s;
            if (!kvc_cur_i32(r, &s)) {
                return kvc_cur_truncated(err, r, 4, "sequence id %" PRIu32 " of %" PRIu32 " of cell %" PRIu32, j,
                                      n_seq_id, i);
            }
            if (s < 0 || (uint32_t)s >= id_limit) {
                return kvc_err_set(err, KVC_E_STATE,
                                   "cell %" PRIu32 " (byte %zu): sequence id %" PRId32
                                   " out of range [0, %" PRIu32 ")",
                                   i, r->off - 4, s, id_limit);
            }
            if (c && c->semantics == KVC_SEM_2026 && kvc_seqset_has(&bits, s)) {
                /* today's llama.cpp keeps a sequence's positions per cell: an id listed twice
                 * is malformed */
                return kvc_err_set(err, KVC_E_STATE, "cell %" PRIu32 " (byte %zu): sequence id %" PRId32 " listed twice",
                                   i, r->off - 4, s);
            }
            kvc_seqset_add(&bits, s); /* a repeated id sets its bit again, as the reference does */
        }
        if (c) {
            ps->pos[i] = pos;
            memcpy(ps->seq + (size_t)i * nw, bits.w, nw * sizeof *ps->seq);
        } else if (i < ps->d_pos_cap) {
            memcpy(ps->d_seq + (size_t)i * KVC_SEQ_WORDS, bits.w, sizeof bits.w);
        }
    }
    return KVC_OK;
}

/* "layer IL (byte AT): <what>" for a per-layer field that disagrees with the cache. */
KVC_PRINTF_FORMAT(4, 5) static int fail_layer(kvc_err *err, int32_t il, size_t at, const char *fmt, ...) {
    char what[160];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof what, fmt, ap);
    va_end(ap);
    return kvc_err_set(err, KVC_E_STATE, "layer %" PRId32 " (byte %zu): %s", il, at, what);
}

/* Take the n = count * unit data bytes of a section, checking the product against what is left. */
static int take_data(kvc_cursor *r, uint64_t count, uint64_t unit, const char *what, int32_t il, uint64_t *n,
                     kvc_err *err) {
    const uint8_t *skip;
    const size_t left = r->len - r->off;
    *n = 0;
    if (unit != 0 && count > left / unit) {
        return kvc_err_set(err, KVC_E_STATE,
                           "state truncated at byte %zu of %zu while reading the %s of layer %" PRId32
                           " (%" PRIu64 " x %" PRIu64 " bytes, %zu remain)",
                           r->off, r->len, what, il, count, unit, left);
    }
    *n = count * unit;
    kvc_cur_take(r, (size_t)*n, &skip);
    return KVC_OK;
}

/* Per layer V: i32 type, u64 row size (or u32 element size, u32 width when the blob's V is
 * transposed), the data. l is the cache's layer (NULL when describing), il its model index. */
static int parse_layer_v(const kvc_unified *c, const kvc_layer *l, int32_t il, kvc_cursor *r, parsed *ps,
                         kvc_state_layer_desc *ld, kvc_err *err) {
    const uint32_t cc = ps->cell_count;
    const size_t at = r->off;
    int32_t type;
    if (!kvc_cur_i32(r, &type)) {
        return kvc_cur_truncated(err, r, 4, "the value type of layer %" PRId32, il);
    }
    if (c && type != c->type_v) {
        return fail_layer(err, il, r->off - 4, "value type %" PRId32 " (%s) != cache's %" PRId32 " (%s)",
                          type, type_name(type), c->type_v, type_name(c->type_v));
    }
    if (ps->v_trans) {
        uint32_t el_ref, width;
        if (!kvc_cur_u32(r, &el_ref)) {
            return kvc_cur_truncated(err, r, 4, "the value element size of layer %" PRId32, il);
        }
        if (c) {
            /* a transposed V stores single elements: the type must have blocks of one element
             * (the cache's own V may be rows when converting) */
            const kvc_type_info *t = kvc_type_get(c->type_v);
            if (t->blck_size != 1) {
                return fail_layer(err, il, r->off - 4,
                                  "value type %s has blocks of %" PRIu32 " elements and cannot be transposed",
                                  t->name, t->blck_size);
            }
            if (el_ref != t->type_size) {
                return fail_layer(err, il, r->off - 4, "value element size %" PRIu32 " != cache's %" PRIu32,
                                  el_ref, t->type_size);
            }
        }
        if (!kvc_cur_u32(r, &width)) {
            return kvc_cur_truncated(err, r, 4, "the value width of layer %" PRId32, il);
        }
        if (c && width != l->n_embd_v) {
            return fail_layer(err, il, r->off - 4, "value width (n_embd_v_gqa) %" PRIu32 " != cache's %" PRIu32,
                              width, l->n_embd_v);
        }
        uint64_t n;
        int rc = take_data(r, (uint64_t)cc, (uint64_t)width * el_ref, "values", il, &n, err);
        if (rc != KVC_OK) {
            return rc;
        }
        if (ld) {
            ld->v_type = type;
            ld->v_elem_size = el_ref;
            ld->v_width = width;
            ld->v_offset = at;
            ld->v_bytes = n;
        }
        return KVC_OK;
    }
    uint64_t row;
    if (!kvc_cur_u64(r, &row)) {
        return kvc_cur_truncated(err, r, 8, "the value row size of layer %" PRId32, il);
    }
    /* a transposed cache's v_row_bytes is its width times the element size: what rows of the
     * blob must hold to be converted */
    if (c && row != (uint64_t)l->v_row_bytes) {
        return fail_layer(err, il, r->off - 8, "value row size %" PRIu64 " != cache's %zu", row,
                          l->v_row_bytes);
    }
    uint64_t n;
    int rc = take_data(r, (uint64_t)cc, row, "values", il, &n, err);
    if (rc != KVC_OK) {
        return rc;
    }
    if (ld) {
        ld->v_type = type;
        ld->v_row_size = row;
        ld->v_offset = at;
        ld->v_bytes = n;
    }
    return KVC_OK;
}

static int parse_layer_k(const kvc_unified *c, const kvc_layer *l, int32_t il, kvc_cursor *r, uint32_t cc,
                         kvc_state_layer_desc *ld, kvc_err *err) {
    const size_t at = r->off;
    int32_t type;
    uint64_t row;
    if (!kvc_cur_i32(r, &type)) {
        return kvc_cur_truncated(err, r, 4, "the key type of layer %" PRId32, il);
    }
    if (c && type != c->type_k) {
        return fail_layer(err, il, r->off - 4, "key type %" PRId32 " (%s) != cache's %" PRId32 " (%s)", type,
                          type_name(type), c->type_k, type_name(c->type_k));
    }
    if (!kvc_cur_u64(r, &row)) {
        return kvc_cur_truncated(err, r, 8, "the key row size of layer %" PRId32, il);
    }
    if (c && row != (uint64_t)l->k_row_bytes) {
        return fail_layer(err, il, r->off - 8, "key row size %" PRIu64 " != cache's %zu", row, l->k_row_bytes);
    }
    uint64_t n;
    int rc = take_data(r, (uint64_t)cc, row, "keys", il, &n, err);
    if (rc == KVC_OK && ld) {
        ld->k_type = type;
        ld->k_row_size = row;
        ld->k_offset = at;
        ld->k_bytes = n;
    }
    return rc;
}

/* The data section: V layout flag, layer count, every layer's K then every layer's V. */
static int parse_data(const kvc_unified *c, kvc_cursor *r, parsed *ps, unsigned flags, kvc_err *err) {
    static const char *const layout[2] = { "not transposed", "transposed" };
    uint32_t v_trans, n_layer;
    int rc;
    if (!kvc_cur_u32(r, &v_trans)) {
        return kvc_cur_truncated(err, r, 4, "the V layout flag");
    }
    if (v_trans > 1) {
        return kvc_err_set(err, KVC_E_STATE, "V layout (byte %zu): flag %" PRIu32 " is neither 0 nor 1",
                           r->off - 4, v_trans);
    }
    if (c && (v_trans != 0) != c->v_trans && !(flags & KVC_STATE_CONVERT_V)) {
        return kvc_err_set(err, KVC_E_STATE,
                           "V layout (byte %zu): the state has V %s, the cache %s (conversion not requested)",
                           r->off - 4, layout[v_trans], layout[c->v_trans]);
    }
    ps->v_trans = v_trans;
    if (!kvc_cur_u32(r, &n_layer)) {
        return kvc_cur_truncated(err, r, 4, "the layer count");
    }
    if (c && n_layer != c->n_layer) {
        return kvc_err_set(err, KVC_E_STATE,
                           "layer count (byte %zu): the state has %" PRIu32 ", the cache %" PRIu32, r->off - 4,
                           n_layer, c->n_layer);
    }
    /* each layer takes at least 24 bytes of headers */
    if ((r->len - r->off) / 24 < n_layer) {
        return kvc_err_set(err, KVC_E_STATE,
                           "state truncated at byte %zu of %zu: %" PRIu32
                           " layers need at least %zu bytes of headers, %zu remain",
                           r->off, r->len, n_layer, (size_t)n_layer * 24, r->len - r->off);
    }
    if (!c) {
        ps->desc->v_trans = v_trans;
        ps->desc->n_layer = n_layer;
    }
    for (uint32_t ikv = 0; ikv < n_layer; ikv++) {
        const kvc_layer *l = c ? &c->layers[ikv] : NULL;
        kvc_state_layer_desc *ld = !c && ikv < ps->d_layers_cap ? &ps->d_layers[ikv] : NULL;
        if ((rc = parse_layer_k(c, l, l ? l->il : (int32_t)ikv, r, ps->cell_count, ld, err)) != KVC_OK) {
            return rc;
        }
    }
    for (uint32_t ikv = 0; ikv < n_layer; ikv++) {
        const kvc_layer *l = c ? &c->layers[ikv] : NULL;
        kvc_state_layer_desc *ld = !c && ikv < ps->d_layers_cap ? &ps->d_layers[ikv] : NULL;
        if ((rc = parse_layer_v(c, l, l ? l->il : (int32_t)ikv, r, ps, ld, err)) != KVC_OK) {
            return rc;
        }
    }
    return KVC_OK;
}

/* Validate one stream's body at the cursor (the seed's state: cell count, cells, data); nothing in
 * the cache changes. On success ps says where things are (ps->pos and ps->seq must be freed by the
 * caller in every case). */
static int parse_body(const kvc_unified *c, int32_t seq_id, kvc_cursor *r, unsigned flags, parsed *ps, kvc_err *err) {
    int rc;
    if (!kvc_cur_u32(r, &ps->cell_count)) {
        return kvc_cur_truncated(err, r, 4, "the cell count");
    }
    if (c && ps->cell_count > c->cells.size) {
        return kvc_err_set(err, KVC_E_STATE,
                           "not enough cells: the state holds %" PRIu32 " cells (byte %zu), the cache has %" PRIu32,
                           ps->cell_count, r->off - 4, c->cells.size);
    }
    if ((rc = parse_meta(c, seq_id, r, ps, err)) != KVC_OK) {
        return rc;
    }
    ps->data_off = r->off;
    if ((rc = parse_data(c, r, ps, flags, err)) != KVC_OK) {
        return rc;
    }
    ps->end = r->off;
    return KVC_OK;
}

/* The stream count of a state in the stream layout: want (the cache's) or, with want 0, any
 * count from 1 to KVC_MAX_SEQ. */
static int parse_stream_count(kvc_cursor *r, uint32_t want, uint32_t *n, kvc_err *err) {
    if (!kvc_cur_u32(r, n)) {
        return kvc_cur_truncated(err, r, 4, "the stream count");
    }
    if (want && *n != want) {
        return kvc_err_set(err, KVC_E_STATE,
                           "n_stream mismatch: the state has %" PRIu32 " streams (byte %zu), the cache %" PRIu32,
                           *n, r->off - 4, want);
    }
    if (*n == 0 || *n > KVC_MAX_SEQ) {
        return kvc_err_set(err, KVC_E_STATE, "stream count %" PRIu32 " (byte %zu): expected 1 to %d", *n,
                           r->off - 4, KVC_MAX_SEQ);
    }
    return KVC_OK;
}

/* True (and the 4-byte count taken) when the stream section at the cursor is empty. */
static bool take_empty_section(kvc_cursor *r) {
    if (r->len - r->off >= 4 && kvc_le_get_u32(r->p + r->off) == 0) {
        r->off += 4;
        return true;
    }
    return false;
}

/* Validate one cache's memory state in a layout. With streams, each stream section goes to the
 * cache's stream of the same index (a single sequence: to its stream); the cache has one stream
 * today, so the plan holds one section. */
static int parse_state(const kvc_unified *c, int32_t seq_id, const uint8_t *data, size_t len, unsigned flags,
                       unsigned layout, parsed *ps, bool *noop, kvc_err *err) {
    kvc_cursor r = { data, data ? len : 0, 0 };
    *noop = false;
    if (!(layout & KVC_LAYOUT_STREAMS)) {
        return parse_body(c, seq_id, &r, flags, ps, err);
    }
    uint32_t n_stream = 0;
    int rc = parse_stream_count(&r, kvc_unified_n_stream(c), &n_stream, err);
    if (rc != KVC_OK) {
        return rc;
    }
    for (uint32_t s = 0; s < n_stream; s++) {
        if (take_empty_section(&r)) {
            /* an empty section changes nothing of a single sequence; a whole-cache read has
             * cleared the cache (llama.cpp clears once, before the sections) */
            *noop = seq_id >= 0;
            ps->end = r.off;
            continue;
        }
        if ((rc = parse_body(c, seq_id, &r, flags, ps, err)) != KVC_OK) {
            return rc;
        }
    }
    return KVC_OK;
}

int kvc_state_prefix_skip(const uint8_t *data, size_t len, size_t *off, kvc_err *err) {
    *off = 0;
    if (!data || len < 4 || kvc_le_get_u32(data) != KVC_SEQ_MAGIC) {
        return KVC_OK;
    }
    if (len < KVC_SEQ_PREFIX_BYTES) {
        return kvc_err_set(err, KVC_E_STATE,
                           "state truncated at byte 4 of %zu while reading the sequence id of the sequence-blob "
                           "prefix (4 bytes)", len);
    }
    *off = KVC_SEQ_PREFIX_BYTES;
    return KVC_OK;
}

int kvc_state_describe_frame(const uint8_t *data, size_t len, unsigned layout, bool allow_prefix,
                             kvc_state_frame *f, size_t *sec_off, uint32_t *sec_cells, uint32_t sec_cap,
                             kvc_err *err) {
    memset(f, 0, sizeof *f);
    kvc_cursor r = { data, data ? len : 0, 0 };
    int rc;
    if (allow_prefix && (layout & KVC_LAYOUT_PREFIX)) {
        size_t off;
        if ((rc = kvc_state_prefix_skip(data, len, &off, err)) != KVC_OK) {
            return rc;
        }
        if (off) {
            f->prefixed = true;
            f->src_seq_id = kvc_le_get_i32(data + 4);
            r.off = off;
        }
    }
    f->n_stream = 1;
    if ((layout & KVC_LAYOUT_STREAMS) && (rc = parse_stream_count(&r, 0, &f->n_stream, err)) != KVC_OK) {
        return rc;
    }
    for (uint32_t s = 0; s < f->n_stream; s++) {
        const size_t at = r.off;
        uint32_t cells = 0;
        if (!(layout & KVC_LAYOUT_STREAMS) || !take_empty_section(&r)) {
            kvc_state_desc d;
            rc = kvc_state_describe(r.p + r.off, r.len - r.off, &d, NULL, NULL, 0, NULL, 0, err);
            if (rc != KVC_OK) {
                if (f->n_stream > 1 || at) {
                    char inner[sizeof err->msg];
                    memcpy(inner, err->msg, sizeof inner);
                    kvc_err_set(err, rc, "stream %" PRIu32 " (from byte %zu): %s", s, at, inner);
                }
                return rc;
            }
            cells = d.cell_count;
            r.off += d.end;
        }
        if (s < sec_cap) {
            sec_off[s] = at;
            sec_cells[s] = cells;
        }
    }
    f->end = r.off;
    return KVC_OK;
}

int kvc_state_describe(const uint8_t *data, size_t len, kvc_state_desc *d, int32_t *pos, uint64_t *seq,
                       uint32_t pos_cap, kvc_state_layer_desc *layers, uint32_t layers_cap, kvc_err *err) {
    memset(d, 0, sizeof *d);
    parsed ps;
    memset(&ps, 0, sizeof ps);
    ps.desc = d;
    ps.d_pos = pos;
    ps.d_seq = seq;
    ps.d_pos_cap = pos && seq ? pos_cap : 0;
    ps.d_layers = layers;
    ps.d_layers_cap = layers ? layers_cap : 0;
    if (layers) {
        memset(layers, 0, (size_t)layers_cap * sizeof *layers);
    }
    /* the whole-cache record shape: n_seq_id and the ids are read as they are */
    kvc_cursor r = { data, data ? len : 0, 0 };
    const int rc = parse_body(NULL, -1, &r, 0, &ps, err);
    d->cell_count = ps.cell_count;
    d->data_off = ps.data_off;
    d->end = ps.end;
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

/* Copy the validated K/V data of the blob into cells [dst, dst + cc), converting the V layout
 * when the blob's differs from the cache's. */
static void apply_data(kvc_unified *c, const kvc_state_plan *ps, uint32_t dst) {
    const uint32_t cc = ps->cell_count;
    const uint32_t size = c->cells.size;
    const bool blob_vt = ps->v_trans != 0;
    const uint8_t *p = ps->data + ps->data_off + 8;
    for (uint32_t ikv = 0; ikv < c->n_layer; ikv++) {
        const kvc_layer *l = &c->layers[ikv];
        if (l->k && cc) {
            memcpy(l->k + (size_t)dst * l->k_row_bytes, p + 12, (size_t)cc * l->k_row_bytes);
        }
        p += 12 + (size_t)cc * l->k_row_bytes;
    }
    const size_t el = v_elem_bytes(c);
    for (uint32_t ikv = 0; ikv < c->n_layer; ikv++) {
        const kvc_layer *l = &c->layers[ikv];
        const uint8_t *src = p + 12;
        if (l->v && cc) {
            if (blob_vt && c->v_trans) {
                for (uint32_t j = 0; j < l->n_embd_v; j++) {
                    memcpy(l->v + ((size_t)j * size + dst) * el, src + (size_t)j * cc * el, (size_t)cc * el);
                }
            } else if (blob_vt) {
                v_transpose_in(l->v, l->v_row_bytes, src, cc, l->n_embd_v, el, dst, NULL);
            } else if (c->v_trans) {
                v_untranspose_in(l->v, size, src, l->v_row_bytes, cc, l->n_embd_v, el, dst, NULL);
            } else {
                memcpy(l->v + (size_t)dst * l->v_row_bytes, src, (size_t)cc * l->v_row_bytes);
            }
        }
        /* both layouts hold cc * v_row_bytes bytes of data after a 12-byte header */
        p += 12 + (size_t)cc * l->v_row_bytes;
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
    kvc_unified_zero_cells(c, ps->cell_count, c->cells.size);
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
    const kvc_ubatch ub = { cc, cc, 1, ps->pos, seq_off, seq_ids };
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

/* Copy the validated K/V data of section sec into cells[i] of its stream (cells NULL: cell i),
 * converting the V layout when the section's differs from the cache's. */
static void apply_data_2026(kvc_unified *c, const uint8_t *data, const kvc_state_sec *sec, const int32_t *cells) {
    const uint32_t cc = sec->cell_count;
    const size_t size = c->cells.size, base = (size_t)sec->stream * size;
    const size_t el = v_elem_bytes(c);
    const uint8_t *p = data + sec->data_off + 8;
    for (uint32_t ikv = 0; ikv < c->n_layer; ikv++) {
        const kvc_layer *l = &c->layers[ikv];
        const size_t row = l->k_row_bytes;
        const uint8_t *src = p + 12;
        if (l->k && !cells) {
            memcpy(l->k + base * row, src, (size_t)cc * row);
        } else if (l->k) {
            for (uint32_t i = 0; i < cc; i++) {
                memcpy(l->k + (base + (size_t)cells[i]) * row, src + (size_t)i * row, row);
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
        } else if (l->v && c->v_trans) {
            /* per stream n_embd_v rows of size elements; the blob: n_embd_v rows of cc */
            uint8_t *v = l->v + base * row;
            for (uint32_t j = 0; j < l->n_embd_v; j++) {
                const uint8_t *sj = src + (size_t)j * cc * el;
                uint8_t *dj = v + (size_t)j * size * el;
                if (!cells) {
                    memcpy(dj, sj, (size_t)cc * el);
                    continue;
                }
                for (uint32_t i = 0; i < cc; i++) {
                    memcpy(dj + (size_t)cells[i] * el, sj + (size_t)i * el, el);
                }
            }
        } else if (l->v && !cells) {
            memcpy(l->v + base * row, src, (size_t)cc * row);
        } else if (l->v) {
            for (uint32_t i = 0; i < cc; i++) {
                memcpy(l->v + (base + (size_t)cells[i]) * row, src + (size_t)i * row, row);
            }
        }
        /* both layouts hold cc * v_row_bytes bytes of data after a 12-byte header */
        p += 12 + (size_t)cc * row;
    }
}

/* One section of a single sequence's state, as the reference reads it: remove the destination
 * sequence from its stream, then place the cells as one ubatch of it (find_slot, cont false). */
int kvc_unified_state_place_2026(kvc_unified *c, int32_t seq_id, uint32_t cc, const int32_t *pos) {
    const uint32_t seq_off[2] = { 0, 1 };
    const int32_t seq_ids[1] = { seq_id };
    const kvc_ubatch ub = { cc, cc, 1, pos, seq_off, seq_ids };
    kvc_unified_seq_rm(c, seq_id, -1, -1);
    if (cc == 0) {
        return 1;
    }
    return kvc_unified_find_slot_2026(c, &ub, NULL);
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
    if (!idx || !strm || kvc_cells_init(&saved, c->cells.size, c->n_seq_max) != KVC_OK) {
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
    uint32_t n_stream = 1;
    int rc;
    plan->data = data;
    plan->seq_id = seq_id;
    if (layout & KVC_LAYOUT_STREAMS) {
        if ((rc = parse_stream_count(&r, c->n_stream, &n_stream, err)) != KVC_OK) {
            return rc;
        }
    } else if (c->n_stream != 1) {
        return kvc_err_set(err, KVC_E_STATE,
                           "n_stream mismatch: a state without stream counts holds 1 stream, the cache %" PRIu32,
                           c->n_stream);
    }
    plan->secs = kvc_calloc(n_stream, sizeof *plan->secs);
    if (!plan->secs) {
        return kvc_err_set(err, KVC_E_NOMEM, "out of memory reading %" PRIu32 " streams", n_stream);
    }
    for (uint32_t s = 0; s < n_stream; s++) {
        const size_t at = r.off;
        if ((layout & KVC_LAYOUT_STREAMS) && take_empty_section(&r)) {
            continue;
        }
        parsed ps;
        memset(&ps, 0, sizeof ps);
        rc = parse_body(c, seq_id, &r, flags & KVC_STATE_CONVERT_V, &ps, err);
        kvc_state_sec *sec = &plan->secs[plan->n_sec++];
        sec->stream = seq_id < 0 ? s : kvc_unified_stream_of(c, seq_id);
        sec->cell_count = ps.cell_count;
        sec->data_off = ps.data_off;
        sec->v_trans = ps.v_trans;
        sec->pos = ps.pos;
        sec->seq = ps.seq;
        if (rc != KVC_OK) {
            if (n_stream > 1) {
                char inner[sizeof err->msg];
                memcpy(inner, err->msg, sizeof inner);
                kvc_err_set(err, rc, "stream %" PRIu32 " (from byte %zu): %s", s, at, inner);
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
        /* clear (every stream, heads 0, K/V zeroed; queued stream copies stay), then cell k of
         * section s into cell k of stream s */
        kvc_unified_clear(c);
        const uint32_t nw = c->cells.seq_words;
        for (uint32_t k = 0; k < plan->n_sec; k++) {
            const kvc_state_sec *sec = &plan->secs[k];
            kvc_cells *cells = kvc_unified_stream_cells(c, sec->stream);
            kvc_seqset touched;
            kvc_seqset_clear(&touched);
            for (uint32_t i = 0; i < sec->cell_count; i++) {
                const uint64_t *set = sec->seq + (size_t)i * nw;
                kvc_cells_set_raw(cells, i, sec->pos[i], set);
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
        }
    }
    kvc_unified_slot_drop(c);
}

void kvc_state_plan_free(kvc_state_plan *plan) {
    for (uint32_t k = 0; k < plan->n_sec; k++) {
        kvc_free(plan->secs[k].pos);
        kvc_free(plan->secs[k].seq);
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
    parsed ps;
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
        } else if ((n_parts > 1 || off) && err) {
            char inner[sizeof err->msg];
            memcpy(inner, err->msg, sizeof inner);
            if (n_parts > 1) {
                kvc_err_set(err, rc, "part %" PRIu32 " of %" PRIu32 " (from byte %zu): %s", k, n_parts, off, inner);
            } else {
                kvc_err_set(err, rc, "memory state (from byte %zu): %s", off, inner);
            }
        }
    }
    if (rc == KVC_OK && (flags & KVC_STATE_EXACT) && off != len) {
        rc = kvc_err_set(err, KVC_E_STATE, "%zu trailing bytes after the state (it ends at byte %zu of %zu)",
                         len - off, off, len);
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
    if (off != len) {
        kvc_err_set(err, KVC_E_STATE, "%zu trailing bytes after the state (it ends at byte %zu of %zu)", len - off,
                    off, len);
        return false;
    }
    return true;
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
        if (base) {
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
