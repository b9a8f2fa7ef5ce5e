#include "kvc_section.h"

#include "kvc_le.h"
#include "kvc_types.h"

#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

/* "truncated at byte X of N while reading <what>" (X: where the failed read starts). */
int kvc_cur_truncated(kvc_err *err, const kvc_cursor *r, size_t need, const char *fmt, ...) {
    if (!err) {
        return KVC_E_STATE;   /* no message asked for: nothing to format */
    }
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

void kvc_sec_free(kvc_section *sec) {
    kvc_free_clear(&sec->pos);
    kvc_free_clear(&sec->seq);
    kvc_free_clear(&sec->ext);
}

int kvc_state_check_end(size_t end, size_t len, kvc_err *err) {
    if (end == len) {
        return KVC_OK;
    }
    return kvc_err_set(err, KVC_E_STATE, "%zu trailing bytes after the state (it ends at byte %zu of %zu)",
                       len - end, end, len);
}

/* --- the cells ------------------------------------------------------------------------------ */

/* kvc_cur_truncated of a cursor passed by value (a loop's own cursor does not escape). */
#define truncated_at(err, cur, need, ...) kvc_cur_truncated((err), &(kvc_cursor){ (cur).p, (cur).len, (cur).off }, \
                                                           (need), __VA_ARGS__)

/* The fewest bytes a cell's record takes: position, id count, the ids a single-sequence state
 * lists, the extension. */
static size_t cell_record_min(const kvc_sec_dest *d, const kvc_section *sec) {
    const bool single = d && d->seq_id >= 0;
    return (single ? 8 + 4 * (size_t)d->single_n_ids : 8) + (d ? d->ext_bytes : sec->d_ext_bytes);
}

/* "truncated at byte X of N: the <what> (byte B) says C <unit>, which need at least ..." for a
 * count read at B whose items cannot fit in the bytes after it: the count is no more than a
 * number read from the bytes, so it is named as what they say, never compared with the cache. */
static int count_truncated(kvc_err *err, const kvc_cursor *r, const char *what, uint32_t count, const char *unit,
                           size_t min_each) {
    return kvc_err_set(err, KVC_E_STATE,
                       "state truncated at byte %zu of %zu: the %s (byte %zu) says %" PRIu32
                       " %s, which need at least %zu bytes, %zu remain",
                       r->off, r->len, what, r->off - 4, count, unit, (size_t)count * min_each, r->len - r->off);
}

static int parse_cell_count(kvc_cursor *r, const kvc_sec_dest *d, kvc_section *sec, kvc_err *err) {
    uint32_t *const cc = &sec->cell_count;
    if (!kvc_cur_u32(r, cc)) {
        return kvc_cur_truncated(err, r, 4, "the cell count");
    }
    /* nothing is compared with the cache, nor allocated, for more cells than the bytes left can
     * describe */
    const size_t min_rec = cell_record_min(d, sec);
    if ((r->len - r->off) / min_rec < *cc) {
        return count_truncated(err, r, "cell count", *cc, "cells", min_rec);
    }
    if (d && d->seq_id >= 0 && d->seq_cells_max && *cc > d->seq_cells_max) {
        return kvc_err_set(err, KVC_E_STATE,
                           "a sequence's state holds at most %s in this cache, the state holds %" PRIu32
                           " (byte %zu)",
                           d->seq_cells_max == 1 ? "one cell" : "its cells", *cc, r->off - 4);
    }
    if (d && *cc > d->size) {
        return kvc_err_set(err, KVC_E_STATE,
                           "not enough cells: the state holds %" PRIu32 " cells (byte %zu), the cache has %" PRIu32,
                           *cc, r->off - 4, d->size);
    }
    return KVC_OK;
}

/* The cell before i of sec (whose sets are parsed) that lists s, or i. */
static uint32_t cell_listing(const kvc_section *sec, uint32_t nw, uint32_t i, int32_t s) {
    for (uint32_t k = 0; k < i; k++) {
        if ((sec->seq[(size_t)k * nw + ((uint32_t)s >> 6)] >> (s & 63)) & 1u) {
            return k;
        }
    }
    return i;
}

