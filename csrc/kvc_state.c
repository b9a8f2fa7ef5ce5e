#include "kvc_state.h"

#include "kvc_types.h"

#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

/* ---------------------------------------------------------------------------------------------
 * Little-endian scalars. The blob format is little-endian whatever the host; the K/V rows are
 * copied as they are stored.
 * ------------------------------------------------------------------------------------------- */

static void put_u32(uint8_t *p, uint32_t v) {
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
    p[2] = (uint8_t)(v >> 16);
    p[3] = (uint8_t)(v >> 24);
}

static void put_u64(uint8_t *p, uint64_t v) {
    put_u32(p, (uint32_t)v);
    put_u32(p + 4, (uint32_t)(v >> 32));
}

static void put_i32(uint8_t *p, int32_t v) { put_u32(p, (uint32_t)v); }

static uint32_t get_u32(const uint8_t *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static uint64_t get_u64(const uint8_t *p) { return (uint64_t)get_u32(p) | (uint64_t)get_u32(p + 4) << 32; }

/* Two's complement reinterpretation without implementation-defined conversion. */
static int32_t get_i32(const uint8_t *p) {
    const uint32_t u = get_u32(p);
    return u <= (uint32_t)INT32_MAX ? (int32_t)u : -(int32_t)(~u) - 1;
}

/* ---------------------------------------------------------------------------------------------
 * Which cells a state lists: the non-empty cells holding seq_id (every non-empty cell for -1),
 * in index order, as maximal runs of consecutive cells.
 * ------------------------------------------------------------------------------------------- */

static bool cell_listed(const kvc_cells *cells, int32_t seq_id, uint32_t i) {
    return !kvc_cells_is_empty(cells, i) && (seq_id < 0 || kvc_cells_seq_has(cells, i, seq_id));
}

/* The next run [*b, *e) of listed cells starting at or after `from`; false when there is none. */
static bool next_run(const kvc_cells *cells, int32_t seq_id, uint32_t from, uint32_t *b, uint32_t *e) {
    const uint32_t size = cells->size;
    uint32_t i = from;
    if (seq_id < 0) {
        i = kvc_cells_next_used(cells, i, size);
        if (i >= size) {
            return false;
        }
        *b = i;
        *e = kvc_cells_next_empty(cells, i, size);
        return true;
    }
    while (i < size && !cell_listed(cells, seq_id, i)) {
        i++;
    }
    if (i >= size) {
        return false;
    }
    *b = i;
    while (i < size && cell_listed(cells, seq_id, i)) {
        i++;
    }
    *e = i;
    return true;
}

static uint64_t seq_id_mask(uint32_t n_seq_max) {
    return n_seq_max >= 64 ? ~(uint64_t)0 : ((uint64_t)1 << n_seq_max) - 1;
}

/* Bytes of a cell's metadata record: pos, n_seq_id, the ids. */
static size_t meta_bytes(const kvc_unified *c, int32_t seq_id, uint32_t i) {
    if (seq_id >= 0) {
        return 12;
    }
    return 8 + 4 * (size_t)kvc_popcount64(c->cells.seq[i] & seq_id_mask(c->n_seq_max));
}

/* Bytes of V element of a transposed V (its type has block size 1). */
static size_t v_elem_bytes(const kvc_unified *c) {
    const kvc_type_info *t = kvc_type_get(c->type_v);
    return t ? t->type_size : 0;
}

static size_t k_section_bytes(const kvc_layer *l, uint32_t cell_count) {
    return 4 + 8 + (size_t)cell_count * l->k_row_bytes;
}

static size_t v_section_bytes(const kvc_unified *c, const kvc_layer *l, uint32_t cell_count) {
    if (c->v_trans) {
        return 4 + 4 + 4 + (size_t)l->n_embd_v * cell_count * v_elem_bytes(c);
    }
    return 4 + 8 + (size_t)cell_count * l->v_row_bytes;
}

/* Data section bytes (from v_trans to the end) for cell_count cells. */
static size_t data_bytes(const kvc_unified *c, uint32_t cell_count) {
    size_t n = 4 + 4;
    for (uint32_t il = 0; il < c->n_layer; il++) {
        n += k_section_bytes(&c->layers[il], cell_count) + v_section_bytes(c, &c->layers[il], cell_count);
    }
    return n;
}

static bool seq_id_valid(const kvc_unified *c, int32_t seq_id) {
    return seq_id >= -1 && (seq_id < 0 || (uint32_t)seq_id < c->n_seq_max);
}

/* Count the listed cells and their metadata bytes. */
static void count_listed(const kvc_unified *c, int32_t seq_id, uint32_t *cell_count, size_t *meta) {
    uint32_t n = 0, b, e, from = 0;
    size_t m = 0;
    while (next_run(&c->cells, seq_id, from, &b, &e)) {
        n += e - b;
        for (uint32_t i = b; i < e; i++) {
            m += meta_bytes(c, seq_id, i);
        }
        from = e;
    }
    *cell_count = n;
    *meta = m;
}

size_t kvc_unified_state_size(const kvc_unified *c, int32_t seq_id) {
    if (!seq_id_valid(c, seq_id)) {
        return 0;
    }
    uint32_t cell_count;
    size_t meta;
    count_listed(c, seq_id, &cell_count, &meta);
    return 4 + meta + data_bytes(c, cell_count);
}

/* Copy n bytes from src, or zeros when the layer has no memory attached. */
static void copy_or_zero(uint8_t *dst, const uint8_t *src, size_t n) {
    if (src) {
        memcpy(dst, src, n);
    } else {
        memset(dst, 0, n);
    }
}

/* Write the section headers (type, sizes) of every layer; data goes in between, see below. */
static void write_layer_headers(const kvc_unified *c, uint32_t cell_count, uint8_t *data) {
    uint8_t *p = data + 8;
    for (uint32_t il = 0; il < c->n_layer; il++) {
        const kvc_layer *l = &c->layers[il];
        put_i32(p, c->type_k);
        put_u64(p + 4, (uint64_t)l->k_row_bytes);
        p += k_section_bytes(l, cell_count);
    }
    for (uint32_t il = 0; il < c->n_layer; il++) {
        const kvc_layer *l = &c->layers[il];
        put_i32(p, c->type_v);
        if (c->v_trans) {
            put_u32(p + 4, (uint32_t)v_elem_bytes(c));
            put_u32(p + 8, l->n_embd_v);
        } else {
            put_u64(p + 4, (uint64_t)l->v_row_bytes);
        }
        p += v_section_bytes(c, l, cell_count);
    }
}

/* Copy the K/V data of run [b, e) whose first cell is the `prefix`-th listed cell. Every layer's
 * section is visited per run so that the cells are scanned only once. */
static void write_run_data(const kvc_unified *c, uint32_t cell_count, uint32_t prefix, uint32_t b, uint32_t e,
                           uint8_t *data) {
    const uint32_t size = c->cells.size;
    const uint32_t nr = e - b;
    uint8_t *p = data + 8;
    for (uint32_t il = 0; il < c->n_layer; il++) {
        const kvc_layer *l = &c->layers[il];
        const size_t row = l->k_row_bytes;
        copy_or_zero(p + 12 + (size_t)prefix * row, l->k ? l->k + (size_t)b * row : NULL, (size_t)nr * row);
        p += k_section_bytes(l, cell_count);
    }
    for (uint32_t il = 0; il < c->n_layer; il++) {
        const kvc_layer *l = &c->layers[il];
        if (c->v_trans) {
            const size_t el = v_elem_bytes(c);
            for (uint32_t j = 0; j < l->n_embd_v; j++) {
                const size_t dst = 12 + ((size_t)j * cell_count + prefix) * el;
                const size_t src = ((size_t)j * size + b) * el;
                copy_or_zero(p + dst, l->v ? l->v + src : NULL, (size_t)nr * el);
            }
        } else {
            const size_t row = l->v_row_bytes;
            copy_or_zero(p + 12 + (size_t)prefix * row, l->v ? l->v + (size_t)b * row : NULL, (size_t)nr * row);
        }
        p += v_section_bytes(c, l, cell_count);
    }
}

int kvc_unified_state_write(const kvc_unified *c, int32_t seq_id, uint8_t *out, size_t cap, size_t *written) {
    *written = 0;
    if (!seq_id_valid(c, seq_id)) {
        return KVC_E_ARG;
    }
    uint32_t cell_count;
    size_t meta;
    count_listed(c, seq_id, &cell_count, &meta);
    const size_t total = 4 + meta + data_bytes(c, cell_count);
    if (cap < total) {
        return KVC_E_NOSPACE;
    }

    uint8_t *data = out + 4 + meta;
    put_u32(out, cell_count);
    put_u32(data, c->v_trans ? 1u : 0u);
    put_u32(data + 4, c->n_layer);
    write_layer_headers(c, cell_count, data);

    const uint64_t ids = seq_id_mask(c->n_seq_max);
    uint8_t *m = out + 4;
    uint32_t prefix = 0, b, e, from = 0;
    while (next_run(&c->cells, seq_id, from, &b, &e)) {
        for (uint32_t i = b; i < e; i++) {
            put_i32(m, c->cells.pos[i]);
            if (seq_id >= 0) {
                put_u32(m + 4, 1);
                put_i32(m + 8, seq_id);
                m += 12;
            } else {
                uint64_t bits = c->cells.seq[i] & ids;
                put_u32(m + 4, kvc_popcount64(bits));
                m += 8;
                for (; bits; bits &= bits - 1) {
                    put_i32(m, (int32_t)kvc_ctz64(bits));
                    m += 4;
                }
            }
        }
        write_run_data(c, cell_count, prefix, b, e, data);
        prefix += e - b;
        from = e;
    }
    *written = total;
    return KVC_OK;
}

/* ---------------------------------------------------------------------------------------------
 * Reading: a bounds-checked cursor, a validating parse that changes nothing, then the apply.
 * ------------------------------------------------------------------------------------------- */

typedef struct reader {
    const uint8_t *p;
    size_t len, off;
} reader;

/* Take the next n bytes, or false (cursor unmoved) when fewer remain. */
static bool rd_take(reader *r, size_t n, const uint8_t **out) {
    if (r->len - r->off < n) {
        return false;
    }
    *out = r->p + r->off;
    r->off += n;
    return true;
}

static bool rd_u32(reader *r, uint32_t *v) {
    const uint8_t *q;
    if (!rd_take(r, 4, &q)) {
        return false;
    }
    *v = get_u32(q);
    return true;
}

static bool rd_i32(reader *r, int32_t *v) {
    const uint8_t *q;
    if (!rd_take(r, 4, &q)) {
        return false;
    }
    *v = get_i32(q);
    return true;
}

static bool rd_u64(reader *r, uint64_t *v) {
    const uint8_t *q;
    if (!rd_take(r, 8, &q)) {
        return false;
    }
    *v = get_u64(q);
    return true;
}

/* "truncated at byte X of N while reading <what>" (X: where the failed read starts). */
static int fail_truncated(kvc_err *err, const reader *r, size_t need, const char *fmt, ...) {
    char what[160];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof what, fmt, ap);
    va_end(ap);
    return kvc_err_set(err, KVC_E_STATE, "state truncated at byte %zu of %zu while reading %s (%zu bytes)",
                       r->off, r->len, what, need);
}

