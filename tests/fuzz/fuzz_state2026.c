/* libFuzzer target: the state decoders into caches of semantics 2026 (csrc/kvc_state.c: a section
 * per stream, scattered placement, V layout conversion into scattered cells):
 * kvc_unified_state_read_parts_lay into one cache, whole or one sequence, one stream or a stream
 * per sequence, with or without a sliding window, with or without the per-cell extension (cell
 * records of 8 or 12 more bytes), in a given layout or the one found from the bytes.
 *
 * Input: a 12-byte header, then the state blob.
 *   [0..10] the cache geometry of fuzz_cache.h (its semantics bit is ignored: always 2026; [2]
 *        bits 6-7 the per-cell extension), with
 *        [4] bits 0-3 allocation fault (0 none, else the n-th allocation inside the read fails),
 *            bit 4 KVC_STATE_CONVERT_V, bit 5 KVC_STATE_EXACT, bit 6 the layout found from the
 *            bytes (KVC_LAYOUT_DETECT), else bit 7 chooses it: today's streams (with the
 *            sequence-blob prefix allowed) or the seed's
 *   [11] bits 0-2 destination: seq_id = bits % (n_seq_max + 1) - 1 (-1 = whole cache); bit 3
 *        KVC_LAYOUT_EXT_XY, bit 4 KVC_LAYOUT_EXT_TOK added to a given layout (the extension's
 *        bytes in the cell records of a cache that has it: none, x y, or x y tok)
 *
 * Contract checked on every input:
 *   - failure: KVC_E_STATE (or KVC_E_NOMEM under an injected fault) with a message, and the cache
 *     exactly as before (every stream's cells and head, placement, queued copies, K/V bytes);
 *   - success: at most len bytes consumed (exactly len with the exact flag), every stream's cell
 *     table consistent; the state is written back in the layout read, or, for a cache with the
 *     extension read from a layout without it, in that layout with 12-byte extensions (a layout
 *     without them cannot hold the cells: refused); after a whole-cache read the state written
 *     back is the consumed bytes made canonical (ids ascending and each once, each cell's
 *     extension as read or its defaults, V in the cache's layout: nothing accepted is lost); the
 *     state written back reads into an empty twin cache and writes the same bytes
 *     there; the state written back in the layout read reads back in that layout, consuming all
 *     of it, and writes the same bytes again (a sequence's: the same cells, in whatever order
 *     the placement gave them); a whole-cache read of it leaves the cache exactly as the first
 *     read did;
 *   - describe (kvc_state_describe_ext, no cache): of a refused blob it fails cleanly or stays
 *     inside the input; of each section a whole-cache read accepted it agrees with the stream
 *     (cells, positions, sequence sets, extensions, offsets, data sizes). */
#include "fuzz_cache.h"
#include "fuzz_part.h"
#include "kvc_state.h"

enum { HEADER = 12 };
_Static_assert(FC_MAX_LAYERS <= FP_MAX_LAYERS, "layers the oracle's walk cannot hold");
static const size_t MAX_KV_BYTES = (size_t)512 << 10;

typedef struct call {
    fc_geometry g;
    int32_t seq_id;
    uint8_t prefill, fault;
    unsigned flags, layout;
} call;

static bool parse_header(const uint8_t *data, size_t size, call *k) {
    if (size < HEADER) {
        return false;
    }
    uint8_t b[FC_GEOMETRY_BYTES];
    memcpy(b, data, sizeof b);
    b[1] |= 0x20; /* semantics 2026 */
    memset(k, 0, sizeof *k);
    if (!fc_geometry_parse(&k->g, b, MAX_KV_BYTES)) {
        return false;
    }
    k->prefill = data[3];
    k->fault = data[4] & 15;
    k->flags = ((data[4] >> 4) & 1 ? KVC_STATE_CONVERT_V : 0) | ((data[4] >> 5) & 1 ? KVC_STATE_EXACT : 0);
    const unsigned streams = KVC_LAYOUT_STREAMS | KVC_LAYOUT_PREFIX;
    k->layout = (data[4] >> 6) & 1 ? KVC_LAYOUT_DETECT | streams : (data[4] >> 7) & 1 ? streams : 0u;
    if (!(k->layout & KVC_LAYOUT_DETECT)) {
        k->layout |= ((data[11] >> 3) & 1 ? KVC_LAYOUT_EXT_XY : 0u) | ((data[11] >> 4) & 1 ? KVC_LAYOUT_EXT_TOK : 0u);
    }
    k->seq_id = (int32_t)((data[11] & 7) % (k->g.n_seq_max + 1)) - 1;
    return true;
}

/* Bytes of the extension in each cell record of cache c's state in layout lay. */
static uint32_t ext_bytes(const kvc_unified *c, unsigned lay) {
    return kvc_unified_has_ext(c) ? kvc_layout_ext_bytes(lay) : 0;
}

