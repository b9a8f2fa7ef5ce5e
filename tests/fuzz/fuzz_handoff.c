/* libFuzzer target: the hand-off header decoder (csrc/kvc_handoff.h): kvc_handoff_import_begin of
 * untrusted bytes into caches of both semantics (2025; 2026 with one stream or a stream per
 * sequence, with or without a sliding window, with or without the per-cell extension), then
 * abort, or a transfer into the reserved regions and commit.
 *
 * Input: a 12-byte header, then the hand-off header.
 *   [0..10] the cache geometry of fuzz_cache.h (the per-cell extension included), with
 *        [4] bits 0-3 allocation fault (0 none, else the n-th allocation inside begin fails),
 *            bit 4 commit (else abort), bit 5 the harness makes the header's length field and
 *            checksum agree with the bytes (so that mutations reach the fields behind them),
 *            bit 6 noise written into the regions before commit or abort
 *   [11] destination: seq_id = byte % (n_seq_max + 1) - 1 (-1 = the header's own id)
 *
 * Contract checked on every input:
 *   - begin fails: KVC_E_STATE (or KVC_E_NOMEM under an injected fault) with a message, the
 *     import inactive, the cache exactly as before (every stream's cells and head, placement,
 *     queued copies, K/V bytes);
 *   - begin succeeds: nothing observable changed; the runs are ascending, inside the stream and
 *     hold cell_count cells; the regions lie inside the cache's K/V memory and their lengths sum
 *     to data_bytes; import_check agrees;
 *   - abort: the cache exactly as before, every K/V byte too;
 *   - commit: KVC_OK, every stream's cells consistent, and exporting the sequence back gives the
 *     header's cells (same positions and extensions, in order) and the bytes written into the
 *     regions (with a sliding window: at most the header's cells, the export leaving out the
 *     masked ones). */
#include "fuzz_cache.h"
#include "kvc_handoff.h"
#include "kvc_state.h"

enum { HEADER = 12, FIXED = 40, PER_LAYER = 28, PER_RUN = 8, SUM = 8 };
static const size_t MAX_KV_BYTES = (size_t)512 << 10;

typedef struct call {
    fc_geometry g;
    int32_t seq_id;
    uint8_t prefill, fault;
    bool commit, fix_sum, noise;
} call;

static bool parse_header(const uint8_t *data, size_t size, call *k) {
    if (size < HEADER) {
        return false;
    }
    memset(k, 0, sizeof *k);
    if (!fc_geometry_parse(&k->g, data, MAX_KV_BYTES)) {
        return false;
    }
    k->prefill = data[3];
    k->fault = data[4] & 15;
    k->commit = (data[4] >> 4) & 1;
    k->fix_sum = (data[4] >> 5) & 1;
    k->noise = (data[4] >> 6) & 1;
    k->seq_id = (int32_t)(data[11] % (k->g.n_seq_max + 1)) - 1;
    return true;
}

/* The cell section of a well-formed header h[0, len): where it starts, and its cell count. */
static const uint8_t *cell_section(const uint8_t *h, size_t len, uint32_t *cc) {
    const uint32_t n_layer = kvc_le_get_u32(h + 24);
    const size_t runs_off = FIXED + (size_t)n_layer * PER_LAYER;
    FUZZ_CHECK(runs_off + 4 <= len, "accepted header of %zu bytes has no room for its runs", len);
    const size_t off = runs_off + 4 + (size_t)kvc_le_get_u32(h + runs_off) * PER_RUN;
    FUZZ_CHECK(off + 4 + SUM <= len, "accepted header of %zu bytes has no room for its cells", len);
    *cc = kvc_le_get_u32(h + off);
    return h + off;
}