/* The ids of cell i into bits, or with d->into_seq into the destination's table; checked against
 * d (NULL: against KVC_MAX_SEQ); seen: the ids of the cells before, for d->seq_in_one_cell (with
 * d->into_cell_of, that table answers instead). */
static int parse_ids(kvc_cursor *r, const kvc_sec_dest *d, uint32_t i, uint32_t n_seq_id, kvc_seqset *bits,
                     kvc_seqset *seen, kvc_section *sec, kvc_err *err) {
    const uint32_t id_limit = d ? d->n_seq_max : KVC_MAX_SEQ;
    if ((r->len - r->off) / 4 < n_seq_id) {
        return kvc_err_set(err, KVC_E_STATE,
                           "state truncated at byte %zu of %zu: cell %" PRIu32 " lists %" PRIu32
                           " sequence ids, %zu bytes remain",
                           r->off, r->len, i, n_seq_id, r->len - r->off);
    }
    /* the ids are in the bytes (checked above): read in place; the destination's fields in locals,
     * as the stores into its table could otherwise alias them */
    const uint8_t *const at = r->p + r->off;
    r->off += 4 * (size_t)n_seq_id;
    uint64_t *const into_seq = d ? d->into_seq : NULL;
    int32_t *const cell_of = d ? d->into_cell_of : NULL;
    const uint32_t size = d ? d->size : 0;
    const bool ids_once = d && d->ids_once, one_cell = d && d->seq_in_one_cell;
    if (!into_seq) {
        kvc_seqset_clear(bits);
    }
    for (uint32_t j = 0; j < n_seq_id; j++) {
        const int32_t s = kvc_le_get_i32(at + 4 * (size_t)j);
        const size_t byte = (size_t)(at - r->p) + 4 * (size_t)j;
        if (s < 0 || (uint32_t)s >= id_limit) {
            if (!d && sec->d_ids_unchecked) {
                sec->d_ids_outside = true;
                continue;
            }
            return kvc_err_set(err, KVC_E_STATE,
                               "cell %" PRIu32 " (byte %zu): sequence id %" PRId32 " out of range [0, %" PRIu32 ")",
                               i, byte, s, id_limit);
        }
        /* cell_of[s] is i exactly when this cell listed s already */
        const bool again = into_seq ? cell_of[s] == (int32_t)i : kvc_seqset_has(bits, s);
        if (ids_once && again) {
            /* today's llama.cpp keeps a sequence's positions per cell: an id listed twice is
             * malformed */
            return kvc_err_set(err, KVC_E_STATE, "cell %" PRIu32 " (byte %zu): sequence id %" PRId32 " listed twice",
                               i, byte, s);
        }
        if (one_cell && (again || (into_seq ? cell_of[s] >= 0 : kvc_seqset_has(seen, s)))) {
            /* one cell holds a sequence's whole state: a second listing has nowhere to go */
            const uint32_t k = again ? i : into_seq ? (uint32_t)cell_of[s] : cell_listing(sec, d->seq_words, i, s);
            return kvc_err_set(err, KVC_E_STATE,
                               "cell %" PRIu32 " (byte %zu): sequence id %" PRId32 " is listed by cell %" PRIu32
                               " already (a sequence's state is one cell)",
                               i, byte, s, k);
        }
        /* a repeated id sets its bit again, as the reference does */
        if (into_seq) {
            kvc_seqs_add(into_seq, size, i, s);
            cell_of[s] = (int32_t)i;
        } else {
            kvc_seqset_add(bits, s);
        }
    }
    return KVC_OK;
}

