"""``kvcache inspect``: what a state file is and what it holds (see kvcache.inspect)."""
from __future__ import annotations

import argparse
import re

from kvcache.cli._output import print_json

NAME = "inspect"
HELP = "describe a state file: blob, context state, session or sequence file"
DESCRIPTION = ("Describe a state file written by kvcache or llama.cpp: its kind (detected from the content), "
               "header fields, tokens, cells with their positions per sequence, per-layer K/V types and row "
               "sizes, byte sizes.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from kvcache.inspect import VARIANTS

    parser.add_argument("file", help="a state file: sequence or whole-cache blob, context state, session "
                                     "(ggsn) or sequence (ggsq) file")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--variant", choices=VARIANTS,
                        help="the cache variant (default: guessed); a state that cannot be one is refused")
    from kvcache import LAYOUTS

    parser.add_argument("--layout", choices=LAYOUTS,
                        help="the layout to read it in (default: found); a state not of it is refused")


def plain_error(e: Exception, path: str, size: int) -> str:
    """What went wrong reading path, in the user's terms: the kind of file and where it stops
    making sense, not the codec's arithmetic (KVCACHE_TRACEBACK=1 shows the full error)."""
    from kvcache.inspect import KINDS, NOT_A_STATE

    text = str(e)
    if text.startswith(("this is a GGUF model", "not a recurrent", "not a unified", "not an iSWA",
                        "the iSWA cache state has", "not a state of layout")) or "trailing bytes after" in text \
            or " is not layout " in text or ": kvcache reads versions " in text:
        return f"{path}: {text}"
    kind = getattr(e, "kind", None)
    at = re.search(r"(?:truncated at|after) byte (\d+)", text)
    if kind in (None, "cache"):
        return f"{path}: {NOT_A_STATE.replace(':', f' ({size} bytes):', 1)}"
    if at is None:
        return f"{path}: a damaged {KINDS[kind]} ({size} bytes): it does not read as one"
    where = int(at.group(1)) + getattr(e, "base", 0)
    # a read that needed more bytes than the file has left: the file ends too early
    if "truncated" in text:
        return f"{path}: a truncated {KINDS[kind]}: it breaks off in the part that starts at byte {where} of {size}"
    return f"{path}: a damaged {KINDS[kind]}: it does not read as one past byte {where} of {size}"


def run(args: argparse.Namespace) -> int:
    import os

    from kvcache._core import StateError
    from kvcache.inspect import format_report, report

    try:
        r = report(args.file, args.variant, args.layout)   # (an OSError names the file already)
    except StateError as e:
        if os.environ.get("KVCACHE_TRACEBACK"):
            raise
        raise StateError(plain_error(e, args.file, os.path.getsize(args.file))) from None
    if args.json:
        print_json(r)
    else:
        print(format_report(r))
    return 0
