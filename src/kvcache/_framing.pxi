# A blob's framings as a memory state, without a cache (csrc/kvc_framing.h): what
# kvcache.statefile.memory_framings, inspect and convert know of a state's layout.

from kvcache.includes.kvc_framing cimport kvc_framing, kvc_framing_miss, kvc_state_framings, KVC_FRAMING_MAX


def state_framings(data, allow_prefix=True):
    """Every framing in which data (bytes-like) is exactly one memory state, found by one C call
    that walks each candidate framing once (csrc/kvc_framing.h): a list of ``(streams, prefixed,
    src_seq_id, parts, cell_ext, recurrent_records)``, ``parts`` per part the ``(offset,
    cell_count)`` of each stream section (offsets into data; a hybrid memory's state ends with its
    recurrent part, one section; kvcache.statefile.Framing says what each field means), in
    kvcache.statefile.memory_framings' order; and a dict ``{(streams, n_parts): StateError}``:
    why data is not one memory state framed with or without stream counts as 1 or 2 parts without
    an extension, for each such framing it is not."""
    cdef size_t n = 0
    cdef _HeldBuffer keep = state_data_view(data)
    cdef const uint8_t *p = state_data_ptr(keep, &n)
    cdef bint ap = bool(allow_prefix)
    cdef kvc_framing *out = <kvc_framing *>PyMem_Malloc(KVC_FRAMING_MAX * sizeof(kvc_framing))
    cdef kvc_framing *fr
    cdef kvc_framing_miss miss[4]
    cdef uint32_t n_out = 0, i, k, s
    if out == NULL:
        keep.release()
        raise MemoryError("state_framings")
    found = []
    errors = {}
    try:
        with nogil:
            kvc_state_framings(p, n, ap, out, &n_out, miss)
        for i in range(n_out):
            fr = &out[i]
            parts = []
            for k in range(fr.n_parts):
                parts.append(tuple([(fr.sec_off[k][s], fr.sec_cells[k][s]) for s in range(fr.n_sec[k])]))
            if fr.recurrent_records:
                parts.append(((fr.rec_off, fr.rec_cells),))
            found.append((bool(fr.streams), bool(fr.prefixed), fr.src_seq_id if fr.prefixed else None,
                          tuple(parts), fr.ext_bytes, fr.recurrent_records))
        for i in range(4):
            if miss[i].rc == 1:
                continue
            key = (i < 2, 1 + i % 2)
            if miss[i].rc == KVC_OK:
                errors[key] = StateError(f"{n - miss[i].end} trailing bytes after the memory state (it ends at "
                                         f"byte {miss[i].end} of {n})")
                continue
            try:
                raise_status(miss[i].rc, &miss[i].err, "cache state framing")
            except StateError as e:
                errors[key] = e
    finally:
        PyMem_Free(out)
        keep.release()
    return found, errors