static int parse_cells(kvc_cursor *r_in, const kvc_sec_dest *d, kvc_section *sec, kvc_err *err) {
    /* a cursor of our own, which no store into a destination table can alias: it stays in
     * registers (r_in moves past the cells on success) */
    kvc_cursor cur = *r_in, *const r = &cur;
    const uint32_t cc = sec->cell_count;
    const bool single = d && d->seq_id >= 0;
    const uint32_t eb = d ? d->ext_bytes : sec->d_ext_bytes;
    /* the records of cc cells fit in the bytes left (parse_cell_count) */
    const uint32_t nw = d ? d->seq_words : KVC_SEQ_WORDS;
    const bool direct = d && !single && d->into_seq;
    if (d && cc > 0) {
        if (!d->into_pos) {
            sec->pos = kvc_malloc_n(cc, sizeof *sec->pos);
        }
        if (!single && !direct) {
            sec->seq = kvc_malloc_n((uint64_t)cc * nw, sizeof *sec->seq);
        }
        if (eb) {
            sec->ext = kvc_malloc_n(cc, sizeof *sec->ext);
        }
        if ((!d->into_pos && !sec->pos) || (!single && !direct && !sec->seq) || (eb && !sec->ext)) {
            return kvc_err_set(err, KVC_E_NOMEM, "out of memory reading a state of %" PRIu32 " cells", cc);
        }
    }
    int32_t *const pos_out = d && d->into_pos ? d->into_pos : sec->pos;
    uint32_t n_min = 0, n_max = 0;
    uint64_t *const into_seq = direct ? d->into_seq : NULL;
    int32_t *const into_cell_of = direct ? d->into_cell_of : NULL;
    const uint32_t size = d ? d->size : 0, id_max = d ? d->n_seq_max : 0;
    kvc_seqset seen;
    kvc_seqset_clear(&seen);
    for (uint32_t i = 0; i < cc; i++) {
        if (direct && !eb && r->len - r->off >= 12) {
            /* the common cell of a recurrent state, listing one sequence: its record checked in
             * one piece, in place; any fault is left to the general path below, which names it */
            const uint8_t *q = r->p + r->off;
            const int32_t pos = kvc_le_get_i32(q), s = kvc_le_get_i32(q + 8);
            if (pos >= 0 && kvc_le_get_u32(q + 4) == 1 && s >= 0 && (uint32_t)s < id_max && into_cell_of[s] < 0) {
                r->off += 12;
                n_min = i == 0 ? 1 : n_min;
                n_max = n_max > 1 ? n_max : 1;
                kvc_seqs_add(into_seq, size, i, s);
                into_cell_of[s] = (int32_t)i;
                pos_out[i] = pos;
                continue;
            }
        }
        if (!d && i >= sec->d_pos_cap && r->len - r->off >= 8 + (size_t)eb) {
            /* a walk's cell that records nothing: its record checked in place, any fault left to
             * the general path below, which names it */
            const uint8_t *q = r->p + r->off;
            const uint32_t n = kvc_le_get_u32(q + 4);
            if (kvc_le_get_i32(q) >= 0 && n <= (r->len - r->off - 8 - eb) / 4) {
                const uint8_t *ids = q + 8 + eb;
                uint32_t j = 0;
                while (j < n && kvc_le_get_u32(ids + 4 * (size_t)j) < KVC_MAX_SEQ) {
                    j++;
                }
                if (j == n) {
                    r->off += 8 + (size_t)eb + 4 * (size_t)n;
                    n_min = i == 0 || n < n_min ? n : n_min;
                    n_max = n > n_max ? n : n_max;
                    continue;
                }
            }
        }
        int32_t pos;
        uint32_t n_seq_id;
        if (!kvc_cur_i32(r, &pos)) {
            return truncated_at(err, cur, 4, "the position of cell %" PRIu32 " of %" PRIu32, i, cc);
        }
        if (pos < 0) {
            return kvc_err_set(err, KVC_E_STATE, "cell %" PRIu32 " (byte %zu): negative position %" PRId32, i,
                               r->off - 4, pos);
        }
        if (!kvc_cur_u32(r, &n_seq_id)) {
            return truncated_at(err, cur, 4, "the sequence count of cell %" PRIu32 " of %" PRIu32, i, cc);
        }
        n_min = i == 0 || n_seq_id < n_min ? n_seq_id : n_min;
        n_max = n_seq_id > n_max ? n_seq_id : n_max;
        if (eb) {
            kvc_cell_ext e = kvc_cell_ext_default();
            if (r->len - r->off < eb) {
                return truncated_at(err, cur, eb, "the extension of cell %" PRIu32 " of %" PRIu32, i, cc);
            }
            e.x = kvc_le_get_i32(r->p + r->off);
            e.y = kvc_le_get_i32(r->p + r->off + 4);
            if (eb == 12) {
                e.tok = kvc_le_get_i32(r->p + r->off + 8);
            }
            r->off += eb;
            if (sec->ext) {
                sec->ext[i] = e;
            } else if (sec->d_ext && i < sec->d_pos_cap) {
                sec->d_ext[i] = e;
            }
        }
        if (single) {
            if (n_seq_id != d->single_n_ids) {
                return kvc_err_set(err, KVC_E_STATE,
                                   "cell %" PRIu32 " (byte %zu): %" PRIu32
                                   " sequence ids in a single-sequence state (must be %" PRIu32 ")",
                                   i, r->off - 4, n_seq_id, d->single_n_ids);
            }
            for (uint32_t j = 0; j < n_seq_id; j++) {
                int32_t ignored; /* the source sequence id: the destination replaces it */
                if (!kvc_cur_i32(r, &ignored)) {
                    return truncated_at(err, cur, 4, "the sequence id of cell %" PRIu32 " of %" PRIu32, i, cc);
                }
            }
            pos_out[i] = pos;
            continue;
        }
        kvc_seqset bits;
        int rc = parse_ids(r, d, i, n_seq_id, &bits, &seen, sec, err);
        if (rc != KVC_OK) {
            return rc;
        }
        if (direct) {
            pos_out[i] = pos;
        } else if (d) {
            uint64_t *set = sec->seq + (size_t)i * nw;
            pos_out[i] = pos;
            for (uint32_t w = 0; w < nw; w++) {
                set[w] = bits.w[w];
                seen.w[w] |= bits.w[w];
            }
        } else if (i < sec->d_pos_cap) {
            sec->d_pos[i] = pos;
            memcpy(sec->d_seq + (size_t)i * KVC_SEQ_WORDS, bits.w, sizeof bits.w);
        }
    }
    sec->n_seq_id_min = n_min;
    sec->n_seq_id_max = n_max;
    *r_in = cur;
    return KVC_OK;
}

