/* Tests of the layer table lookups: the unified cache's (kvc_unified_layer_index), the iSWA
 * pair's (kvc_iswa_layer: which cache, which index in it) and the hybrid memory's
 * (kvc_hybrid_attn_layer, kvc_hybrid_recr_layer). Every model layer finds its part and its index
 * there, every other index (below, between, above the kept ones, the extremes of int64) none;
 * tables of several sizes, every way of sharing a few layers out between the parts. */
#include "kvc_common.h"
#include "kvc_hybrid.h"
#include "kvc_iswa.h"
#include "kvc_recurrent.h"
#include "kvc_recurrent_ops.h"
#include "kvc_types.h"
#include "kvc_unified.h"
#include "kvc_unified_ops.h"

#include "check.h"

#include <string.h>

/* A metadata-only cache of semantics sem keeping model layers il[0, n) (ascending); with n_swa a
 * sliding window. */
static int init_sem(kvc_unified *c, const int32_t *il, uint32_t n, int32_t sem, uint32_t n_swa) {
    static const uint32_t w[16] = { 64, 64, 64, 64, 64, 64, 64, 64, 64, 64, 64, 64, 64, 64, 64, 64 };
    const kvc_unified_params p = {
        .kv_size = 32, .semantics = sem, .n_seq_max = 1, .n_pad = 1, .n_swa = n_swa,
        .swa_type = n_swa ? KVC_SWA_STANDARD : KVC_SWA_NONE, .type_k = KVC_TYPE_F16, .type_v = KVC_TYPE_F16,
        .n_layer = n, .layer_il = il, .n_embd_k = w, .n_embd_v = w,
    };
    return kvc_unified_init(c, &p, NULL);
}

static int init(kvc_unified *c, const int32_t *il, uint32_t n) {
    return init_sem(c, il, n, KVC_SEM_2026, 0);
}

/* The index of x in il[0, n), or -1. */
static int64_t index_in(const int32_t *il, uint32_t n, int64_t x) {
    for (uint32_t k = 0; k < n; k++) {
        if (il[k] == x) {
            return k;
        }
    }
    return -1;
}

static void test_lookup(void) {
    static const int32_t il[8] = { 0, 1, 4, 7, 8, 30, 31, 1000 };
    for (uint32_t n = 0; n <= 8; n++) {
        kvc_unified c;
        REQUIRE(init(&c, il, n) == KVC_OK, "init with %u layers", n);
        for (int64_t x = -3; x <= 1003; x++) {
            const int64_t want = index_in(il, n, x);
            CHECK(kvc_unified_layer_index(&c, x) == want, "%u layers: il %lld -> %lld", n, (long long)x,
                  (long long)kvc_unified_layer_index(&c, x));
        }
        CHECK(kvc_unified_layer_index(&c, INT64_MAX) == -1 && kvc_unified_layer_index(&c, INT64_MIN) == -1,
              "%u layers: the extremes", n);
        kvc_unified_free(&c);
    }
}

/* The model layers of a few-layer model shared out by a code: layer l goes to part
 * (code / 3**l) % 3 (0: the first part, 1: the second, 2: neither). */
enum { N_MODEL = 6 };

static uint32_t layers_of(uint32_t code, uint32_t part, int32_t il[N_MODEL]) {
    uint32_t n = 0;
    for (int32_t l = 0; l < N_MODEL; l++, code /= 3) {
        if (code % 3 == part) {
            il[n++] = l;
        }
    }
    return n;
}

