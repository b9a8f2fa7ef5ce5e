"""The ``kvcache`` command line.

Each subcommand lives in its own module ``kvcache.cli.<name>`` (the modules of this package whose
names do not start with an underscore), found at start-up, which defines:

- ``NAME``: the subcommand (``kvcache NAME ...``);
- ``HELP``: one line for ``kvcache --help``;
- ``add_arguments(parser)``: its options, on an ``argparse`` subparser;
- ``run(args) -> int``: do the work and return the exit status.

Such a module should import heavy dependencies inside ``run`` so that ``kvcache --help`` stays
cheap. Exit status: 0 success, 1 when the command ran and found a problem (e.g. a mismatch),
2 for a usage or runtime error, which is reported in one line without a traceback (set the
environment variable ``KVCACHE_TRACEBACK=1`` to see it) and names the subcommand. Output
follows ``kvcache.cli._output``: one JSON format for every ``--json``, progress on stderr only
where a person watches (a terminal) unless asked for. ``kvcache.cli._argtypes`` holds the
argument types the commands share.
"""
from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import re
import sys

__all__ = ["main", "build_parser", "commands"]


class _Parser(argparse.ArgumentParser):
    """argparse with one-line usage errors."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def commands() -> dict:
    """The subcommand modules, by name, in alphabetical order."""
    found = {}
    for info in pkgutil.iter_modules(__path__):
        if not info.name.startswith("_"):
            mod = importlib.import_module(f"{__name__}.{info.name}")
            found[mod.NAME] = mod
    return dict(sorted(found.items()))


def build_parser() -> argparse.ArgumentParser:
    """The full parser: ``kvcache`` and every subcommand."""
    import kvcache
    parser = _Parser(prog="kvcache",
                     description="llama.cpp's KV-cache manager for Python inference servers.")
    parser.add_argument("--version", action="version", version=f"kvcache {kvcache.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name, mod in commands().items():
        p = sub.add_parser(name, help=mod.HELP, description=getattr(mod, "DESCRIPTION", mod.HELP))
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run, _prog=p.prog, _parser=p)
    return parser


def main(argv=None) -> int:
    """Run ``kvcache`` with ``argv`` (default: ``sys.argv[1:]``); returns the exit status."""
    try:
        parser = build_parser()
    except Exception as e:   # a subcommand module that fails to import
        return _fail("kvcache", e)
    try:
        args, extra = parser.parse_known_args(argv)
        if extra:
            # the subcommand's parser reports them, so that the error names the subcommand
            (getattr(args, "_parser", None) or parser).error(f"unrecognized arguments: {' '.join(extra)}")
    except SystemExit as e:  # --help, --version and usage errors
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    if args.command is None:
        names = ", ".join(commands())
        print(f"kvcache: error: a command is required ({names})", file=sys.stderr)
        return 2
    try:
        return int(args._run(args))
    except KeyboardInterrupt:
        print(f"{args._prog}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # the reader went away (e.g. `| head`): nothing more to say
        _silence_stdout()
        return 0
    except Exception as e:
        return _fail(args._prog, e, args._parser)


def _in_flags(msg: str, parser: argparse.ArgumentParser) -> str:
    """An error of the Python API in the command line's words: each keyword of the message that
    is one of the command's flags (``n_embd``, ``type_k = 'q7'``) named as that flag (``--n-embd``,
    ``--type-k 'q7'``). Only keywords with an underscore: a plain word (``steps``, ``mask``) may be
    just a word."""
    for action in parser._actions:
        dest, flags = action.dest, [f for f in action.option_strings if f.startswith("--")]
        if "_" not in dest or not flags:
            continue
        flag = next((f for f in flags if f == "--" + dest.replace("_", "-")), flags[0])
        msg = re.sub(rf"(?<![\w.-]){re.escape(dest)}(?!\w)(?: = )?",
                     lambda m: flag + (" " if m.group(0) != dest else ""), msg)
    return msg


def _fail(prog: str, e: BaseException, parser: argparse.ArgumentParser | None = None) -> int:
    if os.environ.get("KVCACHE_TRACEBACK"):
        raise e
    msg = str(e) or type(e).__name__
    if parser is not None:
        msg = _in_flags(msg, parser)
    if not isinstance(e, (ValueError, TypeError, IndexError, KeyError, OSError)):
        msg = f"{type(e).__name__}: {msg}"
    first = msg.splitlines()[0] if msg.splitlines() else msg
    print(f"{prog}: error: {first}", file=sys.stderr)
    return 2


def _silence_stdout():
    # Python would report the broken pipe again when flushing stdout at exit
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass
