"""``python -m kvcache_bench``: the command line's ``kvcache bench`` (kvcache.cli.bench). The
command line imports this package's cases, never the other way round: only this entry point
reaches back into kvcache.cli."""
import sys

from kvcache.cli import main

raise SystemExit(main(["bench", *sys.argv[1:]]))
