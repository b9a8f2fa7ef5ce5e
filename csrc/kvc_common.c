#include "kvc_common.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>

int kvc_fail_alloc_after = 0;

/* Counts down the test hook; returns true when this allocation must fail. */
static bool kvc_alloc_should_fail(void) {
    if (kvc_fail_alloc_after <= 0) {
        return false;
    }
    return --kvc_fail_alloc_after == 0;
}

void *kvc_malloc(size_t n) {
    if (kvc_alloc_should_fail()) {
        return NULL;
    }
    return malloc(n ? n : 1);
}

void *kvc_calloc(size_t count, size_t size) {
    if (kvc_alloc_should_fail()) {
        return NULL;
    }
    return calloc(count ? count : 1, size ? size : 1);
}

void *kvc_realloc(void *p, size_t n) {
    if (kvc_alloc_should_fail()) {
        return NULL;
    }
    return realloc(p, n ? n : 1);
}

void kvc_free(void *p) { free(p); }

int kvc_err_set(kvc_err *err, int code, const char *fmt, ...) {
    if (err) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err->msg, sizeof err->msg, fmt, ap);
        va_end(ap);
        err->code = code;
    }
    return code;
}