static const char *type_name(int32_t id) {
    const kvc_type_info *t = kvc_type_get(id);
    return t ? t->name : "unknown";
}

/* What the parse learned; offsets are into the blob. */
typedef struct parsed {
    uint32_t cell_count;
    size_t   data_off;   /* where v_trans is */
    size_t   end;        /* bytes of the state */
    int32_t *pos;        /* single sequence: the positions (kvc_malloc'ed), else NULL */
} parsed;

static int parse_meta(const kvc_unified *c, int32_t seq_id, reader *r, parsed *ps, kvc_err *err) {
    const uint32_t cc = ps->cell_count;
    if (seq_id >= 0 && cc > 0) {
        /* cc <= size: bounded by the cache, not by the blob */
        ps->pos = kvc_malloc((size_t)cc * sizeof *ps->pos);
        if (!ps->pos) {
            return kvc_err_set(err, KVC_E_NOMEM, "out of memory reading a state of %" PRIu32 " cells", cc);
        }
    }
    for (uint32_t i = 0; i < cc; i++) {
        int32_t pos;
        uint32_t n_seq_id;
        if (!rd_i32(r, &pos)) {
            return fail_truncated(err, r, 4, "the position of cell %" PRIu32 " of %" PRIu32, i, cc);
        }
        if (pos < 0) {
            return kvc_err_set(err, KVC_E_STATE, "cell %" PRIu32 " (byte %zu): negative position %" PRId32, i,
                               r->off - 4, pos);
        }
        if (!rd_u32(r, &n_seq_id)) {
            return fail_truncated(err, r, 4, "the sequence count of cell %" PRIu32 " of %" PRIu32, i, cc);
        }
        if (seq_id >= 0) {
            if (n_seq_id != 1) {
                return kvc_err_set(err, KVC_E_STATE,
                                   "cell %" PRIu32 " (byte %zu): %" PRIu32
                                   " sequence ids in a single-sequence state (must be 1)",
                                   i, r->off - 4, n_seq_id);
            }
            int32_t ignored; /* the source sequence id: the destination replaces it */
            if (!rd_i32(r, &ignored)) {
                return fail_truncated(err, r, 4, "the sequence id of cell %" PRIu32 " of %" PRIu32, i, cc);
            }
            ps->pos[i] = pos;
            continue;
        }
        for (uint32_t j = 0; j < n_seq_id; j++) {
            int32_t s;
            if (!rd_i32(r, &s)) {
                return fail_truncated(err, r, 4, "sequence id %" PRIu32 " of %" PRIu32 " of cell %" PRIu32, j,
                                      n_seq_id, i);
            }
            if (s < 0 || (uint32_t)s >= c->n_seq_max) {
                return kvc_err_set(err, KVC_E_STATE,
                                   "cell %" PRIu32 " (byte %zu): sequence id %" PRId32
                                   " out of range [0, %" PRIu32 ")",
                                   i, r->off - 4, s, c->n_seq_max);
            }
        }
    }
    return KVC_OK;
}

