/* Tests of the unified cache's layer table lookup (kvc_unified_layer_index): every model layer
 * finds its kept index, every other index (below, between, above the kept ones) none, for
 * tables of several sizes; a cache without layers finds none. */
#include "kvc_common.h"
#include "kvc_types.h"
#include "kvc_unified.h"
#include "kvc_unified_ops.h"

#include "check.h"

/* A metadata-only cache keeping model layers il[0, n) (ascending). */
static int init(kvc_unified *c, const int32_t *il, uint32_t n) {
    static const uint32_t w[8] = { 64, 64, 64, 64, 64, 64, 64, 64 };
    const kvc_unified_params p = {
        .kv_size = 32, .semantics = KVC_SEM_2026, .n_seq_max = 1, .n_pad = 1, .swa_type = KVC_SWA_NONE,
        .type_k = KVC_TYPE_F16, .type_v = KVC_TYPE_F16, .n_layer = n, .layer_il = il, .n_embd_k = w,
        .n_embd_v = w,
    };
    return kvc_unified_init(c, &p, NULL);
}

static void test_lookup(void) {
    static const int32_t il[8] = { 0, 1, 4, 7, 8, 30, 31, 1000 };
    for (uint32_t n = 0; n <= 8; n++) {
        kvc_unified c;
        REQUIRE(init(&c, il, n) == KVC_OK, "init with %u layers", n);
        for (int64_t x = -3; x <= 1003; x++) {
            int64_t want = -1;
            for (uint32_t k = 0; k < n; k++) {
                if (il[k] == x) {
                    want = k;
                }
            }
            CHECK(kvc_unified_layer_index(&c, x) == want, "%u layers: il %lld -> %lld", n, (long long)x,
                  (long long)kvc_unified_layer_index(&c, x));
        }
        CHECK(kvc_unified_layer_index(&c, INT64_MAX) == -1 && kvc_unified_layer_index(&c, INT64_MIN) == -1,
              "%u layers: the extremes", n);
        kvc_unified_free(&c);
    }
}

int main(void) {
    test_lookup();
    printf("test_layers: %d checks, %d failed\n", n_checks, n_failed);
    return n_failed != 0;
}
