/* libFuzzer target: kvc_hybrid_state_read (csrc/kvc_hybrid_state.h), whole memory and per
 * sequence, both parts or the recurrent part alone.
 *
 * Input: a 4-byte header that chooses the memory and the call, then the state blob.
 *   [0]  bits 0-1 n_seq_max - 1 (1..4), bit 2 a stream per sequence (kv_unified false), bit 3
 *        n_rs_seq 2 (else 0), bit 4 the recurrent part alone (partial_only), bit 5 no K/V
 *        memory attached, bit 6 KVC_STATE_EXACT, bits 7 the model's layers: 0 -> 3 layers
 *        (0 recurrent, 1 attention, 2 recurrent), 1 -> 2 layers (0 both, 1 attention)
 *   [1]  bits 0-6 destination: seq_id = bits % (n_seq_max + 1) - 1 (-1 = whole memory); bit 7 a
 *        sliding window (llama_memory_hybrid_iswa): the attention part an iSWA pair whose SWA
 *        cache (a window of 2 + bits 0-1 of [2]) holds the last attention layer
 *   [2]  seed of the operations that fill the memory before the read (0: empty)
 *   [3]  row widths: bits 0-3 K/V width / 4 - 1 (f16), bits 4-7 R width / 2 - 1 (f32; S is 2)
 *
 * Contract checked on every input:
 *   - failure: a negative code with a message, and both parts byte-identical to before (their
 *     whole states as written, their counters, every K/V and R/S byte of every plane);
 *   - success: the bytes consumed are what the memory now writes for the destination (the
 *     state it read, canonical); a twin of the memory before the read reads those bytes back
 *     and writes the same; with partial_only the attention part did not change (with a window:
 *     its base cache; the SWA cache is read with the recurrent part). */
#include "fuzz_common.h"
#include "kvc_hybrid_state.h"
#include "kvc_layout.h"
#include "kvc_recurrent_ops.h"
#include "kvc_state.h"
#include "kvc_types.h"
#include "kvc_unified_ops.h"

enum { HEADER = 4, KV_SIZE = 32 };

static const unsigned LAYOUT = KVC_LAYOUT_STREAMS | KVC_LAYOUT_PREFIX | KVC_LAYOUT_SWA_TRIM | KVC_LAYOUT_EXT_XY |
                               KVC_LAYOUT_EXT_TOK;

typedef struct geometry {
    uint32_t n_seq_max, n_rs_seq, n_layer, n_attn, n_recr;
    bool stream_per_seq, partial, meta_only, exact, iswa;
    uint32_t n_swa;
    int32_t seq_id;
    uint8_t prefill;
    int32_t attn_il[2];
    uint32_t recr_il[2];
    uint32_t ek[2], er[2], es[2];
} geometry;

static bool parse_header(const uint8_t *data, size_t size, geometry *g) {
    if (size < HEADER) {
        return false;
    }
    memset(g, 0, sizeof *g);
    g->n_seq_max = 1u + (data[0] & 3);
    g->stream_per_seq = (data[0] >> 2) & 1;
    g->n_rs_seq = (data[0] >> 3) & 1 ? 2 : 0;
    g->partial = (data[0] >> 4) & 1;
    g->meta_only = (data[0] >> 5) & 1;
    g->exact = (data[0] >> 6) & 1;
    if (data[0] >> 7) {
        /* Falcon-H1-like: layer 0 in both parts */
        g->n_layer = 2;
        g->n_attn = 2;
        g->attn_il[0] = 0;
        g->attn_il[1] = 1;
        g->n_recr = 1;
        g->recr_il[0] = 0;
    } else {
        g->n_layer = 3;
        g->n_attn = 1;
        g->attn_il[0] = 1;
        g->n_recr = 2;
        g->recr_il[0] = 0;
        g->recr_il[1] = 2;
    }
    const int32_t s = (int32_t)((data[1] & 0x7f) % (g->n_seq_max + 1)) - 1;
    g->iswa = data[1] >> 7;
    g->n_swa = 2u + (data[2] & 3);
    g->seq_id = g->partial && s < 0 ? 0 : s;   /* the recurrent part alone is a sequence's */
    g->prefill = data[2];
    for (uint32_t l = 0; l < 2; l++) {
        g->ek[l] = 4u * (1u + (data[3] & 15));
        g->er[l] = 2u * (1u + (data[3] >> 4));
        g->es[l] = 2;
    }
    return true;
}

