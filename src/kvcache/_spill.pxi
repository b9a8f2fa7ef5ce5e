# Write-back at eviction (kvcache.store.PrefixStore.write_back): what the prefix index of a
# UnifiedCache2026 (csrc/kvc_prefix.h) and the checkpoint pool of a RecurrentCache2026
# (csrc/kvc_checkpoint.h) share. Each cache records what its C code evicts, and after the
# operation its _spill_drain hands the records to the sink _spill_set installed.

cdef object spill_sink_arg(object sink):
    """_spill_set's sink: a callable, or None for off; TypeError otherwise."""
    if sink is not None and not callable(sink):
        raise TypeError(f"sink must be callable or None, not {type(sink).__name__}")
    return sink


cdef int spill_deliver(object sink, object cache, list records) except -1:
    """Call sink(cache, records) once the operation is done and the cache unlocked."""
    try:
        sink(cache, records)
    except Exception:
        pass    # the sink keeps its own errors (the store counts them): the operation is done
    return 0