static void test_iswa(void) {
    uint32_t n_codes = 1;
    for (int l = 0; l < N_MODEL; l++) {
        n_codes *= 3;
    }
    for (int32_t sem = KVC_SEM_2025; sem <= KVC_SEM_2026; sem++) {
        for (uint32_t code = 0; code < n_codes; code++) {
            int32_t il_base[N_MODEL], il_swa[N_MODEL];
            const uint32_t nb = layers_of(code, 0, il_base), ns = layers_of(code, 1, il_swa);
            kvc_unified base, swa;
            kvc_iswa c;
            kvc_err err = { 0, "" };
            REQUIRE(init_sem(&base, il_base, nb, sem, 0) == KVC_OK && init_sem(&swa, il_swa, ns, sem, 4) == KVC_OK,
                    "code %u: the caches", code);
            REQUIRE(kvc_iswa_init(&c, &base, &swa, false, &err) == KVC_OK, "code %u: %s", code, err.msg);
            for (int64_t x = -3; x < N_MODEL + 3; x++) {
                const int64_t in_base = index_in(il_base, nb, x), in_swa = index_in(il_swa, ns, x);
                const int want = in_swa >= 0 ? KVC_ISWA_SWA : in_base >= 0 ? KVC_ISWA_BASE : KVC_ISWA_NONE;
                const int64_t want_index = in_swa >= 0 ? in_swa : in_base;
                int64_t index = 99;
                const int part = kvc_iswa_layer(&c, x, &index);
                CHECK(part == want && index == want_index, "sem %d code %u: il %lld -> part %d index %lld", sem,
                      code, (long long)x, part, (long long)index);
            }
            int64_t index = 99;
            CHECK(kvc_iswa_layer(&c, INT64_MAX, &index) == KVC_ISWA_NONE && index == -1 &&
                  kvc_iswa_layer(&c, INT64_MIN, &index) == KVC_ISWA_NONE && index == -1, "code %u: the extremes",
                  code);
            kvc_unified_free(&base);
            kvc_unified_free(&swa);
        }
    }
}

static void test_iswa_shared_layer(void) {
    /* a model layer's K/V in both caches is refused, the pair left as it was */
    static const int32_t il_base[3] = { 0, 2, 5 }, il_swa[3] = { 1, 3, 5 };
    kvc_unified base, swa;
    kvc_iswa c;
    kvc_err err = { 0, "" };
    REQUIRE(init(&base, il_base, 3) == KVC_OK && init_sem(&swa, il_swa, 3, KVC_SEM_2026, 4) == KVC_OK, "caches");
    memset(&c, 0xab, sizeof c);
    const kvc_iswa before = c;
    CHECK(kvc_iswa_init(&c, &base, &swa, false, &err) == KVC_E_ARG &&
          strstr(err.msg, "model layer 5 is in both") != NULL, "shared layer: %s", err.msg);
    CHECK(memcmp(&c, &before, sizeof c) == 0, "a refused pair is left as it was");
    CHECK(kvc_iswa_init(&c, &base, &swa, false, NULL) == KVC_E_ARG, "without err");
    kvc_unified_free(&base);
    kvc_unified_free(&swa);
}

/* A recurrent memory of today's semantics with n layers, numbered as the model's il[0, n). */
static int init_recr(kvc_recurrent *r, const uint32_t *il, uint32_t n) {
    static const uint32_t w[N_MODEL] = { 16, 16, 16, 16, 16, 16 };
    const kvc_recurrent_params p = {
        .kv_size = 1, .n_seq_max = 1, .type_k = KVC_TYPE_F32, .type_v = KVC_TYPE_F32, .n_layer = n,
        .n_embd_k = w, .n_embd_v = w, .semantics = KVC_REC_2026,
    };
    const int rc = kvc_recurrent_init(r, &p, NULL);
    return rc != KVC_OK ? rc : kvc_recurrent_set_model_layers(r, N_MODEL, il, NULL);
}

/* One hybrid memory: the attention layers in the unified cache (windowed: the iSWA pair's base
 * part 0, SWA part 1), the recurrent ones in `recr`; a layer may be in both parts or neither. */