/* "layer IL (byte AT): <what>" for a per-layer field that disagrees with the cache. */
static int fail_layer(kvc_err *err, int32_t il, size_t at, const char *fmt, ...) {
    char what[160];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof what, fmt, ap);
    va_end(ap);
    return kvc_err_set(err, KVC_E_STATE, "layer %" PRId32 " (byte %zu): %s", il, at, what);
}

/* Per layer: i32 type, u64 row size (or u32 element size, u32 width for a transposed V), data. */
static int parse_layer_v(const kvc_unified *c, const kvc_layer *l, reader *r, uint32_t cc, kvc_err *err) {
    const uint8_t *skip;
    int32_t type;
    size_t n;
    if (!rd_i32(r, &type)) {
        return fail_truncated(err, r, 4, "the value type of layer %" PRId32, l->il);
    }
    if (type != c->type_v) {
        return fail_layer(err, l->il, r->off - 4, "value type %" PRId32 " (%s) != cache's %" PRId32 " (%s)",
                          type, type_name(type), c->type_v, type_name(c->type_v));
    }
    if (c->v_trans) {
        const uint32_t el = (uint32_t)v_elem_bytes(c);
        uint32_t el_ref, width;
        if (!rd_u32(r, &el_ref)) {
            return fail_truncated(err, r, 4, "the value element size of layer %" PRId32, l->il);
        }
        if (el_ref != el) {
            return fail_layer(err, l->il, r->off - 4, "value element size %" PRIu32 " != cache's %" PRIu32,
                              el_ref, el);
        }
        if (!rd_u32(r, &width)) {
            return fail_truncated(err, r, 4, "the value width of layer %" PRId32, l->il);
        }
        if (width != l->n_embd_v) {
            return fail_layer(err, l->il, r->off - 4,
                              "value width (n_embd_v_gqa) %" PRIu32 " != cache's %" PRIu32, width, l->n_embd_v);
        }
        n = (size_t)l->n_embd_v * cc * el;
    } else {
        uint64_t row;
        if (!rd_u64(r, &row)) {
            return fail_truncated(err, r, 8, "the value row size of layer %" PRId32, l->il);
        }
        if (row != (uint64_t)l->v_row_bytes) {
            return fail_layer(err, l->il, r->off - 8, "value row size %" PRIu64 " != cache's %zu", row,
                              l->v_row_bytes);
        }
        n = (size_t)cc * l->v_row_bytes;
    }
    if (!rd_take(r, n, &skip)) {
        return fail_truncated(err, r, n, "the values of layer %" PRId32, l->il);
    }
    return KVC_OK;
}

