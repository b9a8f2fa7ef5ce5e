/* kvcache — the undo log's memory (see kvc_undo.h). */
#include "kvc_undo.h"

#include <string.h>

int kvc_undo_init(kvc_undo *u, uint32_t seq_words) {
    memset(u, 0, sizeof *u);
    u->seq_words = seq_words;
    u->cap_spans = 4;
    u->cap_cells = 64;
    const kvc_array arrays[] = { KVC_ARRAY(u->spans, u->cap_spans), KVC_ARRAY(u->pos, u->cap_cells),
                                 KVC_ARRAY(u->seq, (uint64_t)u->cap_cells * seq_words) };
    int rc = kvc_alloc_arrays(arrays, sizeof arrays / sizeof *arrays);
    if (rc != KVC_OK) {
        memset(u, 0, sizeof *u);
    }
    return rc;
}

void kvc_undo_free(kvc_undo *u) {
    kvc_free(u->spans);
    kvc_free(u->pos);
    kvc_free(u->seq);
    memset(u, 0, sizeof *u);
}
