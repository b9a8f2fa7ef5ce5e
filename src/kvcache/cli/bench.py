"""``kvcache bench``: kvcache's C core against a transcription of llama.cpp's loops, side by side."""
from __future__ import annotations

import argparse
import sys

from kvcache.cli._output import json_text, progress_wanted

NAME = "bench"
HELP = "measure kvcache against a transcription of llama.cpp's loops (one process)"
DESCRIPTION = """\
Time kvcache's C core and a baseline (a C++ transcription of llama.cpp's own loops and containers)
on the same workloads in one process, checking that they agree: find_slot, KQ masks, defrag plans
and moves, state I/O, calls through the cimport API. Needs the cases, the package kvcache_bench,
which the kvcache wheel leaves out (`pip install ./benchmarks` from a clone installs it). It
reports measurements and ratios; benchmarks/README.md says what they are held to.

columns:
  kvcache            median time per operation over the repetitions (min-max in brackets)
  baseline           the baseline's median; baseline/kvcache: how many times faster kvcache is
                     (the median of the ratios paired per repetition)
  GB/s               kvcache's bandwidth where data moves (mask bytes written, bytes moved or
                     serialized)
  yardstick          what kvcache is held to: memset of the mask's bytes (a streaming memset,
                     non-temporal stores, where kvcache streams), a copy of the moved bytes on
                     the moves' threads, memcpy of the serialized bytes, a step's floor, ...;
                     timed right after the operation in each repetition
  yardstick GB/s     the yardstick's bandwidth
  kvcache/yardstick  kvcache's time over the yardstick's (median of the paired ratios): 1.0 = as
                     fast as the yardstick, lower is better"""

LEGEND = ("yardstick: what kvcache is held to, timed in the same repetitions; kvcache/yardstick: kvcache's time "
          "over the yardstick's, 1.0 = as fast, lower is better; baseline/kvcache: higher is better")

MISSING = ("the benchmark cases (package kvcache_bench) are not installed: the kvcache wheel leaves them out; "
           "from a clone of kvcache, `pip install ./benchmarks` installs them (see benchmarks/README.md)")


def _bench(module: str = "kvcache_bench"):
    """A module of kvcache-bench, a distribution of its own: imported by name (ImportError where
    it is not installed), so that kvcache's type checks do not need it."""
    import importlib

    return importlib.import_module(module)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    try:
        cases = list(_bench().CASES)
    except ImportError:   # run() says how to install it; until then any case name parses
        cases = None

    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--quick", action="store_true", help="small sizes and few repetitions (a smoke run)")
    parser.add_argument("--json", metavar="FILE", help="also write the report as JSON")
    parser.add_argument("--case", action="append", choices=cases, help="run only these cases (repeatable)")
    parser.add_argument("--plot", metavar="FILE",
                        help="draw the scale case's curves (cost per operation against cells) into FILE (PNG), "
                             "when matplotlib is installed")
    parser.add_argument("--progress", action="store_true",
                        help="say which case runs (on stderr), also when stderr is not a terminal")


def run(args: argparse.Namespace) -> int:
    from kvcache._atomic import atomic_write, check_target

    # a run takes minutes: an output that could not be written fails before it
    if args.json:
        check_target(args.json, label=f"--json {args.json}")
    if args.plot:
        check_target(args.plot, sources={f"the file of --json {args.json}": args.json} if args.json else None,
                     label=f"--plot {args.plot}")
        if args.case and "scale" not in args.case:
            print(f"{args._prog}: error: --plot draws the scale case: add --case scale", file=sys.stderr)
            return 2
    try:
        _bench("kvcache_bench._bench")   # every case's workloads, built with the package
        bench = _bench()
    except ImportError:
        print(f"{args._prog}: error: {MISSING}", file=sys.stderr)
        return 2
    progress = None
    if progress_wanted(args.progress):
        def progress(name: str) -> None:
            print(f"bench: running {name} ...", file=sys.stderr, flush=True)
    report = bench.run(args.quick, args.case, progress=progress)
    print(bench.format_table(report))
    print()
    print(LEGEND)
    if args.json:
        with atomic_write(args.json, "w", encoding="utf-8", label=f"--json {args.json}") as f:
            f.write(json_text(report) + "\n")
    if args.plot:
        if not _bench("kvcache_bench.case_step").plot_scale(report, args.plot):
            print(f"{args._prog}: --plot {args.plot}: nothing drawn (matplotlib is not installed)", file=sys.stderr)
    return 0