static int parse_layer_k(const kvc_unified *c, const kvc_layer *l, reader *r, uint32_t cc, kvc_err *err) {
    const uint8_t *skip;
    int32_t type;
    uint64_t row;
    if (!rd_i32(r, &type)) {
        return fail_truncated(err, r, 4, "the key type of layer %" PRId32, l->il);
    }
    if (type != c->type_k) {
        return fail_layer(err, l->il, r->off - 4, "key type %" PRId32 " (%s) != cache's %" PRId32 " (%s)", type,
                          type_name(type), c->type_k, type_name(c->type_k));
    }
    if (!rd_u64(r, &row)) {
        return fail_truncated(err, r, 8, "the key row size of layer %" PRId32, l->il);
    }
    if (row != (uint64_t)l->k_row_bytes) {
        return fail_layer(err, l->il, r->off - 8, "key row size %" PRIu64 " != cache's %zu", row,
                          l->k_row_bytes);
    }
    const size_t n = (size_t)cc * l->k_row_bytes;
    if (!rd_take(r, n, &skip)) {
        return fail_truncated(err, r, n, "the keys of layer %" PRId32, l->il);
    }
    return KVC_OK;
}

/* The data section: V layout flag, layer count, every layer's K then every layer's V. */
static int parse_data(const kvc_unified *c, reader *r, uint32_t cc, kvc_err *err) {
    uint32_t v_trans, n_layer;
    int rc;
    if (!rd_u32(r, &v_trans)) {
        return fail_truncated(err, r, 4, "the V layout flag");
    }
    if ((v_trans != 0) != c->v_trans) {
        static const char *const layout[2] = { "not transposed", "transposed" };
        return kvc_err_set(err, KVC_E_STATE, "V layout (byte %zu): the state has V %s, the cache %s", r->off - 4,
                           layout[v_trans != 0], layout[c->v_trans]);
    }
    if (!rd_u32(r, &n_layer)) {
        return fail_truncated(err, r, 4, "the layer count");
    }
    if (n_layer != c->n_layer) {
        return kvc_err_set(err, KVC_E_STATE,
                           "layer count (byte %zu): the state has %" PRIu32 ", the cache %" PRIu32, r->off - 4,
                           n_layer, c->n_layer);
    }
    for (uint32_t ikv = 0; ikv < c->n_layer; ikv++) {
        if ((rc = parse_layer_k(c, &c->layers[ikv], r, cc, err)) != KVC_OK) {
            return rc;
        }
    }
    for (uint32_t ikv = 0; ikv < c->n_layer; ikv++) {
        if ((rc = parse_layer_v(c, &c->layers[ikv], r, cc, err)) != KVC_OK) {
            return rc;
        }
    }
    return KVC_OK;
}

