"""`kvcache bench`: kvcache's C core against the seed-loop baseline, side by side."""
NAME = "bench"
HELP = "measure kvcache against a transcription of llama.cpp's loops (one process)"


def add_arguments(parser) -> None:
    from kvcache.bench import CASES

    parser.add_argument("--quick", action="store_true", help="small sizes and few repetitions (a smoke run)")
    parser.add_argument("--json", metavar="FILE", help="also write the report as JSON")
    parser.add_argument("--case", action="append", choices=list(CASES), help="run only these cases (repeatable)")


def run(args) -> int:
    from kvcache.bench import main

    argv = (["--quick"] if args.quick else []) + (["--json", args.json] if args.json else [])
    for c in args.case or []:
        argv += ["--case", c]
    return main(argv)