/* --- the data: V layout, layer count, per layer K, then per layer V --------------------------- */

/* "layer IL (byte AT): <what>" for a per-layer field that disagrees with the destination. */
KVC_PRINTF_FORMAT(4, 5) static int fail_layer(kvc_err *err, int32_t il, size_t at, const char *fmt, ...) {
    if (!err) {
        return KVC_E_STATE;
    }
    char what[160];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof what, fmt, ap);
    va_end(ap);
    return kvc_err_set(err, KVC_E_STATE, "layer %" PRId32 " (byte %zu): %s", il, at, what);
}

/* Whether count items of unit bytes fit in what is left of r. */
static bool data_fits(const kvc_cursor *r, uint64_t count, uint64_t unit) {
    return unit == 0 || count <= (r->len - r->off) / unit;
}

/* Take the n = count * unit data bytes of a section, checking the product against what is left. */
static int take_data(kvc_cursor *r, uint64_t count, uint64_t unit, const char *what, int32_t il, uint64_t *n,
                     kvc_err *err) {
    const size_t left = r->len - r->off;
    *n = 0;
    if (!data_fits(r, count, unit)) {
        return kvc_err_set(err, KVC_E_STATE,
                           "state truncated at byte %zu of %zu while reading the %s of layer %" PRId32
                           " (%" PRIu64 " x %" PRIu64 " bytes, %zu remain)",
                           r->off, r->len, what, il, count, unit, left);
    }
    *n = count * unit;
    r->off += (size_t)*n;
    return KVC_OK;
}