/* Validate the whole state; nothing in the cache changes. On success ps says where things are
 * (ps->pos must be freed by the caller in every case). */
static int parse_state(const kvc_unified *c, int32_t seq_id, const uint8_t *data, size_t len, parsed *ps,
                       kvc_err *err) {
    reader r = { data, len, 0 };
    int rc;
    if (!rd_u32(&r, &ps->cell_count)) {
        return fail_truncated(err, &r, 4, "the cell count");
    }
    if (ps->cell_count > c->cells.size) {
        return kvc_err_set(err, KVC_E_STATE,
                           "not enough cells: the state holds %" PRIu32 " cells, the cache has %" PRIu32,
                           ps->cell_count, c->cells.size);
    }
    if ((rc = parse_meta(c, seq_id, &r, ps, err)) != KVC_OK) {
        return rc;
    }
    ps->data_off = r.off;
    if ((rc = parse_data(c, &r, ps->cell_count, err)) != KVC_OK) {
        return rc;
    }
    ps->end = r.off;
    return KVC_OK;
}

/* Copy the validated K/V data of the blob into cells [dst, dst + cc). */
static void apply_data(kvc_unified *c, const uint8_t *data, const parsed *ps, uint32_t dst) {
    const uint32_t cc = ps->cell_count;
    const uint32_t size = c->cells.size;
    const uint8_t *p = data + ps->data_off + 8;
    for (uint32_t ikv = 0; ikv < c->n_layer; ikv++) {
        const kvc_layer *l = &c->layers[ikv];
        if (l->k && cc) {
            memcpy(l->k + (size_t)dst * l->k_row_bytes, p + 12, (size_t)cc * l->k_row_bytes);
        }
        p += k_section_bytes(l, cc);
    }
    const size_t el = v_elem_bytes(c);
    for (uint32_t ikv = 0; ikv < c->n_layer; ikv++) {
        const kvc_layer *l = &c->layers[ikv];
        if (l->v && cc) {
            if (c->v_trans) {
                for (uint32_t j = 0; j < l->n_embd_v; j++) {
                    memcpy(l->v + ((size_t)j * size + dst) * el, p + 12 + (size_t)j * cc * el, (size_t)cc * el);
                }
            } else {
                memcpy(l->v + (size_t)dst * l->v_row_bytes, p + 12, (size_t)cc * l->v_row_bytes);
            }
        }
        p += v_section_bytes(c, l, cc);
    }
}

