"""``kvcache convert IN OUT --to LAYOUT``: a state file rewritten in another layout (see
kvcache.convert.convert)."""
from __future__ import annotations

import argparse

from kvcache.cli._argtypes import count, whole
from kvcache.cli._output import print_json

NAME = "convert"
HELP = "rewrite a state file (blob, context state, session or sequence file) in another layout"
DESCRIPTION = ("Rewrite a state file written by kvcache or llama.cpp in another layout of llama.cpp's state "
               "(2025: llama-cpp-python 0.3.10; 2026: 0.3.36; the layouts between them), without a cache: the "
               "layouts differ in their framing only. What the target layout cannot hold (the outputs of a "
               "whole-context state, the sequence-blob prefix) is left out and said; given the window of an iSWA "
               "model (--n-swa, --swa-type), so are the SWA cells outside it of a sequence's state converted to a "
               "layout that leaves them out (2026-06 and later). A sequence blob without the prefix (0.3.10's) "
               "converted to a layout with one (2026-05 and later) gets a prefix naming --seq-id, default 0: "
               "llama.cpp refuses the blob without it and does not use the id. The output is written whole or "
               "not at all (a failed write leaves what was there), and never over the input.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from kvcache import LAYOUTS, MAX_SEQ
    from kvcache.inspect import VARIANTS

    parser.add_argument("input", help="the state file to read")
    parser.add_argument("output", help="where to write it in the target layout")
    parser.add_argument("--to", required=True, choices=LAYOUTS, help="the target layout")
    parser.add_argument("--from", dest="source", choices=LAYOUTS,
                        help="the input's layout (default: found from the bytes)")
    parser.add_argument("--variant", choices=VARIANTS,
                        help="the cache variant, when the bytes do not say (an empty or whole bare blob)")
    parser.add_argument("--seq-id", type=whole(0, MAX_SEQ - 1), default=None, metavar="N",
                        help="the sequence named in the sequence-blob prefix of the layouts that have one (2026-05 "
                             "and later), which llama.cpp reads and does not use (default: the input's prefix, "
                             "else 0)")
    parser.add_argument("--n-swa", type=count, default=None, metavar="N",
                        help="the sliding window of an iSWA model: leave out the SWA cells outside it of a "
                             "sequence's state, as the layouts from 2026-06 on do (the state does not hold it)")
    parser.add_argument("--swa-type", choices=("standard", "chunked"), default="standard",
                        help="the kind of window of --n-swa (default standard)")
    parser.add_argument("--json", action="store_true", help="print what was done as JSON")


def _plain(e: Exception, args: argparse.Namespace, data: bytes) -> str:
    """Why the input does not convert, in the user's terms: when it does not read as a state at
    all, what `kvcache inspect` says of it (the kind of file and where it breaks off); otherwise
    the conversion's own reason."""
    from kvcache._core import StateError
    from kvcache.cli.inspect import plain_error
    from kvcache.inspect import report_bytes

    try:
        report_bytes(data, args.variant, layout=args.source)
    except StateError as x:
        return plain_error(x, args.input, len(data))
    return f"{args.input}: {e}"


def run(args: argparse.Namespace) -> int:
    import os

    from kvcache._atomic import atomic_write, check_target, read_regular
    from kvcache._core import StateError
    from kvcache.convert import convert

    sources = {f"the input {args.input}": args.input}
    check_target(args.output, sources=sources)   # before the work: a bad output fails at once
    data = read_regular(args.input)
    try:
        # a bare sequence state without a prefix gets one naming seq 0: today's llama.cpp refuses a
        # sequence blob without it, and does not use the id
        c = convert(data, args.to, layout=args.source, variant=args.variant, seq_id=args.seq_id,
                    n_swa=args.n_swa, swa_type=args.swa_type, default_seq_id=0)
    except StateError as e:
        if os.environ.get("KVCACHE_TRACEBACK"):
            raise
        raise StateError(_plain(e, args, data)) from None
    with atomic_write(args.output, sources=sources) as f:
        f.write(c.data)
    if args.json:
        print_json({"input": args.input, "output": args.output, "kind": c.kind, "from": c.source, "to": c.layout,
                    "bytes": {"input": len(data), "output": len(c.data)}, "notes": list(c.notes)})
        return 0
    print(f"{args.output}: {c.kind}, layout {c.source} -> {c.layout}, {len(data)} -> {len(c.data)} bytes")
    for n in c.notes:
        print(f"  note: {n}")
    return 0
