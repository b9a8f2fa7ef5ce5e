"""``kvcache simulate``: a continuous-batching workload on a chosen cache geometry."""
from __future__ import annotations

import argparse
import sys
from typing import Any

from kvcache.cli._argtypes import count, nonneg_int, number, real, seed, whole
from kvcache.cli._output import print_json, progress_wanted

NAME = "simulate"
HELP = "run a continuous-batching workload through UnifiedCache and report its bookkeeping"
DESCRIPTION = """\
Play an inference server on a kvcache.UnifiedCache: requests arrive (Poisson per step) with prompt
and output lengths drawn from a seeded distribution; a share of them reuse a shared system prompt
(seq_cp from the sequence holding it); every step places one ubatch of at most --n-ubatch tokens
(a decode token per generating request, then prompt chunks) with find_slot, commits it, and removes
finished requests (seq_rm); the cache is defragmented past a fragmentation threshold. K/V rows are
tiny and never written: the cache's bookkeeping is what runs and is measured.

When find_slot finds no room: defragment and retry if enough cells are free, else cut the prompt
chunks to the free cells, else evict the most recently admitted request (it waits again and is
recomputed). Every failure is counted with its remedy.

The report: requests served, tokens placed per second of kvcache calls, find_slot calls per
second, occupancy and fragmentation (mean, max), defrags and cells moved, find_slot failures, and
an accounting check (cells used == shared prefix + the live requests' cells, every step; exit
status 1 if it ever fails). Same --seed, same report (timings aside).

--workload chat and --workload system run on today's cache (semantics 2026) with prefix reuse:
requests carry token ids, a finished request hands its cells to the cache's prefix index
(prefix_release) and a new one attaches the longest prefix the index holds (prefix_attach),
computing only the rest; placement evicts held cells, least recently used first, when it needs
room. chat: conversations arrive at --arrival-rate, each of --turns turns (mean); a turn's prompt
is the conversation so far (every earlier message and answer) and a new message of --prompt-mean
tokens (mean); the next turn arrives --think-steps steps (mean) after the answer. system: the
requests of the random workload, --prefix-share of them starting with one --prefix-len-token system
prompt. The report adds the prompt tokens reused (hit rate), the index's evictions, and the same
requests played without reuse for comparison (--no-reuse plays only that).

--defrag modes: sched = llama.cpp's defrag_sched + update() (which ignores caches under 2048
cells); direct = the same fragmentation formula without that rule, then defrag_prepare/defrag_move;
off = never (find_slot failures still defragment)."""

