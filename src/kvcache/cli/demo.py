"""``kvcache demo``: serve a toy attention model through the cache and check every step."""
from __future__ import annotations

import argparse

from kvcache.cli._argtypes import count, seed
from kvcache.cli._output import print_json

NAME = "demo"
HELP = "serve a toy attention model through UnifiedCache and ISWACache and check it against recomputation"
DESCRIPTION = """\
Serve a toy attention model (numpy; grouped-query heads with RoPE, random weights from --seed)
through kvcache.UnifiedCache with continuous batching: sequences are prefilled and decoded
together, finish (seq_rm), arrive, reuse another sequence's prompt cells (seq_cp), and the
cache is defragmented. Every step attends over the cache's own K/V and is compared with the
model recomputed from scratch. Runs once with f32 K/V and transposed V (tolerance 1e-4), then
a shorter run with f16 K/V stored as rows, then a run of the same model with a sliding window
of 8 on layer 0 (full attention on layer 1) served through kvcache.ISWACache, whose SWA cache is
pruned on every commit (tolerance 1e-4). Exit status 1 on any mismatch in any run."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.add_argument("--seed", type=seed, default=0, metavar="N",
                   help="seed of the weights and the workload (default 0)")
    p.add_argument("--steps", type=count, default=48, metavar="N",
                   help="decode steps of the main run (default 48)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")


def run(args: argparse.Namespace) -> int:
    from kvcache.demo import format_report, run_demo

    rep = run_demo(seed=args.seed, steps=args.steps)
    if args.json:
        print_json(rep.to_dict())
    else:
        print(format_report(rep))
    return 0 if rep.ok else 1