/* Layer ikv as the destination has it (l NULL when describing); il: its index in messages. */
static int32_t dest_layer(const kvc_sec_dest *d, uint32_t ikv, kvc_layer *l) {
    if (!d) {
        return (int32_t)ikv;
    }
    d->layer(d->cache, ikv, l);
    return l->il;
}

static int parse_layer_k(kvc_cursor *r, const kvc_sec_dest *d, uint32_t ikv, uint32_t cc, kvc_state_layer_desc *ld,
                         kvc_err *err) {
    kvc_layer l;
    const int32_t il = dest_layer(d, ikv, &l);
    const size_t at = r->off;
    int32_t type;
    uint64_t row;
    if (!kvc_cur_i32(r, &type)) {
        return kvc_cur_truncated(err, r, 4, "the key type of layer %" PRId32, il);
    }
    if (d && type != d->type_k) {
        return fail_layer(err, il, r->off - 4, "key type %" PRId32 " (%s) != cache's %" PRId32 " (%s)", type,
                          type_name(type), d->type_k, type_name(d->type_k));
    }
    if (!kvc_cur_u64(r, &row)) {
        return kvc_cur_truncated(err, r, 8, "the key row size of layer %" PRId32, il);
    }
    /* a row size the cells' data cannot have in the bytes left is a truncation's (take_data's
     * error), not a number to compare with the cache */
    uint64_t n;
    if (d && row != (uint64_t)l.k_row_bytes && data_fits(r, cc, row)) {
        return fail_layer(err, il, r->off - 8, "key row size %" PRIu64 " != cache's %zu", row, l.k_row_bytes);
    }
    int rc = take_data(r, (uint64_t)cc, row, "keys", il, &n, err);
    if (rc == KVC_OK && ld) {
        ld->k_type = type;
        ld->k_row_size = row;
        ld->k_offset = at;
        ld->k_bytes = n;
    }
    return rc;
}

/* Per layer V: i32 type, u64 row size (or u32 element size, u32 width when the section's V is
 * transposed), the data. */
static int parse_layer_v(kvc_cursor *r, const kvc_sec_dest *d, uint32_t ikv, const kvc_section *sec,
                         kvc_state_layer_desc *ld, kvc_err *err) {
    kvc_layer l;
    const int32_t il = dest_layer(d, ikv, &l);
    const uint32_t cc = sec->cell_count;
    const size_t at = r->off;
    int32_t type;
    if (!kvc_cur_i32(r, &type)) {
        return kvc_cur_truncated(err, r, 4, "the value type of layer %" PRId32, il);
    }
    if (d && type != d->type_v) {
        return fail_layer(err, il, r->off - 4, "value type %" PRId32 " (%s) != cache's %" PRId32 " (%s)",
                          type, type_name(type), d->type_v, type_name(d->type_v));
    }
    uint64_t n;
    int rc;
    if (sec->v_trans) {
        uint32_t el_ref, width;
        if (!kvc_cur_u32(r, &el_ref)) {
            return kvc_cur_truncated(err, r, 4, "the value element size of layer %" PRId32, il);
        }
        if (d) {
            /* a transposed V stores single elements: the type must have blocks of one element
             * (the destination's own V may be rows when converting) */
            const kvc_type_info *t = kvc_type_get(d->type_v);
            if (t->blck_size != 1) {
                return fail_layer(err, il, r->off - 4,
                                  "value type %s has blocks of %" PRIu32 " elements and cannot be transposed",
                                  t->name, t->blck_size);
            }
            if (el_ref != t->type_size) {
                /* every cell has at least one element of this size (the width is at least 1) */
                return data_fits(r, cc, el_ref)
                           ? fail_layer(err, il, r->off - 4, "value element size %" PRIu32 " != cache's %" PRIu32,
                                        el_ref, t->type_size)
                           : take_data(r, (uint64_t)cc, el_ref, "values", il, &n, err);
            }
        }
        if (!kvc_cur_u32(r, &width)) {
            return kvc_cur_truncated(err, r, 4, "the value width of layer %" PRId32, il);
        }
        if (d && width != l.n_embd_v && data_fits(r, cc, (uint64_t)width * el_ref)) {
            return fail_layer(err, il, r->off - 4, "value width (n_embd_v_gqa) %" PRIu32 " != cache's %" PRIu32,
                              width, l.n_embd_v);
        }
        if ((rc = take_data(r, (uint64_t)cc, (uint64_t)width * el_ref, "values", il, &n, err)) != KVC_OK) {
            return rc;
        }
        if (ld) {
            ld->v_elem_size = el_ref;
            ld->v_width = width;
        }
    } else {
        uint64_t row;
        if (!kvc_cur_u64(r, &row)) {
            return kvc_cur_truncated(err, r, 8, "the value row size of layer %" PRId32, il);
        }
        /* a transposed cache's v_row is its width times the element size: what rows of the
         * section must hold to be converted */
        if (d && row != (uint64_t)l.v_row_bytes && data_fits(r, cc, row)) {
            return fail_layer(err, il, r->off - 8, "value row size %" PRIu64 " != cache's %zu", row, l.v_row_bytes);
        }
        if ((rc = take_data(r, (uint64_t)cc, row, "values", il, &n, err)) != KVC_OK) {
            return rc;
        }
        if (ld) {
            ld->v_row_size = row;
        }
    }
    if (ld) {
        ld->v_type = type;
        ld->v_offset = at;
        ld->v_bytes = n;
    }
    return KVC_OK;
}