/* --- a hybrid memory with its own memory ---------------------------------------------------- */

typedef struct memory {
    kvc_unified attn;       /* with a window: the iSWA pair's base cache */
    kvc_unified swa;        /* with a window: its SWA cache (the last attention layer) */
    kvc_iswa pair;
    kvc_recurrent recr;
    kvc_hybrid h;
    bool iswa;
    fz_kv amem, smem, rmem;
} memory;

static void attach(kvc_unified *c, fz_kv *m) {
    const size_t rows = (size_t)c->n_stream * c->cells.size;
    for (uint32_t l = 0; l < c->n_layer; l++) {
        fz_kv_layer(m, l, rows * c->layers[l].k_row_bytes, rows * c->layers[l].v_row_bytes);
        kvc_unified_set_layer_buffers(c, l, m->k[l], m->v[l]);
    }
}

static void memory_init(memory *t, const geometry *g) {
    memset(t, 0, sizeof *t);
    kvc_err err = { 0, "" };
    t->iswa = g->iswa;
    /* with a window the base cache keeps the attention layers but the last, the SWA cache that one
     * (today's SWA cache: 256 cells, the padding of its size) */
    const uint32_t n_base = g->iswa ? g->n_attn - 1 : g->n_attn;
    const kvc_unified_params ap = {
        .kv_size = KV_SIZE, .semantics = KVC_SEM_2026, .stream_per_seq = g->stream_per_seq,
        .n_seq_max = g->n_seq_max, .n_pad = 1, .type_k = KVC_TYPE_F16, .type_v = KVC_TYPE_F16, .v_trans = true,
        .n_layer = n_base, .layer_il = g->attn_il, .n_embd_k = g->ek, .n_embd_v = g->ek,
    };
    int rc = kvc_unified_init(&t->attn, &ap, &err);
    FUZZ_CHECK(rc == KVC_OK, "kvc_unified_init: %s", err.msg);
    if (g->iswa) {
        kvc_unified_params sp = ap;
        sp.kv_size = 256;
        sp.n_swa = g->n_swa;
        sp.swa_type = KVC_SWA_STANDARD;
        sp.n_layer = 1;
        sp.layer_il = &g->attn_il[g->n_attn - 1];
        rc = kvc_unified_init(&t->swa, &sp, &err);
        FUZZ_CHECK(rc == KVC_OK, "kvc_unified_init (SWA): %s", err.msg);
        rc = kvc_iswa_init(&t->pair, &t->attn, &t->swa, false, &err);
        FUZZ_CHECK(rc == KVC_OK, "kvc_iswa_init: %s", err.msg);
    }
    const kvc_recurrent_params rp = {
        .kv_size = g->n_seq_max, .n_seq_max = g->n_seq_max, .type_k = KVC_TYPE_F32, .type_v = KVC_TYPE_F32,
        .n_layer = g->n_recr, .n_embd_k = g->er, .n_embd_v = g->es, .semantics = KVC_REC_2026,
        .n_rs_seq = g->n_rs_seq,
    };
    rc = kvc_recurrent_init(&t->recr, &rp, &err);
    FUZZ_CHECK(rc == KVC_OK, "kvc_recurrent_init: %s", err.msg);
    rc = g->iswa ? kvc_hybrid_init_iswa(&t->h, &t->pair, &t->recr, &err) : kvc_hybrid_init(&t->h, &t->attn, &t->recr,
                                                                                            &err);
    FUZZ_CHECK(rc == KVC_OK, "kvc_hybrid_init: %s", err.msg);
    rc = kvc_hybrid_state_init(&t->h, g->n_layer, g->recr_il, &err);
    FUZZ_CHECK(rc == KVC_OK, "kvc_hybrid_state_init: %s", err.msg);
    if (g->meta_only) {
        return;
    }
    attach(&t->attn, &t->amem);
    if (g->iswa) {
        attach(&t->swa, &t->smem);
    }
    const size_t rrows = (size_t)g->n_seq_max * (1 + g->n_rs_seq);
    for (uint32_t l = 0; l < g->n_recr; l++) {
        fz_kv_layer(&t->rmem, l, rrows * t->recr.layers[l].k_row_bytes, rrows * t->recr.layers[l].v_row_bytes);
        kvc_recurrent_set_layer_buffers(&t->recr, l, t->rmem.k[l], t->rmem.v[l]);
    }
}