static void check_hybrid(uint32_t attn_code, uint32_t recr_mask, bool windowed) {
    int32_t il_a[N_MODEL], il_s[N_MODEL];
    uint32_t il_r[N_MODEL], nr = 0;
    const uint32_t na = layers_of(attn_code, 0, il_a), ns = windowed ? layers_of(attn_code, 1, il_s) : 0;
    for (uint32_t l = 0; l < N_MODEL; l++) {
        if (recr_mask >> l & 1) {
            il_r[nr++] = l;
        }
    }
    kvc_unified attn, swa;
    kvc_iswa pair;
    kvc_recurrent recr;
    kvc_hybrid h;
    kvc_err err = { 0, "" };
    REQUIRE(init(&attn, il_a, na) == KVC_OK, "attention cache");
    REQUIRE(init_recr(&recr, il_r, nr) == KVC_OK, "recurrent memory of mask %u", recr_mask);
    if (windowed) {
        REQUIRE(init_sem(&swa, il_s, ns, KVC_SEM_2026, 4) == KVC_OK, "SWA cache");
        REQUIRE(kvc_iswa_init(&pair, &attn, &swa, true, &err) == KVC_OK &&
                kvc_hybrid_init_iswa(&h, &pair, &recr, &err) == KVC_OK, "windowed hybrid: %s", err.msg);
    } else {
        REQUIRE(kvc_hybrid_init(&h, &attn, &recr, &err) == KVC_OK, "hybrid: %s", err.msg);
    }
    for (int64_t x = -3; x < N_MODEL + 3; x++) {
        const int64_t in_a = index_in(il_a, na, x), in_s = windowed ? index_in(il_s, ns, x) : -1;
        kvc_unified *const want = in_s >= 0 ? &swa : in_a >= 0 ? &attn : NULL;
        int64_t index = 99;
        const kvc_unified *got = kvc_hybrid_attn_layer(&h, x, &index);
        CHECK(got == want && index == (in_s >= 0 ? in_s : in_a), "attn %u recr %u%s: il %lld -> %s %lld", attn_code,
              recr_mask, windowed ? " windowed" : "", (long long)x, got == &attn ? "attn" : got ? "swa" : "none",
              (long long)index);
        int64_t want_r = -1;
        for (uint32_t k = 0; k < nr; k++) {
            if (il_r[k] == x) {
                want_r = k;
            }
        }
        CHECK(kvc_hybrid_recr_layer(&h, x) == want_r, "attn %u recr %u: recurrent il %lld -> %lld", attn_code,
              recr_mask, (long long)x, (long long)kvc_hybrid_recr_layer(&h, x));
    }
    int64_t index = 99;
    CHECK(kvc_hybrid_attn_layer(&h, INT64_MIN, &index) == NULL && index == -1 &&
          kvc_hybrid_attn_layer(&h, INT64_MAX, &index) == NULL && index == -1 &&
          kvc_hybrid_recr_layer(&h, INT64_MIN) == -1 && kvc_hybrid_recr_layer(&h, INT64_MAX) == -1,
          "attn %u recr %u: the extremes", attn_code, recr_mask);
    if (windowed) {
        kvc_unified_free(&swa);
    }
    kvc_unified_free(&attn);
    kvc_recurrent_free(&recr);
}

static void test_hybrid(void) {
    /* the attention layers: a few codes of each kind (in the base cache, the SWA cache, neither) */
    static const uint32_t codes[] = { 0, 1, 2, 5, 100, 242, 364, 600, 728 };
    for (size_t i = 0; i < sizeof codes / sizeof *codes; i++) {
        for (uint32_t mask = 1; mask < (1u << N_MODEL); mask++) {
            check_hybrid(codes[i], mask, false);
            check_hybrid(codes[i], mask, true);
        }
    }
}

int main(void) {
    test_lookup();
    test_iswa();
    test_iswa_shared_layer();
    test_hybrid();
    printf("test_layers: %d checks, %d failed\n", n_checks, n_failed);
    return n_failed != 0;
}
