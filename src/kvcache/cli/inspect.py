"""`kvcache inspect`: what a state file is and what it holds (see kvcache.inspect)."""
NAME = "inspect"
HELP = "describe a state file: blob, context state, session or sequence file"
DESCRIPTION = ("Describe a state file written by kvcache or llama.cpp: its kind (detected from the content), "
               "header fields, tokens, cells with their positions per sequence, per-layer K/V types and row "
               "sizes, byte sizes.")


def add_arguments(parser) -> None:
    from kvcache.inspect import add_arguments as add

    add(parser)


def run(args) -> int:
    from kvcache.inspect import run as run_inspect

    return run_inspect(args)