static void memory_free(memory *t) {
    kvc_unified_free(&t->attn);
    if (t->iswa) {
        kvc_unified_free(&t->swa);
    }
    fz_kv_free(&t->smem);
    kvc_recurrent_free(&t->recr);
    fz_kv_free(&t->amem);
    fz_kv_free(&t->rmem);
}

/* Decodes of one sequence's tokens (a ubatch of 1-4 of them), removals, copies, shifts,
 * rollbacks, as the hybrid memory takes them; then noise in every K/V and R/S byte. */
static void prefill(memory *t, uint8_t seed) {
    fz_rng g;
    fz_rng_seed(&g, seed);
    const uint32_t n_seq = t->attn.n_seq_max;
    const uint32_t n_ops = seed ? 1 + fz_below(&g, 16) : 0;
    for (uint32_t op = 0; op < n_ops; op++) {
        int32_t s = (int32_t)fz_below(&g, n_seq);
        switch (fz_below(&g, 8)) {
        case 0: case 1: case 2: case 3: {
            int32_t pos[4];
            const uint32_t n = 1 + fz_below(&g, 4);
            const int32_t p0 = kvc_hybrid_seq_pos_max(&t->h, s) + 1;
            for (uint32_t i = 0; i < n; i++) {
                pos[i] = p0 + (int32_t)i;
            }
            const uint32_t off[2] = { 0, 1 };
            const kvc_ubatch ub = { n, n, 1, pos, off, &s, NULL, NULL, NULL };
            kvc_err err = { 0, "" };
            const int r = kvc_hybrid_find_slot(&t->h, &ub, &err);
            FUZZ_CHECK(r == 0 || r == 1, "prefill find_slot: %d (%s)", r, err.msg);
            break;
        }
        case 4: {
            const int32_t pm = kvc_hybrid_seq_pos_max(&t->h, s);
            kvc_hybrid_seq_rm(&t->h, s, fz_below(&g, 2) && pm > 0 ? pm : -1, -1);
            break;
        }
        case 5:
            kvc_hybrid_seq_cp(&t->h, s, (int32_t)fz_below(&g, n_seq), -1, -1, NULL);
            break;
        case 6:
            kvc_hybrid_seq_add(&t->h, s, 0, -1, (int32_t)fz_below(&g, 5));
            break;
        default:
            kvc_hybrid_seq_keep(&t->h, s);
            break;
        }
    }
    fz_rng_seed(&g, seed + 1u);
    fz_kv_fill(&t->amem, &g);
    fz_kv_fill(&t->smem, &g);
    fz_kv_fill(&t->rmem, &g);
}

/* --- what a failed read must leave alone ------------------------------------------------------ */

typedef struct image {
    uint8_t *state;      /* the whole memory's state as written */
    size_t len;
    uint32_t a_used, a_head, s_used, s_head, r_head, r_n, r_used;
    fz_kv amem, smem, rmem;
} image;

static uint8_t *write_state(memory *t, int32_t seq_id, unsigned parts, size_t *len) {
    const size_t n = kvc_hybrid_state_size(&t->h, seq_id, LAYOUT, parts);
    uint8_t *out = fz_alloc(n ? n : 1);
    size_t w = 0;
    const int rc = kvc_hybrid_state_write_range(&t->h, seq_id, LAYOUT, parts, 0, out, n, &w);
    FUZZ_CHECK(rc == KVC_OK && w == n, "state_write: %d, %zu of %zu bytes", rc, w, n);
    *len = n;
    return out;
}

static void image_take(image *m, memory *t) {
    memset(m, 0, sizeof *m);
    m->state = write_state(t, -1, KVC_HYBRID_BOTH, &m->len);
    m->a_used = t->attn.cells.used;
    m->a_head = t->attn.head;
    m->s_used = t->iswa ? t->swa.cells.used : 0;
    m->s_head = t->iswa ? t->swa.head : 0;
    m->r_head = t->recr.cells.head;
    m->r_n = t->recr.cells.n;
    m->r_used = t->recr.cells.used;
    fz_kv_copy(&m->amem, &t->amem);
    fz_kv_copy(&m->smem, &t->smem);
    fz_kv_copy(&m->rmem, &t->rmem);
}