/* What state_write in layout wlay must give back after a whole-cache read of blob[0, consumed)
 * in layout lay: the stream count (with KVC_LAYOUT_STREAMS), then each section canonical (ids
 * ascending and each once, the extension as read or its defaults, V in the cache's layout, zero
 * rows without K/V memory); an empty section of the stream layout is its count alone. Each
 * section with cells, described without a cache, agrees with what its stream holds. */
static uint8_t *canonical_whole(const kvc_unified *c, const uint8_t *blob, size_t consumed, unsigned lay,
                                unsigned wlay, bool meta_only, size_t *len) {
    const bool streams = lay & KVC_LAYOUT_STREAMS;
    const uint32_t ext_r = ext_bytes(c, lay), ext_w = ext_bytes(c, wlay);
    /* each record grows by at most ext_w bytes, and a record takes at least 8 */
    const size_t cap = consumed + 4 + (consumed / 8) * ext_w;
    uint8_t *out = fz_alloc(cap);
    size_t off = 0, o = 0;
    uint32_t n_sec = 1;
    if (streams) {
        FUZZ_CHECK(consumed >= 4, "a stream-layout state of %zu bytes was accepted", consumed);
        n_sec = kvc_le_get_u32(blob);
        FUZZ_CHECK(n_sec == c->n_stream, "%u stream sections accepted by a cache of %u streams", n_sec, c->n_stream);
        memcpy(out, blob, 4);
        off = o = 4;
    }
    for (uint32_t s = 0; s < n_sec; s++) {
        FUZZ_CHECK(off + 4 <= consumed, "section %u lies past the consumed bytes", s);
        if (streams && kvc_le_get_u32(blob + off) == 0) {
            memset(out + o, 0, 4);
            off += 4;
            o += 4;
            continue;
        }
        const layout L = walk(c, -1, blob + off, consumed - off, ext_r);
        fp_check_describe(blob + off, consumed - off, ext_r, c, kvc_unified_stream_cells_c(c, s), &L);
        size_t n;
        uint8_t *part = canonical(c, -1, &L, meta_only, ext_w, &n);
        FUZZ_CHECK(o + n <= cap, "the canonical state outgrows the input");
        memcpy(out + o, part, n);
        free(part);
        off += L.end;
        o += n;
    }
    FUZZ_CHECK(off == consumed, "the sections span %zu bytes, the read consumed %zu", off, consumed);
    *len = o;
    return out;
}

/* The state of seq_id in `layout` (malloc'ed, *len bytes). */
static uint8_t *write_lay(kvc_unified *c, int32_t seq_id, unsigned layout, size_t *len) {
    const size_t n = kvc_unified_state_size_lay(c, seq_id, layout);
    uint8_t *out = fz_alloc(n);
    size_t written = 0;
    const int rc = kvc_unified_state_write_range_lay(c, seq_id, layout, 0, out, n, &written);
    FUZZ_CHECK(rc == KVC_OK && written == n, "state_write in layout %u: %d, %zu of %zu bytes", layout, rc, written, n);
    *len = n;
    return out;
}

/* The key of each cell of a sequence's section: its metadata record (12 bytes and the
 * extension's), then its K row and V row of every layer. */
static const uint8_t *g_keys;
static size_t g_key_len;
static int cmp_key(const void *a, const void *b) {
    return memcmp(g_keys + *(const uint32_t *)a * g_key_len, g_keys + *(const uint32_t *)b * g_key_len, g_key_len);
}

/* A single sequence's state w[0, len) that c wrote in layout lay, with the cells of each section
 * sorted by position (then by their bytes): the same state whatever cells the placement picked
 * (today's find_slot starts at the stream's head and wraps, so a state read back lists its
 * cells rotated). */