/* Region k (address, length) lies inside one K or V block of the cache's memory. */
static void check_regions(const fc_cache *t, const kvc_handoff_import *imp) {
    const uint64_t n = kvc_handoff_n_regions(&t->c, imp->n_runs);
    if (n == 0) {
        FUZZ_CHECK(imp->data_bytes == 0 || t->mem.k[0] == NULL, "no regions for %llu data bytes",
                   (unsigned long long)imp->data_bytes);
        return;
    }
    uint64_t *r = fz_alloc((size_t)n * 2 * sizeof *r);
    kvc_handoff_regions(&t->c, imp->stream, imp->runs, imp->n_runs, r);
    uint64_t sum = 0;
    for (uint64_t i = 0; i < n; i++) {
        const uintptr_t a = (uintptr_t)r[2 * i];
        const uint64_t l = r[2 * i + 1];
        bool inside = false;
        for (uint32_t y = 0; y < t->c.n_layer && !inside; y++) {
            const uintptr_t k0 = (uintptr_t)t->mem.k[y], v0 = (uintptr_t)t->mem.v[y];
            inside = (a >= k0 && a + l <= k0 + t->mem.k_bytes[y]) || (a >= v0 && a + l <= v0 + t->mem.v_bytes[y]);
        }
        FUZZ_CHECK(inside, "region %llu (%llu bytes) outside the K/V memory", (unsigned long long)i,
                   (unsigned long long)l);
        sum += l;
    }
    FUZZ_CHECK(sum == imp->data_bytes, "regions hold %llu bytes, the import %llu", (unsigned long long)sum,
               (unsigned long long)imp->data_bytes);
    free(r);
}