static void image_free(image *m) {
    free(m->state);
    fz_kv_free(&m->amem);
    fz_kv_free(&m->smem);
    fz_kv_free(&m->rmem);
}

static void image_check(const image *m, memory *t, const char *when) {
    size_t len;
    uint8_t *now = write_state(t, -1, KVC_HYBRID_BOTH, &len);
    FUZZ_CHECK(len == m->len && memcmp(now, m->state, len) == 0, "%s: the memory's state changed (%zu -> %zu bytes)",
               when, m->len, len);
    free(now);
    FUZZ_CHECK(t->attn.cells.used == m->a_used && t->attn.head == m->a_head,
               "%s: the attention part's counters changed", when);
    FUZZ_CHECK(!t->iswa || (t->swa.cells.used == m->s_used && t->swa.head == m->s_head),
               "%s: the SWA cache's counters changed", when);
    FUZZ_CHECK(t->recr.cells.head == m->r_head && t->recr.cells.n == m->r_n && t->recr.cells.used == m->r_used,
               "%s: the recurrent part's counters changed", when);
    fz_kv_check(&t->amem, &m->amem, when);
    fz_kv_check(&t->smem, &m->smem, when);
    fz_kv_check(&t->rmem, &m->rmem, when);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    geometry g;
    if (!parse_header(data, size, &g)) {
        return 0;
    }
    const uint8_t *blob = data + HEADER;
    const size_t len = size - HEADER;
    const unsigned parts = g.partial ? KVC_HYBRID_PARTIAL_ONLY : KVC_HYBRID_BOTH;
    const unsigned flags = g.exact ? KVC_STATE_EXACT : 0;
    memory t;
    memory_init(&t, &g);
    prefill(&t, g.prefill);
    image before;
    image_take(&before, &t);
    size_t whole_len = 0;
    uint8_t *whole_before = g.partial ? write_state(&t, -1, KVC_HYBRID_BOTH, &whole_len) : NULL;
    const size_t attn_len = kvc_unified_state_size_lay(&t.attn, -1, LAYOUT);

    kvc_err err = { 0, "" };
    size_t consumed = 0;
    const int rc = kvc_hybrid_state_read(&t.h, g.seq_id, len ? blob : NULL, len, flags, LAYOUT, parts, &consumed,
                                         &err);
    if (rc != KVC_OK) {
        FUZZ_CHECK(rc == KVC_E_STATE && err.msg[0], "a refused read: code %d, message '%s'", rc, err.msg);
        image_check(&before, &t, "failed read");
    } else {
        FUZZ_CHECK(consumed <= len && (!g.exact || consumed == len), "consumed %zu of %zu bytes", consumed, len);
        if (g.partial) {
            /* the attention part is as it was: the whole state's attention part did not change */
            size_t n1;
            uint8_t *now = write_state(&t, -1, KVC_HYBRID_BOTH, &n1);
            FUZZ_CHECK(kvc_unified_state_size_lay(&t.attn, -1, LAYOUT) == attn_len && n1 >= attn_len &&
                       memcmp(now, whole_before, attn_len) == 0,
                       "a read of the recurrent part alone changed the attention part");
            free(now);
        }
        /* what it now writes for the destination reads back into a twin and writes the same */
        size_t n1;
        uint8_t *again = write_state(&t, g.seq_id, parts, &n1);
        memory twin;
        memory_init(&twin, &g);
        prefill(&twin, g.prefill);
        size_t c2 = 0;
        const int r2 = kvc_hybrid_state_read(&twin.h, g.seq_id, again, n1, KVC_STATE_EXACT, LAYOUT, parts, &c2, &err);
        FUZZ_CHECK(r2 == KVC_OK && c2 == n1, "the state written back does not read back: %d (%s)", r2, err.msg);
        size_t n2;
        uint8_t *third = write_state(&twin, g.seq_id, parts, &n2);
        FUZZ_CHECK(n1 == n2 && memcmp(again, third, n1) == 0, "the state read back writes other bytes");
        free(third);
        free(again);
        memory_free(&twin);
    }
    free(whole_before);
    image_free(&before);
    memory_free(&t);
    return 0;
}