static int parse_data(kvc_cursor *r, const kvc_sec_dest *d, kvc_section *sec, kvc_err *err) {
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
    if (d && (v_trans != 0) != d->v_trans && !d->convert_v) {
        return kvc_err_set(err, KVC_E_STATE, "V layout (byte %zu): the state has V %s, the cache %s (%s)",
                           r->off - 4, layout[v_trans], layout[d->v_trans],
                           d->can_convert_v ? "conversion not requested" : "it keeps V in one layout only");
    }
    sec->v_trans = v_trans;
    if (!kvc_cur_u32(r, &n_layer)) {
        return kvc_cur_truncated(err, r, 4, "the layer count");
    }
    /* the layers with records: the count's, or some of them where the count is the model's */
    const uint32_t want = d ? (d->n_layer_field ? d->n_layer_field : d->n_layer) : n_layer;
    const uint32_t n_rec = d ? (n_layer == want ? d->n_layer : n_layer)
                             : (sec->d_n_records ? sec->d_n_records : n_layer);
    /* each layer takes at least 24 bytes of headers: a count of more is a truncation's, not a
     * number to compare with the cache */
    if ((r->len - r->off) / 24 < n_rec) {
        if (n_rec == n_layer) {
            return count_truncated(err, r, "layer count", n_layer, "layers", 24);
        }
        sec->records_final = !d;
        return kvc_err_set(err, KVC_E_STATE,
                           "state truncated at byte %zu of %zu: the layer count (byte %zu) says %" PRIu32
                           " layers, %" PRIu32 " of them with records, which need at least %zu bytes, %zu remain",
                           r->off, r->len, r->off - 4, n_layer, n_rec, (size_t)n_rec * 24, r->len - r->off);
    }
    if (n_layer != want) {
        return kvc_err_set(err, KVC_E_STATE,
                           "layer count (byte %zu): the state has %" PRIu32 ", the cache %" PRIu32, r->off - 4,
                           n_layer, want);
    }
    if (!d && n_rec > n_layer) {
        sec->records_final = true;
        return kvc_err_set(err, KVC_E_STATE, "layer count (byte %zu): %" PRIu32 " layers cannot have %" PRIu32
                           " records", r->off - 4, n_layer, n_rec);
    }
    sec->n_layer = n_layer;
    for (uint32_t ikv = 0; ikv < n_rec; ikv++) {
        kvc_state_layer_desc *ld = !d && ikv < sec->d_layers_cap ? &sec->d_layers[ikv] : NULL;
        if ((rc = parse_layer_k(r, d, ikv, sec->cell_count, ld, err)) != KVC_OK) {
            return rc;
        }
    }
    for (uint32_t ikv = 0; ikv < n_rec; ikv++) {
        kvc_state_layer_desc *ld = !d && ikv < sec->d_layers_cap ? &sec->d_layers[ikv] : NULL;
        if ((rc = parse_layer_v(r, d, ikv, sec, ld, err)) != KVC_OK) {
            return rc;
        }
    }
    return KVC_OK;
}