static void check_import(const fc_cache *t, const kvc_handoff_import *imp) {
    FUZZ_CHECK(imp->active && imp->c == &t->c, "begin succeeded with an inactive import");
    FUZZ_CHECK(imp->stream < t->c.n_stream, "stream %u of %u", imp->stream, t->c.n_stream);
    FUZZ_CHECK(imp->seq_id >= 0 && (uint32_t)imp->seq_id < t->c.n_seq_max, "destination %d", imp->seq_id);
    const uint32_t size = t->c.cells.size;
    uint64_t cells = 0;
    for (uint32_t r = 0; r < imp->n_runs; r++) {
        FUZZ_CHECK(imp->runs[r].n > 0 && imp->runs[r].first <= size && imp->runs[r].n <= size - imp->runs[r].first,
                   "run %u [%u, +%u) outside %u cells", r, imp->runs[r].first, imp->runs[r].n, size);
        cells += imp->runs[r].n;
    }
    FUZZ_CHECK(cells == imp->cell_count, "runs hold %llu cells, the header %u", (unsigned long long)cells,
               imp->cell_count);
    check_regions(t, imp);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    call k;
    if (!parse_header(data, size, &k)) {
        return 0;
    }
    const size_t len = size - HEADER;
    uint8_t *h = fz_dup(data + HEADER, len);
    if (k.fix_sum && len >= 12 + SUM) {
        kvc_le_put_u32(h + 8, (uint32_t)len);
        kvc_le_put_u64(h + len - SUM, kvc_handoff_checksum(h, len - SUM));
    }
    fc_cache t;
    fc_cache_init(&t, &k.g);
    fc_prefill(&t, k.prefill);
    fc_image before;
    fc_image_take(&before, &t);

    kvc_handoff_import imp;
    memset(&imp, 0xA5, sizeof imp); /* begin must set every field it leaves to be read */
    kvc_err err = { 0, "" };
    kvc_fail_alloc_after = k.fault;
    const int rc = kvc_handoff_import_begin(&t.c, k.seq_id, h, len, &imp, &err);
    const bool fault_pending = kvc_fail_alloc_after > 0;
    kvc_fail_alloc_after = 0;
    if (fz_verbose()) {
        fprintf(stderr, "semantics %d, %u stream(s), swa %d, seq_id %d, %zu bytes: %s\n", t.c.ops->semantics, t.c.n_stream,
                t.c.swa_type, k.seq_id, len, rc == KVC_OK ? "begun" : err.msg);
    }
    if (rc != KVC_OK) {
        fz_check_refused(rc, &err, k.fault, fault_pending, "import_begin");
        FUZZ_CHECK(!imp.active, "a failed begin left the import active");
        kvc_handoff_import_abort(&imp); /* a no-op on an inactive import */
        fc_image_check(&before, &t, true, "after a failed begin");
        goto done;
    }
    fc_image_check(&before, &t, true, "after begin");
    check_import(&t, &imp);
    FUZZ_CHECK(kvc_handoff_import_check(&imp, &err) == KVC_OK, "import_check after begin: %s", err.msg);

    uint8_t *sent = NULL;
    if (imp.data_bytes) {
        sent = fz_alloc((size_t)imp.data_bytes);
        if (k.noise) {
            fz_rng g;
            fz_rng_seed(&g, len);
            fz_fill(&g, sent, (size_t)imp.data_bytes);
            kvc_handoff_scatter(&t.c, imp.stream, imp.runs, imp.n_runs, sent);
        } else {
            kvc_handoff_gather(&t.c, imp.stream, imp.runs, imp.n_runs, sent);
        }
    }
    if (!k.commit) {
        kvc_handoff_import_abort(&imp);
        FUZZ_CHECK(!imp.active, "abort left the import active");
        fc_image_check(&before, &t, true, "after abort");
        free(sent);
        goto done;
    }
    const uint32_t want_cells = imp.cell_count;
    const int32_t dst = imp.seq_id;
    const uint64_t want_bytes = imp.data_bytes;
    const int rc2 = kvc_handoff_import_commit(&imp, &err);
    FUZZ_CHECK(rc2 == KVC_OK && !imp.active, "commit of an unchanged cache: %d (%s)", rc2, err.msg);
    fc_check_streams(&t.c, "after commit");

    /* the sequence exported back: the header's cells, the bytes the transfer wrote */
    if (want_cells > 0) {
        kvc_handoff_export e;
        memset(&e, 0, sizeof e);
        FUZZ_CHECK(kvc_handoff_export_make(&t.c, dst, &e, &err) == KVC_OK, "export after commit: %s", err.msg);
        uint32_t cc_in, cc_out;
        const uint8_t *in = cell_section(h, len, &cc_in);
        const uint8_t *out = cell_section(e.header, e.header_len, &cc_out);
        const size_t rec = t.c.cells.ext ? 24 : 12;   /* pos, n_seq_id, (x, y, tok), id */
        FUZZ_CHECK(cc_in == want_cells, "import of %u cells from a header of %u", want_cells, cc_in);
        if (t.c.swa_type != KVC_SWA_NONE) {
            /* the export leaves out the cells its window masks against the sequence's largest
             * position (as a sequence state does): a part of what came in */
            FUZZ_CHECK(cc_out <= cc_in, "exported back %u cells, imported %u", cc_out, cc_in);
        } else {
            FUZZ_CHECK(cc_out == cc_in, "exported back %u cells, imported %u", cc_out, cc_in);
            for (uint32_t i = 0; i < cc_in; i++) {
                const uint8_t *a = in + 4 + rec * i, *b = out + 4 + rec * i;
                const int32_t p_in = kvc_le_get_i32(a), p_out = kvc_le_get_i32(b);
                FUZZ_CHECK(p_in == p_out, "cell %u: position %d imported, %d exported", i, p_in, p_out);
                FUZZ_CHECK(rec == 12 || memcmp(a + 8, b + 8, 12) == 0, "cell %u: another extension exported", i);
            }
            FUZZ_CHECK(e.data_bytes == want_bytes, "exported back %llu data bytes, imported %llu",
                       (unsigned long long)e.data_bytes, (unsigned long long)want_bytes);
            if (sent && e.data_bytes) {
                uint8_t *back = fz_alloc((size_t)e.data_bytes);
                kvc_handoff_gather(&t.c, e.stream, e.runs, e.n_runs, back);
                FUZZ_CHECK(memcmp(back, sent, (size_t)e.data_bytes) == 0, "exported bytes differ at %ld",
                           fz_first_diff(back, sent, (size_t)e.data_bytes));
                free(back);
            }
        }
        kvc_handoff_export_free(&e);
    }
    free(sent);
done:
    fc_image_free(&before);
    fc_cache_free(&t);
    free(h);
    return 0;
}
