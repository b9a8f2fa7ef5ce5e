"""``kvcache convert IN OUT --to LAYOUT``: a state file rewritten in another layout (see
kvcache.statefile.convert)."""
from __future__ import annotations

import argparse

from kvcache.cli._output import print_json

NAME = "convert"
HELP = "rewrite a state file (blob, context state, session or sequence file) in another layout"
DESCRIPTION = ("Rewrite a state file written by kvcache or llama.cpp in another layout of llama.cpp's state "
               "(2025: llama-cpp-python 0.3.10; 2026: 0.3.36; the layouts between them), without a cache: the "
               "layouts differ in their framing only. What the target layout cannot hold (the outputs of a "
               "whole-context state, the sequence-blob prefix) is left out and said.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from kvcache import LAYOUTS
    from kvcache.inspect import VARIANTS

    parser.add_argument("input", help="the state file to read")
    parser.add_argument("output", help="where to write it in the target layout")
    parser.add_argument("--to", required=True, choices=LAYOUTS, help="the target layout")
    parser.add_argument("--from", dest="source", choices=LAYOUTS,
                        help="the input's layout (default: found from the bytes)")
    parser.add_argument("--variant", choices=VARIANTS,
                        help="the cache variant, when the bytes do not say (an empty or whole bare blob)")
    parser.add_argument("--seq-id", type=int, default=None,
                        help="the sequence of a bare sequence state, for the prefix of the layouts that have one")
    parser.add_argument("--json", action="store_true", help="print what was done as JSON")


def run(args: argparse.Namespace) -> int:
    import os

    from kvcache import statefile
    from kvcache._core import StateError

    with open(args.input, "rb") as f:
        data = f.read()
    try:
        c = statefile.convert(data, args.to, layout=args.source, variant=args.variant, seq_id=args.seq_id)
    except StateError as e:
        if os.environ.get("KVCACHE_TRACEBACK"):
            raise
        raise StateError(f"{args.input}: {e}") from None
    with open(args.output, "wb") as f:
        f.write(c.data)
    if args.json:
        print_json({"input": args.input, "output": args.output, "kind": c.kind, "from": c.source, "to": c.layout,
                    "bytes": {"input": len(data), "output": len(c.data)}, "notes": list(c.notes)})
        return 0
    print(f"{args.output}: {c.kind}, layout {c.source} -> {c.layout}, {len(data)} -> {len(c.data)} bytes")
    for n in c.notes:
        print(f"  note: {n}")
    return 0
