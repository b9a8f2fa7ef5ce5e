"""Handing a sequence of a UnifiedCache between processes with NIXL (DRAM to DRAM, UCX backend).

Both sides register their cache's K/V buffers with their NIXL agent (``register_cache``); the
sender exports the sequence and ships its header and regions (``SeqExport.regions``) with its
agent's metadata over any channel; the receiver begins the import and READs the sender's regions
straight into the cells it reserved (``pull_sequence``), then commits. No byte of K/V is copied
through Python or a staging buffer. The library is imported by the functions that use it:
the ``nixl`` extra of kvcache. See docs/disaggregated.md.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from kvcache.handoff import _regions, _unified_cache, pair_regions
from kvcache.unified import UnifiedCache

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = ["cache_memory", "register_cache", "descriptors", "pull_sequence"]


def cache_memory(cache: UnifiedCache) -> npt.NDArray[np.uint64]:
    """The cache's K/V buffers as an (N, 3) uint64 array of (address, bytes, device 0): what a
    NIXL agent registers (empty for a cache without K/V memory)."""
    _unified_cache(cache, "cache_memory")
    if cache.buffers == "none":
        return np.empty((0, 3), dtype=np.uint64)
    rows = []
    for il in cache.layers:
        for a in (np.asarray(cache.k(il)), np.asarray(cache.v(il))):
            rows.append((a.ctypes.data, a.nbytes, 0))
    return np.array(rows, dtype=np.uint64).reshape(-1, 3)


def register_cache(agent: Any, cache: UnifiedCache) -> Any:
    """Register the cache's K/V memory with a NIXL agent (DRAM); returns the registration (for
    ``agent.deregister_memory``). The memory must stay registered while transfers use it."""
    return agent.register_memory(cache_memory(cache), "DRAM")


def descriptors(regions: object) -> npt.NDArray[np.uint64]:
    """(N, 2) regions as NIXL's (N, 3) descriptor rows (address, length, device 0)."""
    r = _regions(regions, "regions")
    return np.concatenate([r, np.zeros((len(r), 1), dtype=np.uint64)], axis=1)


def pull_sequence(agent: Any, remote: str | bytes, cache: UnifiedCache, header: Buffer, remote_regions: object,
                  seq_id: int | None = None, notif: bytes = b"kvcache-handoff", timeout: float = 60.0) -> dict[str, float]:
    """Receive a sequence: begin the import of header, READ the sender's regions (its
    SeqExport.regions, memory its agent registered) from agent `remote` into the reserved cells,
    commit. The notification `notif` reaches the sender when the bytes have arrived. On a failed
    or timed-out transfer the import is aborted (the cache as it was) and RuntimeError raised.
    Returns timings (seconds) and the bytes moved."""
    t0 = time.perf_counter()
    with cache.seq_import_begin(header, seq_id) as imp:
        src, dst = pair_regions(remote_regions, imp.regions)
        t1 = time.perf_counter()
        if len(dst):
            local_d = agent.get_xfer_descs(descriptors(dst), "DRAM")
            remote_d = agent.get_xfer_descs(descriptors(src), "DRAM")
            h = agent.initialize_xfer("READ", local_d, remote_d, remote, notif)
            try:
                state = agent.transfer(h)
                deadline = time.monotonic() + timeout
                while state == "PROC":
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"NIXL transfer of {imp.n_bytes} bytes timed out after {timeout} s")
                    state = agent.check_xfer_state(h)
                if state != "DONE":
                    raise RuntimeError(f"NIXL transfer failed: {state}")
            finally:
                agent.release_xfer_handle(h)
        elif notif:
            agent.send_notif(remote, notif)
        t2 = time.perf_counter()
        n_bytes = imp.n_bytes
        imp.commit()
    t3 = time.perf_counter()
    return {"begin": t1 - t0, "transfer": t2 - t1, "commit": t3 - t2, "bytes": float(n_bytes),
            "regions": float(len(dst))}