static uint8_t *cells_sorted(const kvc_unified *c, int32_t seq_id, unsigned lay, const uint8_t *w, size_t len) {
    uint8_t *out = fz_alloc(len);
    size_t off = lay & KVC_LAYOUT_PREFIX ? KVC_SEQ_PREFIX_BYTES : 0;
    uint32_t n_sec = 1;
    if (lay & KVC_LAYOUT_STREAMS) {
        n_sec = kvc_le_get_u32(w + off);
        off += 4;
    }
    memcpy(out, w, off);
    for (uint32_t s = 0; s < n_sec; s++) {
        const uint32_t cc = kvc_le_get_u32(w + off);
        if ((lay & KVC_LAYOUT_STREAMS) && cc == 0) {
            memcpy(out + off, w + off, 4);
            off += 4;
            continue;
        }
        const uint32_t rec = 12 + ext_bytes(c, lay);
        const layout L = walk(c, seq_id, w + off, len - off, ext_bytes(c, lay));
        size_t key_len = rec;
        for (uint32_t l = 0; l < c->n_layer; l++) {
            key_len += c->layers[l].k_row_bytes + c->layers[l].v_row_bytes;
        }
        uint8_t *keys = fz_alloc((size_t)cc * key_len);
        uint32_t *order = fz_alloc((size_t)cc * sizeof *order);
        const size_t el = c->n_layer ? v_elem(c) : 0;
        for (uint32_t k = 0; k < cc; k++) {
            uint8_t *q = keys + (size_t)k * key_len;
            memcpy(q, L.p + 4 + rec * (size_t)k, rec);
            q += rec;
            for (uint32_t l = 0; l < c->n_layer; l++) {
                const kvc_layer *ly = &c->layers[l];
                memcpy(q, L.p + L.k_off[l] + (size_t)k * ly->k_row_bytes, ly->k_row_bytes);
                q += ly->k_row_bytes;
                if (L.vt) {
                    for (uint32_t j = 0; j < ly->n_embd_v; j++, q += el) {
                        memcpy(q, blob_v_elem(c, &L, l, k, j), el);
                    }
                } else {
                    memcpy(q, L.p + L.v_off[l] + (size_t)k * ly->v_row_bytes, ly->v_row_bytes);
                    q += ly->v_row_bytes;
                }
            }
            order[k] = k;
        }
        g_keys = keys;
        g_key_len = key_len;
        qsort(order, cc, sizeof *order, cmp_key);
        uint8_t *o = out + off;
        memcpy(o, L.p, 4);
        for (uint32_t k = 0; k < cc; k++) {
            memcpy(o + 4 + rec * (size_t)k, keys + order[k] * key_len, rec);
        }
        memcpy(o + L.meta_end, L.p + L.meta_end, 8);
        size_t at = rec;
        for (uint32_t l = 0; l < c->n_layer; l++) {
            const kvc_layer *ly = &c->layers[l];
            memcpy(o + L.k_off[l] - 12, L.p + L.k_off[l] - 12, 12);
            memcpy(o + L.v_off[l] - 12, L.p + L.v_off[l] - 12, 12);
            for (uint32_t k = 0; k < cc; k++) {
                const uint8_t *key = keys + order[k] * key_len + at;
                memcpy(o + L.k_off[l] + (size_t)k * ly->k_row_bytes, key, ly->k_row_bytes);
                if (L.vt) {
                    for (uint32_t j = 0; j < ly->n_embd_v; j++) {
                        memcpy(o + L.v_off[l] + ((size_t)j * cc + k) * el, key + ly->k_row_bytes + j * el, el);
                    }
                } else {
                    memcpy(o + L.v_off[l] + (size_t)k * ly->v_row_bytes, key + ly->k_row_bytes, ly->v_row_bytes);
                }
            }
            at += ly->k_row_bytes + ly->v_row_bytes;
        }
        free(keys);
        free(order);
        off += L.end;
    }
    FUZZ_CHECK(off == len, "the sections of a written state span %zu of its %zu bytes", off, len);
    return out;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    call k;
    if (!parse_header(data, size, &k)) {
        return 0;
    }
    const uint8_t *blob = data + HEADER;
    const size_t len = size - HEADER;
    fc_cache t;
    fc_cache_init(&t, &k.g);
    fc_prefill(&t, k.prefill);
    fc_image before;
    fc_image_take(&before, &t);
    kvc_unified *c = &t.c;

    kvc_err err = { 0, "" };
    size_t consumed = 12345;
    unsigned used = 0;
    kvc_fail_alloc_after = k.fault;
    const int rc = kvc_unified_state_read_parts_lay(&c, 1, k.seq_id, blob, len, k.flags, k.layout, &consumed, &used, &err);
    const bool fault_pending = kvc_fail_alloc_after > 0;
    kvc_fail_alloc_after = 0;
    if (fz_verbose()) {
        fprintf(stderr, "%u stream(s), swa %d, seq_id %d, flags %u, layout %#x, %zu bytes: %s (layout %#x)\n",
                c->n_stream, c->swa_type, k.seq_id, k.flags, k.layout, len, rc == KVC_OK ? "read" : err.msg, used);
    }
    if (rc != KVC_OK) {
        fz_check_refused(rc, &err, k.fault, fault_pending, "state_read");
        fc_image_check(&before, &t, true, "after a failed read");
        fp_check_describe(blob, len, kvc_layout_ext_bytes(k.layout & ~(unsigned)KVC_LAYOUT_DETECT), NULL, NULL, NULL);
        fc_image_free(&before);
        fc_cache_free(&t);
        return 0;
    }
    FUZZ_CHECK(consumed <= len, "consumed %zu of %zu bytes", consumed, len);
    FUZZ_CHECK(!(k.flags & KVC_STATE_EXACT) || consumed == len, "exact read left %zu trailing bytes", len - consumed);
    fc_check_streams(c, "after a successful read");

    size_t w1_len, w2_len;
    const unsigned read_lay = used & ~(unsigned)KVC_LAYOUT_DETECT;
    unsigned layout = read_lay;
    if (kvc_unified_has_ext(c) && !(read_lay & KVC_LAYOUT_EXT_XY)) {
        /* the cells' extensions have no place in the layout read: it is refused for writing */
        FUZZ_CHECK(kvc_unified_state_size_lay(c, k.seq_id, read_lay) == 0,
                   "a layout without the extension (%#x) sized for a cache with it", read_lay);
        layout = read_lay | KVC_LAYOUT_EXT_XY | KVC_LAYOUT_EXT_TOK;
    }
    uint8_t *w1 = write_lay(c, k.seq_id, layout, &w1_len);
    if (k.seq_id < 0) {
        /* nothing the whole-cache read accepted is lost on the way out */
        size_t want_len;
        uint8_t *want = canonical_whole(c, blob, consumed, read_lay, layout, k.g.meta_only, &want_len);
        FUZZ_CHECK(want_len == w1_len && memcmp(want, w1, w1_len) == 0,
                   "the re-write (%zu bytes) is not the consumed state made canonical (%zu bytes; at %ld)", w1_len,
                   want_len, want_len == w1_len ? fz_first_diff(want, w1, w1_len) : -1L);
        free(want);
    }
    {
        /* into an empty twin the cells go in order: the state written again is the same */
        fc_cache twin;
        fc_cache_init(&twin, &k.g);
        kvc_unified *tc = &twin.c;
        const int rc_twin = kvc_unified_state_read_parts_lay(&tc, 1, k.seq_id, w1, w1_len, KVC_STATE_EXACT, layout,
                                                             &consumed, NULL, &err);
        FUZZ_CHECK(rc_twin == KVC_OK && consumed == w1_len, "reading the re-write into an empty cache: %d (%s)", rc_twin,
                   err.msg);
        size_t wt_len;
        uint8_t *wt = write_lay(tc, k.seq_id, layout, &wt_len);
        FUZZ_CHECK(wt_len == w1_len && memcmp(wt, w1, w1_len) == 0,
                   "the re-write read into an empty cache writes other bytes (%zu / %zu, at %ld)", wt_len, w1_len,
                   wt_len == w1_len ? fz_first_diff(wt, w1, w1_len) : -1L);
        free(wt);
        fc_cache_free(&twin);
    }
    fc_image after;
    fc_image_take(&after, &t);
    const int rc2 = kvc_unified_state_read_parts_lay(&c, 1, k.seq_id, w1, w1_len, KVC_STATE_EXACT, layout, &consumed,
                                                     NULL, &err);
    if (rc2 != KVC_OK && k.seq_id >= 0 && strstr(err.msg, "no room: sequence") != NULL) {
        /* the sequence's cells that other sequences share stay taken when it is read again: its
         * own state may need more free cells than the stream has (an empty section read as a
         * no-op left them all) — refused, nothing changed */
        fc_image_check(&after, &t, true, "after a refused re-read");
        free(w1);
        fc_image_free(&after);
        fc_image_free(&before);
        fc_cache_free(&t);
        return 0;
    }
    FUZZ_CHECK(rc2 == KVC_OK && consumed == w1_len, "reading the re-write back (layout %#x): %d (%s)", layout, rc2,
               err.msg);
    fc_check_streams(c, "after reading the re-write");
    uint8_t *w2 = write_lay(c, k.seq_id, layout, &w2_len);
    FUZZ_CHECK(w2_len == w1_len, "second re-write of %zu bytes, the first %zu", w2_len, w1_len);
    if (k.seq_id < 0) {
        FUZZ_CHECK(memcmp(w1, w2, w1_len) == 0, "second re-write differs at %ld", fz_first_diff(w1, w2, w1_len));
    } else {
        uint8_t *s1 = cells_sorted(c, k.seq_id, layout, w1, w1_len), *s2 = cells_sorted(c, k.seq_id, layout, w2, w2_len);
        FUZZ_CHECK(memcmp(s1, s2, w1_len) == 0, "second re-write, cells sorted, differs at %ld",
                   fz_first_diff(s1, s2, w1_len));
        free(s1);
        free(s2);
    }
    if (k.seq_id < 0) {
        fc_image_check(&after, &t, true, "after reading the whole-cache re-write");
    }
    free(w1);
    free(w2);
    fc_image_free(&after);
    fc_image_free(&before);
    fc_cache_free(&t);
    return 0;
}