/* Whole cache: clear, cell k of the blob into cell k, head 0 (the reference's order). */
static void apply_whole(kvc_unified *c, const uint8_t *data, const parsed *ps) {
    kvc_unified_clear(c);
    const uint8_t *m = data + 4;
    uint64_t touched = 0;
    for (uint32_t i = 0; i < ps->cell_count; i++) {
        const int32_t pos = get_i32(m);
        const uint32_t n_seq_id = get_u32(m + 4);
        uint64_t bits = 0;
        m += 8;
        for (uint32_t j = 0; j < n_seq_id; j++, m += 4) {
            bits |= (uint64_t)1 << get_i32(m); /* a repeated id sets its bit again, as the reference does */
        }
        kvc_cells_set_raw(&c->cells, i, pos, bits);
        touched |= bits;
    }
    kvc_cells_rebuild_seq_pos(&c->cells, touched);
    c->head = 0;
    apply_data(c, data, ps, 0);
}

/* Place the cells of ub (after removing seq_id) and copy the data; on failure restore snap. */
static int place_seq(kvc_unified *c, int32_t seq_id, const kvc_ubatch *ub, const uint8_t *data,
                     const parsed *ps, const kvc_unified_snapshot *snap, kvc_err *err) {
    const uint32_t cc = ps->cell_count;
    kvc_unified_seq_rm(c, seq_id, -1, -1);
    const int found = kvc_unified_find_slot(c, ub);
    if (found == 1 && c->head + cc <= c->cells.size) {
        kvc_unified_commit(c);
        apply_data(c, data, ps, c->head);
        return KVC_OK;
    }
    const uint32_t head = c->head;
    kvc_unified_snapshot_restore(c, snap);
    if (found == 1) {
        /* find_slot places a ubatch as one run at head */
        return kvc_err_set(err, KVC_E_INTERNAL, "slot at %" PRIu32 " for %" PRIu32 " cells exceeds the cache",
                           head, cc);
    }
    if (found == 0) {
        return kvc_err_set(err, KVC_E_STATE,
                           "no room: sequence %" PRId32 " needs %" PRIu32
                           " contiguous free cells, the cache has no such run (%" PRIu32 " cells, %" PRIu32
                           " used)",
                           seq_id, cc, c->cells.size, c->cells.used);
    }
    return kvc_err_set(err, found, "out of memory restoring %" PRIu32 " cells", cc);
}

/* Single sequence: the blob's cells as one ubatch of cell_count tokens of seq_id, placed by
 * find_slot and committed. Fails (and leaves no trace) when there is no room. */
static int apply_seq(kvc_unified *c, int32_t seq_id, const uint8_t *data, const parsed *ps, kvc_err *err) {
    const uint32_t cc = ps->cell_count;
    if (cc == 0) {
        /* contract C1b: an empty part removes the destination sequence */
        kvc_unified_seq_rm(c, seq_id, -1, -1);
        return KVC_OK;
    }

    /* one group of cell_count tokens, all of seq_id */
    const uint32_t seq_off[2] = { 0, 1 };
    const int32_t seq_ids[1] = { seq_id };
    const uint64_t seq_mask[1] = { (uint64_t)1 << seq_id };
    const kvc_ubatch ub = { cc, cc, 1, ps->pos, seq_off, seq_ids, seq_mask };
    kvc_unified_snapshot snap;
    if (kvc_unified_snapshot_take(c, &snap) != KVC_OK) {
        return kvc_err_set(err, KVC_E_NOMEM, "out of memory restoring %" PRIu32 " cells", cc);
    }
    const int rc = place_seq(c, seq_id, &ub, data, ps, &snap, err);
    kvc_unified_snapshot_free(&snap);
    return rc;
}

int kvc_unified_state_read(kvc_unified *c, int32_t seq_id, const uint8_t *data, size_t len, size_t *consumed,
                           kvc_err *err) {
    *consumed = 0;
    if (!seq_id_valid(c, seq_id)) {
        return kvc_err_set(err, KVC_E_ARG, "seq_id %" PRId32 " out of range [-1, %" PRIu32 ")", seq_id,
                           c->n_seq_max);
    }
    parsed ps = { 0, 0, 0, NULL };
    int rc = parse_state(c, seq_id, data, len, &ps, err);
    if (rc == KVC_OK) {
        if (seq_id < 0) {
            apply_whole(c, data, &ps);
        } else {
            rc = apply_seq(c, seq_id, data, &ps, err);
        }
    }
    kvc_free(ps.pos);
    if (rc == KVC_OK) {
        *consumed = ps.end;
    }
    return rc;
}
