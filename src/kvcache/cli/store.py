"""``kvcache store``: what a prefix store directory holds, its hit counters, and ``--gc`` to a
size (see kvcache.store)."""
from __future__ import annotations

import argparse
from typing import Any

from kvcache.cli._argtypes import byte_size
from kvcache.cli._output import print_json

NAME = "store"
HELP = "describe a prefix store directory (chunks, prompts, bytes, hit counters); --gc trims it"
DESCRIPTION = ("Describe a prefix store directory written by kvcache.store.PrefixStore (or the llama.cpp prompt "
               "cache): its geometry, chunk files, prompts, bytes and the hit counters its users flushed; with "
               "--gc SIZE, first remove the least recently used chunk files until it holds at most SIZE bytes.")

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", help="a store directory (it holds kvcache-store.json)")
    parser.add_argument("--gc", type=byte_size(), metavar="SIZE",
                        help="remove least recently used chunk files until the chunks take at most SIZE bytes "
                             "(500M, 2G, 0 for all)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")


def _fmt(n: int) -> str:
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div:
            return f"{n / div:.1f} {unit}"
    return f"{n} bytes"


def report(path: str, gc: int | None = None) -> dict[str, Any]:
    """The report of `kvcache store` (the --json output)."""
    from kvcache.store import open_store, read_stats

    st = open_store(path, host_bytes=0)
    removed = st.gc(gc) if gc is not None else None
    files = list(st.chunks())
    g = st.geometry
    chunks = {c.key: c.index for c in files}     # a chunk's rows and end part are two files of one chunk
    out: dict[str, Any] = {"path": path, "geometry": g.describe(), "chunk_tokens": g.chunk_tokens,
                           "chunk_bytes": g.chunk_bytes, "chunks": len(chunks),
                           "tokens": len(chunks) * g.chunk_tokens, "bytes": sum(c.bytes for c in files),
                           "prompts": sum(1 for i in chunks.values() if i == 0),
                           "end_parts": sum(1 for c in files if c.part == "end"),
                           "longest_prefix_tokens": (max((c.index for c in files), default=-1) + 1) * g.chunk_tokens}
    if removed is not None:
        out["gc_removed"] = removed
    stats = read_stats(path)
    hits = stats.get("host_hits", 0) + stats.get("disk_hits", 0)
    out["stats"] = stats
    looked = hits + stats.get("misses", 0)
    out["hit_chunks"] = hits
    out["loads"] = looked
    return out


def format_report(r: dict[str, Any]) -> str:
    lines = [f"{r['path']}: kvcache prefix store, {r['geometry']}"]
    if "gc_removed" in r:
        lines.append(f"  gc: removed {r['gc_removed']} chunk files")
    lines.append(f"  {r['chunks']} chunks ({r['tokens']} tokens) in {_fmt(r['bytes'])}, "
                 f"{r['prompts']} prompt starts, longest prefix {r['longest_prefix_tokens']} tokens")
    s = r["stats"]
    if s:
        lines.append(f"  chunks restored: {s.get('host_hits', 0)} from memory, {s.get('disk_hits', 0)} from disk; "
                     f"{s.get('misses', 0)} look-ups found nothing")
        lines.append(f"  chunks saved: {s.get('chunks_saved', 0)} ({s.get('files_written', 0)} files written), "
                     f"corrupt files removed: {s.get('corrupt_removed', 0)}, failed writes: {s.get('disk_errors', 0)}"
                     + (f", failed write-backs: {s['write_back_errors']}" if s.get("write_back_errors") else ""))
    else:
        lines.append("  no counters flushed yet")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    r = report(args.path, args.gc)
    if args.json:
        print_json(r)
    else:
        print(format_report(r))
    return 0