int kvc_sec_parse(kvc_cursor *r, const kvc_sec_dest *d, kvc_section *sec, kvc_err *err) {
    int rc;
    if ((rc = parse_cell_count(r, d, sec, err)) != KVC_OK ||
        (rc = parse_cells(r, d, sec, err)) != KVC_OK) {
        return rc;
    }
    sec->data_off = r->off;
    if ((rc = parse_data(r, d, sec, err)) != KVC_OK) {
        return rc;
    }
    sec->end = r->off;
    return KVC_OK;
}

/* --- the framing ---------------------------------------------------------------------------- */

int kvc_frame_begin(kvc_cursor *r, unsigned layout, uint32_t want, kvc_frame *f, kvc_err *err) {
    f->streams = (layout & KVC_LAYOUT_STREAMS) != 0;
    f->n_stream = 1;
    if (!f->streams) {
        if (want > 1) {
            return kvc_err_set(err, KVC_E_STATE,
                               "n_stream mismatch: a state without stream counts holds 1 stream, the cache %" PRIu32,
                               want);
        }
        return KVC_OK;
    }
    if (!kvc_cur_u32(r, &f->n_stream)) {
        return kvc_cur_truncated(err, r, 4, "the stream count");
    }
    /* each stream takes at least its 4-byte cell count: a count of more is a truncation's, not a
     * number to compare with the cache */
    if ((r->len - r->off) / 4 < f->n_stream) {
        return count_truncated(err, r, "stream count", f->n_stream, "streams", 4);
    }
    if (want && f->n_stream != want) {
        return kvc_err_set(err, KVC_E_STATE,
                           "n_stream mismatch: the state has %" PRIu32 " streams (byte %zu), the cache %" PRIu32,
                           f->n_stream, r->off - 4, want);
    }
    if (f->n_stream == 0 || f->n_stream > KVC_MAX_SEQ) {
        return kvc_err_set(err, KVC_E_STATE, "stream count %" PRIu32 " (byte %zu): expected 1 to %d", f->n_stream,
                           r->off - 4, KVC_MAX_SEQ);
    }
    return KVC_OK;
}

bool kvc_frame_take_empty(kvc_cursor *r, const kvc_frame *f) {
    if (f->streams && r->len - r->off >= 4 && kvc_le_get_u32(r->p + r->off) == 0) {
        r->off += 4;
        return true;
    }
    return false;
}

/* --- describing a blob without a cache ------------------------------------------------------ */

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

int kvc_state_prefix_take(const uint8_t *data, size_t len, int32_t seq_id, size_t *off, kvc_err *err) {
    const int rc = kvc_state_prefix_skip(data, len, off, err);
    if (rc == KVC_OK && *off && seq_id < 0) {
        *off = 0;
        return kvc_err_set(err, KVC_E_STATE,
                           "the state starts with the sequence-blob magic 0x%08x (byte 0): a sequence's state "
                           "is read into a sequence (seq_id >= 0), not as the whole cache", KVC_SEQ_MAGIC);
    }
    return rc;
}

int kvc_state_describe_frame(const uint8_t *data, size_t len, unsigned layout, bool allow_prefix,
                             kvc_state_frame *f, size_t *sec_off, uint32_t *sec_cells, uint32_t sec_cap,
                             kvc_err *err) {
    return kvc_state_walk_frame(data, len, layout, allow_prefix, false, f, sec_off, sec_cells, sec_cap, err);
}

