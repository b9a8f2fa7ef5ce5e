"""``kvcache bench``: kvcache's C core against the seed-loop baseline, side by side."""
from __future__ import annotations

import argparse
import sys

from kvcache.cli._output import json_text, progress_wanted

NAME = "bench"
HELP = "measure kvcache against a transcription of llama.cpp's loops (one process)"
DESCRIPTION = """\
Time kvcache's C core and a baseline (a C++ transcription of llama.cpp's own loops and containers)
on the same workloads in one process, checking that they agree: find_slot, KQ masks, defrag plans
and moves, state I/O, calls through the cimport API. Needs the benchmark extension kvcache._bench,
which the kvcache wheel leaves out (`pip install ./benchmarks` from a clone builds it).

columns:
  kvcache       median time per operation over the repetitions (min-max in brackets)
  baseline      the baseline's median; baseline/kvcache: how many times faster kvcache is
  GB/s          kvcache's bandwidth where data moves (mask bytes written, bytes moved or serialized)
  ref GB/s      the bandwidth of the yardstick: memset of the mask's bytes, memcpy of the moved or
                serialized bytes, timed right after the operation in each repetition
  kvcache/ref   kvcache's time over the yardstick's (median of the paired ratios): 1.0 = as fast
                as memset/memcpy of the same bytes, lower is better"""

LEGEND = ("ref GB/s: memset/memcpy of the same bytes (the yardstick); kvcache/ref: kvcache's time over the "
          "yardstick's, 1.0 = as fast as memcpy, lower is better; baseline/kvcache: higher is better")

MISSING = ("the benchmark extension kvcache._bench is not installed (the kvcache wheel leaves it out): from a "
           "clone of kvcache, `pip install ./benchmarks` builds it (see benchmarks/README.md)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from kvcache.bench import CASES

    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--quick", action="store_true", help="small sizes and few repetitions (a smoke run)")
    parser.add_argument("--json", metavar="FILE", help="also write the report as JSON")
    parser.add_argument("--case", action="append", choices=list(CASES), help="run only these cases (repeatable)")
    parser.add_argument("--progress", action="store_true",
                        help="say which case runs (on stderr), also when stderr is not a terminal")


def _check_output(path: str) -> None:
    """Fail before a run of minutes when its report could not be written."""
    import os

    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise IsADirectoryError(f"--json {path}: is a directory")
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"--json {path}: no such directory: {folder}")
    if not os.access(folder, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise PermissionError(f"--json {path}: not writable")


def run(args: argparse.Namespace) -> int:
    import importlib

    from kvcache.bench import format_table, run as run_bench

    if args.json:
        _check_output(args.json)
    try:
        importlib.import_module("kvcache._bench")
    except ImportError:
        print(f"{args._prog}: error: {MISSING}", file=sys.stderr)
        return 2
    progress = None
    if progress_wanted(args.progress):
        def progress(name: str) -> None:
            print(f"bench: running {name} ...", file=sys.stderr, flush=True)
    report = run_bench(args.quick, args.case, progress=progress)
    print(format_table(report))
    print()
    print(LEGEND)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            f.write(json_text(report) + "\n")
    return 0