_PROGRESS = ("auto", "tqdm", "rich", "plain", "none")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from kvcache import MAX_SEQ
    from kvcache.plan import MAX_LAYERS
    from kvcache.simulate import DEFRAG_MODES, LENGTH_DISTS, SEMANTICS, WORKLOADS, SimConfig

    d = SimConfig()
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    g = p.add_argument_group("geometry")
    # (a size padded to 256 stays an int32)
    g.add_argument("--n-ctx", "--ctx", type=whole(1, 2**31 - 256), default=d.n_ctx, metavar="N",
                   help=f"cells, padded to n_pad (default {d.n_ctx})")
    g.add_argument("--n-seq-max", "--parallel", type=whole(1, MAX_SEQ), default=d.n_seq_max, metavar="N",
                   help=f"sequence slots; with prefix sharing one holds the prefix (default {d.n_seq_max})")
    g.add_argument("--n-layer", type=whole(1, MAX_LAYERS), default=d.n_layer, metavar="N",
                   help=f"layers (default {d.n_layer})")
    g.add_argument("--n-embd", type=count, default=d.n_embd, metavar="N",
                   help=f"K and V row width; small keeps the data negligible (default {d.n_embd})")
    g.add_argument("--type-k", default=d.type_k, metavar="TYPE", help=f"K type (default {d.type_k})")
    g.add_argument("--type-v", default=d.type_v, metavar="TYPE", help=f"V type (default {d.type_v})")
    g.add_argument("--flash-attn", "-fa", action="store_true", help="n_pad 256 and V in rows (else 32, transposed)")
    w = p.add_argument_group("workload")
    w.add_argument("--workload", choices=WORKLOADS, default=d.workload,
                   help="random: independent requests, a share copying a shared prefix with seq_cp; chat: multi-turn "
                        "conversations; system: requests with a shared system prompt (chat and system reuse "
                        f"prefixes through the cache's prefix index) (default {d.workload})")
    w.add_argument("--turns", type=count, default=d.turns, metavar="N",
                   help=f"chat: mean turns of a conversation (default {d.turns})")
    w.add_argument("--think-steps", type=nonneg_int, default=d.think_steps, metavar="N",
                   help=f"chat: mean steps from an answer to the next turn (default {d.think_steps})")
    w.add_argument("--no-reuse", dest="reuse", action="store_false",
                   help="chat, system: play the workload without prefix reuse only (no comparison)")
    w.add_argument("--steps", type=count, default=d.steps, metavar="N", help=f"steps to run (default {d.steps})")
    w.add_argument("--arrival-rate", type=real(0), default=d.arrival_rate, metavar="R",
                   help=f"mean new requests per step (Poisson; default {d.arrival_rate})")
    w.add_argument("--dist", choices=LENGTH_DISTS, default=d.dist,
                   help=f"length distribution, with the means below (default {d.dist})")
    w.add_argument("--prompt-mean", type=count, default=d.prompt_mean, metavar="N",
                   help=f"mean prompt length (default {d.prompt_mean})")
    w.add_argument("--output-mean", type=count, default=d.output_mean, metavar="N",
                   help=f"mean output length (default {d.output_mean})")
    w.add_argument("--prefix-share", type=real(0, 1), default=d.prefix_share, metavar="F",
                   help=f"share of requests starting with the shared prefix (default {d.prefix_share})")
    w.add_argument("--prefix-len", type=nonneg_int, default=d.prefix_len, metavar="N",
                   help=f"tokens of the shared prefix; 0: no sharing (default {d.prefix_len})")
    w.add_argument("--n-ubatch", type=count, default=d.n_ubatch, metavar="N",
                   help=f"token budget of a step (default {d.n_ubatch})")
    w.add_argument("--defrag", choices=DEFRAG_MODES, default=d.defrag, help=f"defrag policy (default {d.defrag})")
    w.add_argument("--defrag-thold", type=number, default=d.defrag_thold, metavar="F",
                   help=f"fragmentation that triggers a defrag; < 0: never (default {d.defrag_thold})")
    w.add_argument("--mask", action="store_true", help="also build the KQ mask of every ubatch")
    w.add_argument("--semantics", choices=SEMANTICS, default=None,
                   help="the cache's semantics: 2025 (llama.cpp as of mid-2025, llama-cpp-python 0.3.10: contiguous "
                        "placement, commit, defrag) or 2026 (today's llama.cpp: scattered placement, no defrag, "
                        "n_pad 1, n_ctx padded to 256; --defrag is ignored) (default 2025; 2026 for the chat and "
                        "system workloads, which need it)")
    w.add_argument("--seed", type=seed, default=d.seed, metavar="N", help=f"workload seed (default {d.seed})")
    o = p.add_argument_group("output")
    o.add_argument("--json", action="store_true", help="print the report as JSON")
    o.add_argument("--series", action="store_true", help="with --json: include the per-step series")
    o.add_argument("--plot", metavar="FILE.png", help="draw occupancy and fragmentation over time (matplotlib; "
                   "the format from the extension: .png, .svg, .pdf, ...)")
    o.add_argument("--progress", choices=_PROGRESS, default="auto",
                   help="progress display on stderr: auto = tqdm, else rich, else a plain line, and only when "
                        "stderr is a terminal and the output is not --json; tqdm, rich or plain: that display "
                        "in any case; none: never (default auto)")


def _config(args):
    from kvcache.simulate import SimConfig

    cfg = SimConfig(n_ctx=args.n_ctx, n_seq_max=args.n_seq_max, n_layer=args.n_layer, n_embd=args.n_embd,
                    type_k=args.type_k, type_v=args.type_v, flash_attn=args.flash_attn, steps=args.steps,
                    arrival_rate=args.arrival_rate, dist=args.dist, prompt_mean=args.prompt_mean,
                    output_mean=args.output_mean, prefix_share=args.prefix_share, prefix_len=args.prefix_len,
                    n_ubatch=args.n_ubatch, defrag=args.defrag, defrag_thold=args.defrag_thold, mask=args.mask,
                    seed=args.seed, semantics=args.semantics or "", workload=args.workload, turns=args.turns,
                    think_steps=args.think_steps, reuse=args.reuse)
    cfg.check()
    return cfg