int kvc_state_walk_frame(const uint8_t *data, size_t len, unsigned layout, bool allow_prefix, bool ids_unchecked,
                         kvc_state_frame *f, size_t *sec_off, uint32_t *sec_cells, uint32_t sec_cap, kvc_err *err) {
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
    kvc_frame fr;
    if ((rc = kvc_frame_begin(&r, layout, 0, &fr, err)) != KVC_OK) {
        return rc;
    }
    f->n_stream = fr.n_stream;
    for (uint32_t s = 0; s < fr.n_stream; s++) {
        const size_t at = r.off;
        uint32_t cells = 0;
        if (!kvc_frame_take_empty(&r, &fr)) {
            /* a stream's errors name bytes of its section, the wrap says where it starts */
            kvc_cursor body = { r.p ? r.p + r.off : NULL, r.len - r.off, 0 };
            kvc_section sec;
            memset(&sec, 0, sizeof sec);
            sec.d_ext_bytes = (layout & KVC_LAYOUT_CELL_EXT) ? kvc_layout_ext_bytes(layout) : 0;
            sec.d_ids_unchecked = ids_unchecked;
            rc = kvc_sec_parse(&body, NULL, &sec, err);
            f->ids_outside = f->ids_outside || sec.d_ids_outside;
            if (rc != KVC_OK) {
                if (fr.n_stream > 1 || at) {
                    kvc_err_wrap(err, rc, "stream %" PRIu32 " (from byte %zu)", s, at);
                }
                return rc;
            }
            cells = sec.cell_count;
            r.off += body.off;
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
    return kvc_state_describe_ext(data, len, 0, d, pos, seq, NULL, pos_cap, layers, layers_cap, err);
}

int kvc_state_describe_ext(const uint8_t *data, size_t len, uint32_t ext_bytes, kvc_state_desc *d, int32_t *pos,
                           uint64_t *seq, kvc_cell_ext *ext, uint32_t pos_cap, kvc_state_layer_desc *layers,
                           uint32_t layers_cap, kvc_err *err) {
    return kvc_state_describe_records(data, len, ext_bytes, 0, d, pos, seq, ext, pos_cap, layers, layers_cap, err);
}

int kvc_state_describe_records(const uint8_t *data, size_t len, uint32_t ext_bytes, uint32_t n_records,
                               kvc_state_desc *d, int32_t *pos, uint64_t *seq, kvc_cell_ext *ext, uint32_t pos_cap,
                               kvc_state_layer_desc *layers, uint32_t layers_cap, kvc_err *err) {
    memset(d, 0, sizeof *d);
    kvc_section sec;
    memset(&sec, 0, sizeof sec);
    if (ext_bytes != 0 && ext_bytes != 8 && ext_bytes != 12) {
        return kvc_err_set(err, KVC_E_ARG, "a cell's extension has 0, 8 or 12 bytes, not %" PRIu32, ext_bytes);
    }
    sec.d_ext_bytes = ext_bytes;
    sec.d_ext = pos && seq ? ext : NULL;
    sec.d_pos = pos;
    sec.d_seq = seq;
    sec.d_pos_cap = pos && seq ? pos_cap : 0;
    sec.d_layers = layers;
    sec.d_layers_cap = layers ? layers_cap : 0;
    sec.d_n_records = n_records;
    if (layers) {
        memset(layers, 0, (size_t)layers_cap * sizeof *layers);
    }
    /* the whole-cache record shape: n_seq_id and the ids are read as they are */
    kvc_cursor r = { data, data ? len : 0, 0 };
    const int rc = kvc_sec_parse(&r, NULL, &sec, err);
    d->cell_count = sec.cell_count;
    d->v_trans = sec.v_trans;
    d->n_layer = sec.n_layer;
    d->data_off = sec.data_off;
    d->end = sec.end;
    d->n_seq_id_min = sec.n_seq_id_min;
    d->n_seq_id_max = sec.n_seq_id_max;
    d->records_final = sec.records_final;
    return rc;
}
