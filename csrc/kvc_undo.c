/* kvcache — the undo log's memory (see kvc_undo.h). */
#include "kvc_undo.h"

#include <string.h>

int kvc_undo_init(kvc_undo *u, uint32_t seq_words) {
    memset(u, 0, sizeof *u);
    u->seq_words = seq_words;
    u->cap_spans = 4;
    u->spans = kvc_malloc_n(u->cap_spans, sizeof *u->spans);
    u->cap_cells = 64;
    u->pos = kvc_malloc_n(u->cap_cells, sizeof *u->pos);
    u->seq = kvc_malloc_n((uint64_t)u->cap_cells * seq_words, sizeof *u->seq);
    if (!u->spans || !u->pos || !u->seq) {
        kvc_undo_free(u);
        return KVC_E_NOMEM;
    }
    return KVC_OK;
}

void kvc_undo_free(kvc_undo *u) {
    kvc_free(u->spans);
    kvc_free(u->pos);
    kvc_free(u->seq);
    memset(u, 0, sizeof *u);
}