def _check_plot(path: str) -> None:
    from kvcache._atomic import check_target

    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ValueError("--plot needs matplotlib, which is not installed (pip install 'kvcache[plot]')") from None
    from kvcache.simulate import plot_format

    plot_format(path)
    check_target(path, label=f"--plot {path}")


class _Progress:
    """A progress display on stderr: tqdm, rich, or a plain line every tenth of the run."""

    def __init__(self, kind: str, total: int):
        self.total = total
        self.kind = kind
        self.bar: Any = None
        if kind == "auto":
            self.kind = "plain"
            for k in ("tqdm", "rich"):
                if _importable(k):
                    self.kind = k
                    break
        elif kind in ("tqdm", "rich") and not _importable(kind):
            raise ValueError(f"--progress {kind}: {kind} is not installed (pip install 'kvcache[cli]' for tqdm)")
        if self.kind == "tqdm":
            from tqdm import tqdm  # type: ignore[import-untyped,unused-ignore]
            self.bar = tqdm(total=total, desc="simulate", unit="step", file=sys.stderr, leave=False,
                            mininterval=0.2)
        elif self.kind == "rich":
            # rich is optional (not in the test extra): mypy may not find it
            from rich.console import Console  # type: ignore[import-not-found,unused-ignore]
            from rich.progress import Progress  # type: ignore[import-not-found,unused-ignore]
            self.bar = Progress(console=Console(file=sys.stderr), transient=True)
            self.bar.start()
            self.task = self.bar.add_task("simulate", total=total)
        self.every = max(1, total // 10)
        self.last = 0

    def __call__(self, step: int, rep) -> None:
        if self.kind == "tqdm":
            self.bar.update(step - self.last)
            if step % 50 == 0 or step == self.total:
                self.bar.set_postfix(used=f"{rep.series['occupancy'][-1]:.0%}", served=rep.served, refresh=False)
        elif self.kind == "rich":
            self.bar.update(self.task, completed=step)
        elif self.kind == "plain" and (step % self.every == 0 or step == self.total):
            s = rep.series
            print(f"simulate: step {step}/{self.total}  occupancy {s['occupancy'][-1]:.0%}  "
                  f"fragmentation {s['fragmentation'][-1]:.3f}  running {s['running'][-1]}  "
                  f"waiting {s['waiting'][-1]}  served {rep.served}", file=sys.stderr, flush=True)
        self.last = step

    def close(self) -> None:
        if self.kind == "tqdm":
            self.bar.close()
        elif self.kind == "rich":
            self.bar.stop()


def _importable(name: str) -> bool:
    try:
        __import__(name)
    except ImportError:
        return False
    return True


def _check_memory(cfg) -> None:
    """Refuse a geometry whose K/V would not fit in this machine's memory, naming the options
    (the cache allocates them before the first step)."""
    import os

    from kvcache._core import ggml_row_size

    need = cfg.n_ctx * cfg.n_layer * (ggml_row_size(cfg.type_k, cfg.n_embd) + ggml_row_size(cfg.type_v, cfg.n_embd))
    try:
        have = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return
    if need > have:
        raise ValueError(f"--n-ctx {cfg.n_ctx} x --n-layer {cfg.n_layer} x --n-embd {cfg.n_embd} need "
                         f"{need / 2**30:.1f} GiB of K/V, more than this machine's {have / 2**30:.1f} GiB")


def run(args: argparse.Namespace) -> int:
    from kvcache.simulate import format_report, plot_report, simulate

    if args.series and not args.json:
        raise ValueError("--series goes with --json")
    cfg = _config(args)
    _check_memory(cfg)
    if args.plot:
        _check_plot(args.plot)
    shown = args.progress != "none" and progress_wanted(args.progress != "auto") and \
        (args.progress != "auto" or not args.json)
    progress = _Progress(args.progress, cfg.steps * cfg.runs) if shown else None
    try:
        rep = simulate(cfg, progress)
    finally:
        if progress is not None:
            progress.close()
    if args.plot:
        plot_report(rep, args.plot)
    if args.json:
        print_json(rep.to_dict(series=args.series))
    else:
        print(format_report(rep))
        if args.plot:
            print(f"plot: {args.plot}")
    return 0 if rep.accounting["ok"] else 1
