/* kvcache — the framings of a memory state (see kvc_framing.h). */
#include "kvc_framing.h"

#include "kvc_le.h"

#include <string.h>

/* The walk of one part in a candidate framing. */
typedef struct part_walk {
    int             rc;
    kvc_state_frame f;
    uint32_t        n_sec;
    size_t          sec_off[KVC_FRAMING_SECS];
    uint32_t        sec_cells[KVC_FRAMING_SECS];
    kvc_err         err;
} part_walk;

/* The candidates: with stream counts and no extension, 12 bytes, 8 bytes; without stream counts.
 * Per candidate the walk of the first part and, where it frames, of a second part after it. */
enum { N_CAND = 4 };
static const uint32_t cand_ext[N_CAND] = { 0, 12, 8, 0 };

static void walk_part(const uint8_t *data, size_t len, size_t off, unsigned layout, bool allow_prefix, part_walk *w) {
    w->err.msg[0] = 0;
    w->rc = kvc_state_describe_frame(off ? data + off : data, len - off, layout, allow_prefix, &w->f, w->sec_off,
                                     w->sec_cells, KVC_FRAMING_SECS, &w->err);
    w->n_sec = w->rc == KVC_OK ? (w->f.n_stream < KVC_FRAMING_SECS ? w->f.n_stream : KVC_FRAMING_SECS) : 0;
}

/* Part k of a framing from walk w of that part, which starts at byte off. */
static void put_part(kvc_framing *fr, uint32_t k, const part_walk *w, size_t off) {
    fr->n_sec[k] = w->n_sec;
    for (uint32_t s = 0; s < w->n_sec; s++) {
        fr->sec_off[k][s] = off + w->sec_off[s];
        fr->sec_cells[k][s] = w->sec_cells[s];
    }
}

static bool has_cells(const kvc_framing *fr) {
    for (uint32_t k = 0; k < fr->n_parts; k++) {
        for (uint32_t s = 0; s < fr->n_sec[k]; s++) {
            if (fr->sec_cells[k][s]) {
                return true;
            }
        }
    }
    return false;
}

/* Candidate c as n_parts parts into *fr: true when they take data[0, len) exactly; else, for a
 * candidate without an extension, why not into *m. */
static bool frame_parts(const part_walk *w, uint32_t c, uint32_t n_parts, size_t len, kvc_framing *fr,
                        kvc_framing_miss *m) {
    const part_walk *failed = w[0].rc != KVC_OK ? &w[0] : n_parts == 2 && w[1].rc != KVC_OK ? &w[1] : NULL;
    size_t end = 0;
    if (!failed) {
        end = w[0].f.end + (n_parts == 2 ? w[1].f.end : 0);
    }
    if (failed || end != len) {
        if (m) {
            m->rc = failed ? failed->rc : KVC_OK;
            m->end = end;
            m->err = failed ? failed->err : m->err;
        }
        return false;
    }
    memset(fr, 0, sizeof *fr);
    fr->streams = c < 3;
    fr->ext_bytes = cand_ext[c];
    fr->prefixed = w[0].f.prefixed;
    fr->src_seq_id = w[0].f.src_seq_id;
    fr->n_parts = n_parts;
    put_part(fr, 0, &w[0], 0);
    if (n_parts == 2) {
        put_part(fr, 1, &w[1], w[0].f.end);
    }
    return !fr->ext_bytes || has_cells(fr);   /* an extension tells framings apart only with cells */
}

/* A hybrid memory's recurrent part that takes data[0, len): its cell count and the fewest layer
 * records that frame it (they are not counted in the bytes). false when none up to 256 does; the
 * search stops where more records cannot help (the walk says so). */
static bool recurrent_part(const uint8_t *data, size_t len, uint32_t *cells, uint32_t *records) {
    for (uint32_t k = 1; k <= 256; k++) {
        kvc_state_desc d;
        kvc_err scratch;
        if (kvc_state_describe_records(data, len, 0, k, &d, NULL, NULL, NULL, 0, NULL, 0, &scratch) != KVC_OK) {
            if (d.records_final) {
                return false;
            }
            continue;
        }
        if (d.end == len) {
            *cells = d.cell_count;
            *records = k;
            return true;
        }
    }
    return false;
}

/* Its recurrent part, starting at byte off (one section of `cells` cells), after the cache parts. */
static void put_recurrent(kvc_framing *fr, size_t off, uint32_t cells, uint32_t records) {
    fr->recurrent_records = records;
    fr->rec_off = off;
    fr->rec_cells = cells;
}

