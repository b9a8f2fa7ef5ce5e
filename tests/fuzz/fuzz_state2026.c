/* libFuzzer target: the state decoders into caches of semantics 2026 (csrc/kvc_state.c: a section
 * per stream, scattered placement, V layout conversion into scattered cells):
 * kvc_unified_state_read_parts_lay into one cache, whole or one sequence, one stream or a stream
 * per sequence, with or without a sliding window, in a given layout or the one found from the bytes.
 *
 * Input: a 12-byte header, then the state blob.
 *   [0..10] the cache geometry of fuzz_cache.h (its semantics bit is ignored: always 2026), with
 *        [4] bits 0-3 allocation fault (0 none, else the n-th allocation inside the read fails),
 *            bit 4 KVC_STATE_CONVERT_V, bit 5 KVC_STATE_EXACT, bit 6 the layout found from the
 *            bytes (KVC_LAYOUT_DETECT), else bit 7 chooses it: today's streams (with the
 *            sequence-blob prefix allowed) or the seed's
 *   [11] destination: seq_id = byte % (n_seq_max + 1) - 1 (-1 = whole cache)
 *
 * Contract checked on every input:
 *   - failure: KVC_E_STATE (or KVC_E_NOMEM under an injected fault) with a message, and the cache
 *     exactly as before (every stream's cells and head, placement, queued copies, K/V bytes);
 *   - success: at most len bytes consumed (exactly len with the exact flag), every stream's cell
 *     table consistent; the state written back in the layout read (ids canonical, V in the
 *     cache's layout) reads back in that layout, consuming all of it, and writes the same bytes
 *     again (nothing the cache accepted is lost on the way out); a whole-cache read of it leaves
 *     the cache exactly as the first read did. */
#include "fuzz_cache.h"
#include "kvc_state.h"

enum { HEADER = 12 };
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
    k->seq_id = (int32_t)(data[11] % (k->g.n_seq_max + 1)) - 1;
    return true;
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
        FUZZ_CHECK(rc == KVC_E_STATE || (rc == KVC_E_NOMEM && k.fault && !fault_pending),
                   "state_read failed with %d (%s)", rc, err.msg);
        FUZZ_CHECK(err.code == rc && err.msg[0] != 0 && memchr(err.msg, 0, sizeof err.msg) != NULL,
                   "error %d without a message", rc);
        fc_image_check(&before, &t, true, "after a failed read");
        fc_image_free(&before);
        fc_cache_free(&t);
        return 0;
    }
    FUZZ_CHECK(consumed <= len, "consumed %zu of %zu bytes", consumed, len);
    FUZZ_CHECK(!(k.flags & KVC_STATE_EXACT) || consumed == len, "exact read left %zu trailing bytes", len - consumed);
    fc_check_streams(c, "after a successful read");

    size_t w1_len, w2_len;
    const unsigned layout = used & ~(unsigned)KVC_LAYOUT_DETECT;
    uint8_t *w1 = write_lay(c, k.seq_id, layout, &w1_len);
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
    FUZZ_CHECK(w2_len == w1_len && memcmp(w1, w2, w1_len) == 0, "second re-write differs (%zu / %zu bytes, at %ld)",
               w1_len, w2_len, w2_len == w1_len ? fz_first_diff(w1, w2, w1_len) : -1L);
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