void kvc_state_framings(const uint8_t *data, size_t len, bool allow_prefix, kvc_framing *out, uint32_t *n_out,
                        kvc_framing_miss miss[4]) {
    part_walk *w = kvc_malloc_n(2 * N_CAND, sizeof *w);   /* each holds 3 KiB of sections */
    uint32_t n = 0, cells, records;
    for (uint32_t k = 0; k < 4; k++) {
        miss[k].rc = 1;
    }
    *n_out = 0;
    if (!w) {
        for (uint32_t k = 0; k < 4; k++) {
            miss[k].rc = kvc_err_set(&miss[k].err, KVC_E_NOMEM, "out of memory framing a state");
        }
        return;
    }
    /* every walk once: a candidate's first part serves its framings of one part and of two */
    for (uint32_t c = 0; c < N_CAND; c++) {
        const uint32_t eb = cand_ext[c];
        unsigned layout = (c < 3 ? (unsigned)KVC_LAYOUT_STREAMS : 0u) | KVC_LAYOUT_PREFIX;
        if (eb) {
            layout |= KVC_LAYOUT_CELL_EXT | KVC_LAYOUT_EXT_XY | (eb == 12 ? (unsigned)KVC_LAYOUT_EXT_TOK : 0u);
        }
        part_walk *cw = &w[2 * c];
        walk_part(data, len, 0, layout, allow_prefix, &cw[0]);
        if (cw[0].rc == KVC_OK) {
            walk_part(data, len, cw[0].f.end, layout, false, &cw[1]);
        }
    }
    /* with stream counts (one part, two; each without an extension, with 12 bytes, with 8), then
     * without */
    for (uint32_t n_parts = 1; n_parts <= 2; n_parts++) {
        for (uint32_t c = 0; c < 3; c++) {
            n += frame_parts(&w[2 * c], c, n_parts, len, &out[n], c == 0 ? &miss[n_parts - 1] : NULL);
        }
    }
    for (uint32_t n_parts = 1; n_parts <= 2; n_parts++) {
        n += frame_parts(&w[2 * 3], 3, n_parts, len, &out[n], &miss[2 + n_parts - 1]);
    }
    /* a hybrid memory's state: the attention part (stream counts, no extension; with a sliding
     * window an iSWA pair's base and SWA caches, two parts), then the recurrent part; or the
     * recurrent part alone after the prefix */
    const part_walk *attn = &w[0];
    size_t off = 0;
    for (uint32_t k = 0; k < 2 && attn[k].rc == KVC_OK; k++) {
        off += attn[k].f.end;
        if (off >= len) {
            break;
        }
        if (recurrent_part(data + off, len - off, &cells, &records)) {
            kvc_framing *fr = &out[n++];
            memset(fr, 0, sizeof *fr);
            fr->streams = true;
            fr->prefixed = attn[0].f.prefixed;
            fr->src_seq_id = attn[0].f.src_seq_id;
            fr->n_parts = k + 1;
            put_part(fr, 0, &attn[0], 0);
            if (k) {
                put_part(fr, 1, &attn[1], attn[0].f.end);
            }
            put_recurrent(fr, off, cells, records);
        }
    }
    if (allow_prefix && len >= 8 && kvc_le_get_u32(data) == KVC_SEQ_MAGIC &&
        recurrent_part(data + 8, len - 8, &cells, &records)) {
        kvc_framing *fr = &out[n++];
        memset(fr, 0, sizeof *fr);
        fr->prefixed = true;
        fr->src_seq_id = kvc_le_get_i32(data + 4);
        put_recurrent(fr, 8, cells, records);
    }
    *n_out = n;
    kvc_free(w);
}

void kvc_state_frames_exactly(const uint8_t *data, size_t len, const unsigned *layouts, uint32_t n_layouts,
                              uint32_t n_parts, bool single, uint32_t *framed, uint32_t *readable) {
    *framed = 0;
    *readable = 0;
    for (uint32_t c = 0; c < n_layouts && c < 32; c++) {
        size_t off = 0;
        bool outside = false;
        uint32_t k = 0;
        for (; k < n_parts; k++) {
            kvc_state_frame f;
            /* whether, not why: no message is formatted (err NULL) */
            if (kvc_state_walk_frame(off ? data + off : data, len - off, layouts[c], false, single, &f, NULL, NULL,
                                     0, NULL) != KVC_OK) {
                break;
            }
            off += f.end;
            outside = outside || f.ids_outside;
        }
        if (k == n_parts && off == len) {
            *readable |= 1u << c;
            *framed |= outside ? 0u : 1u << c;
        }
    }
}
