"""``kvcache plan``: the memory and geometry of a cache, worked out before creating it."""
from __future__ import annotations

import argparse

from kvcache.cli._argtypes import count, nonneg_int, whole, wholes
from kvcache.cli._output import print_json

NAME = "plan"
HELP = "the memory a KV cache will take (per cache, per layer, in total) and what llama.cpp logs for it"
DESCRIPTION = """\
Work out a KV cache's geometry and memory before creating it, as llama.cpp sizes it:
kv_size = pad(n_ctx, n_pad) with n_pad 256 under flash attention (V stored in rows) and 32
without (V stored transposed). With --swa-layers (or --swa-pattern) the cache is an iSWA pair:
the SWA cache gets min(kv_size, pad(n_swa*n_seq_max + n_batch, n_pad)) cells, or kv_size with
--swa-full. With --recurrent it is a recurrent cache of max(1, n_seq_max) cells whose rows hold
the states (--n-embd-k-s, --n-embd-v-s).

Prints every layer's K/V type, row bytes (per cell) and tensor bytes, the totals, and the lines
llama.cpp logs when it creates the same cache ("KV buffer size", "size = ...").

examples:
  kvcache plan --n-layer 32 --n-embd-k-gqa 1024 --n-ctx 8192 --n-seq-max 4 --flash-attn
  kvcache plan --n-layer 26 --n-embd-k-gqa 1024 --swa-pattern 2 --n-swa 4096 --n-ctx 32768
  kvcache plan --recurrent --n-layer 64 --n-embd-k-s 15360 --n-embd-v-s 81920 --n-seq-max 8"""


def _layer_list(text: str) -> list:
    """Layer indices: a comma list of indices and ranges (0,2,4-7)."""
    from kvcache.plan import MAX_LAYERS

    out: list[int] = []
    try:
        for part in text.split(","):
            if "-" in part.strip()[1:]:
                a, b = part.split("-", 1)
                lo, hi = int(a), int(b)
                if hi < lo:
                    raise ValueError
                if hi >= MAX_LAYERS:   # (refused before the range is made)
                    raise argparse.ArgumentTypeError(f"layer {hi} is past the most layers a model has ({MAX_LAYERS})")
                out.extend(range(lo, hi + 1))
            else:
                out.append(int(part))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected layer indices such as 0,2,4-7, got {text!r}") from None
    for v in out:
        nonneg_int(str(v))
    return out


#: row widths: one, or a comma list with one per layer
_widths = wholes(0)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from kvcache import MAX_SEQ
    from kvcache.plan import SEMANTICS

    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.add_argument("model", nargs="?", metavar="MODEL.gguf", help="a GGUF model to read the geometry from "
                   "(the same as --gguf)")
    p.add_argument("--gguf", metavar="MODEL", help="read the geometry from a GGUF model")
    g = p.add_argument_group("geometry")
    g.add_argument("--n-layer", type=count, metavar="N", help="model layers")
    g.add_argument("--n-embd-k-gqa", type=_widths, metavar="W[,W...]",
                   help="K row width in elements (n_head_kv * head_dim_k): one, or one per layer")
    g.add_argument("--n-embd-v-gqa", type=_widths, metavar="W[,W...]", help="V row width (default: K's)")
    c = p.add_argument_group("context")
    c.add_argument("--n-ctx", "--ctx", type=count, metavar="N",
                   help="context size in tokens (default: a GGUF model's trained context, else 4096)")
    c.add_argument("--n-seq-max", "--parallel", type=whole(1, MAX_SEQ), default=1, metavar="N",
                   help="parallel sequences (default 1)")
    c.add_argument("--type-k", metavar="TYPE", help="K type: f32, f16, bf16, q8_0, q4_0, ... (default f16; "
                   "f32 for --recurrent)")
    c.add_argument("--type-v", metavar="TYPE", help="V type (default as --type-k's default); a block type "
                   "needs --flash-attn")
    c.add_argument("--flash-attn", "-fa", action="store_true",
                   help="flash attention: n_pad 256 and V in rows (else n_pad 32 and V transposed)")
    c.add_argument("--semantics", choices=SEMANTICS, default="2025",
                   help="the llama.cpp the plan follows: 2025 (llama.cpp as of mid-2025, llama-cpp-python 0.3.10; the "
                        "default) or 2026 (today's: n_pad 1, n_ctx padded to 256, flash attention auto so V in "
                        "rows, and a stream of PAD_256(n_ctx / n_seq_max) cells per sequence unless --kv-unified; "
                        "an iSWA pair's SWA cache padded to 256 cells and full-size by default)")
    c.add_argument("--kv-unified", action="store_true",
                   help="with --semantics 2026: one stream for every sequence (llama.cpp's kv_unified)")
    s = p.add_argument_group("sliding window (iSWA)")
    s.add_argument("--swa-layers", type=_layer_list, metavar="LIST", help="the sliding-window layers (0,2,4-7)")
    s.add_argument("--swa-pattern", type=count, metavar="N",
                   help="every N-th layer is full attention, the others sliding-window")
    s.add_argument("--n-swa", type=count, metavar="N", help="window size in tokens")
    s.add_argument("--swa-type", choices=("standard", "chunked"), help="window kind (default standard)")
    s.add_argument("--n-batch", type=count, metavar="N", help="logical batch size (default 2048)")
    s.add_argument("--n-ubatch", type=count, metavar="N",
                   help="with --semantics 2026: physical batch size (default 512), what sizes the SWA cache")
    s.add_argument("--swa-full", action=argparse.BooleanOptionalAction, default=None,
                   help="a full-size SWA cache (kv_size cells; the default of --semantics 2026, "
                        "--no-swa-full to size it by the window)")
    r = p.add_argument_group("recurrent")
    r.add_argument("--recurrent", action="store_true", help="a recurrent cache (Mamba, RWKV)")
    r.add_argument("--n-embd-k-s", type=_widths, metavar="W[,W...]",
                   help="rolling-state width per layer, e.g. (d_conv - 1) * d_inner")
    r.add_argument("--n-embd-v-s", type=_widths, metavar="W[,W...]",
                   help="recurrent-state width per layer, e.g. d_state * d_inner")
    h = p.add_argument_group("hybrid (from a GGUF model)")
    h.add_argument("--n-rs-seq", type=whole(0, 64), default=0, metavar="N",
                   help="rollback snapshots per recurrent state, for the architectures llama.cpp allows them "
                        "(LFM2, Nemotron-H; 0 for the others, as llama.cpp sets it)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")


_SWA_OPTS = ("n_swa", "swa_type", "n_batch", "n_ubatch")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _semantics(args: argparse.Namespace) -> dict:
    """The semantics arguments of plan_unified (today's: flash attention auto, V in rows)."""
    if args.semantics == "2025":
        if args.kv_unified:
            raise ValueError("--kv-unified needs --semantics 2026 (the 2025 cache is always unified)")
        return {}
    return {"semantics": "2026", "kv_unified": bool(args.kv_unified), "flash_attn": True}


def _no_semantics(args: argparse.Namespace, what: str) -> None:
    if args.semantics != "2025" or args.kv_unified:
        raise ValueError(f"--semantics 2026 plans unified caches and iSWA pairs, not {what}")


def _iswa_batch(args: argparse.Namespace, n_ctx: int) -> dict:
    """The batch arguments of plan_iswa: the 2025 SWA cache is sized by n_batch, today's by
    n_ubatch; llama.cpp caps n_batch at the context (a causal model) and n_ubatch at n_batch."""
    n_batch = min(n_ctx, args.n_batch or 2048)
    if args.semantics == "2025":
        if args.n_ubatch is not None:
            raise ValueError("--n-ubatch needs --semantics 2026 (the 2025 semantics size the SWA cache by --n-batch)")
        return {"n_batch": n_batch}
    return {"n_batch": min(n_batch, args.n_ubatch or 512)}


def build_plan(args: argparse.Namespace, warn=None):
    """The Plan the parsed arguments describe (ValueError on a contradiction); warn(text) is told
    what is allowed but probably not meant."""
    from kvcache.plan import plan_iswa, plan_recurrent, plan_unified, swa_pattern_layers

    model = args.gguf or args.model
    if args.gguf and args.model:
        raise ValueError("give the model once: MODEL.gguf or --gguf MODEL")
    if model is not None:
        return _plan_from_gguf(model, args, warn or (lambda text: None))
    if args.n_layer is None:
        raise ValueError("--n-layer is required (or a GGUF model)")
    if args.recurrent:
        _no_semantics(args, "a recurrent cache")
        for name in ("swa_layers", "swa_pattern", *_SWA_OPTS):
            if getattr(args, name) is not None:
                raise ValueError(f"{_flag(name)} does not apply to --recurrent")
        if args.swa_full is not None or args.flash_attn:
            raise ValueError(f"{'--swa-full' if args.flash_attn is False else '--flash-attn'} does not apply to "
                             f"--recurrent")
        if args.n_embd_k_s is None or args.n_embd_v_s is None:
            raise ValueError("--recurrent needs --n-embd-k-s and --n-embd-v-s (the state widths)")
        wk = args.n_embd_k_gqa if args.n_embd_k_gqa is not None else 0
        wv = args.n_embd_v_gqa if args.n_embd_v_gqa is not None else wk
        return plan_recurrent(args.n_layer, args.n_embd_k_s, args.n_embd_v_s, args.n_seq_max,
                              n_embd_k_gqa=wk, n_embd_v_gqa=wv, type_k=args.type_k or "f32",
                              type_v=args.type_v or args.type_k or "f32", n_ctx=args.n_ctx)
    for name in ("n_embd_k_s", "n_embd_v_s"):
        if getattr(args, name) is not None:
            raise ValueError(f"{_flag(name)} needs --recurrent")
    if args.n_embd_k_gqa is None:
        raise ValueError("--n-embd-k-gqa is required (K row width: n_head_kv * head_dim)")
    common = dict(n_ctx=args.n_ctx or 4096, n_layer=args.n_layer, n_embd_k_gqa=args.n_embd_k_gqa,
                  n_embd_v_gqa=args.n_embd_v_gqa, n_seq_max=args.n_seq_max, type_k=args.type_k or "f16",
                  type_v=args.type_v or "f16", flash_attn=args.flash_attn)
    if args.swa_layers is not None and args.swa_pattern is not None:
        raise ValueError("give the sliding-window layers once: --swa-layers or --swa-pattern")
    swa = args.swa_layers
    if args.swa_pattern is not None:
        swa = swa_pattern_layers(args.n_layer, args.swa_pattern)
    if swa is None:
        for name in _SWA_OPTS:
            if getattr(args, name) is not None:
                raise ValueError(f"{_flag(name)} needs --swa-layers or --swa-pattern")
        if args.swa_full is not None:
            raise ValueError("--swa-full needs --swa-layers or --swa-pattern")
        return plan_unified(**{**common, **_semantics(args)})
    bad = [il for il in swa if il >= args.n_layer]
    if bad:
        raise ValueError(f"--swa-layers: layer {bad[0]} is outside [0, {args.n_layer})")
    if args.n_swa is None:
        raise ValueError("an iSWA cache needs --n-swa (the window size)")
    return plan_iswa(**{**common, **_semantics(args)}, swa_layers=swa, n_swa=args.n_swa,
                     swa_type=args.swa_type or "standard", swa_full=args.swa_full,
                     **_iswa_batch(args, common["n_ctx"]))


def _plan_from_gguf(path: str, args: argparse.Namespace, warn):
    """The plan of the cache llama.cpp creates for a GGUF model (kvcache.read_gguf's geometry)."""
    import os

    from kvcache.geometry import read_gguf
    from kvcache.plan import plan_hybrid, plan_iswa, plan_recurrent, plan_unified

    if not os.path.exists(path):
        raise FileNotFoundError(f"no such model file: {path}")
    for name in ("n_layer", "n_embd_k_gqa", "n_embd_v_gqa", "swa_layers", "swa_pattern", "n_swa", "swa_type",
                 "n_embd_k_s", "n_embd_v_s"):
        if getattr(args, name) is not None:
            raise ValueError(f"{_flag(name)} comes from the model; leave it out with a GGUF model")
    if args.recurrent:
        raise ValueError("--recurrent comes from the model; leave it out with a GGUF model")
    g = read_gguf(path)
    # llama.cpp's default context (n_ctx 0) is the trained one; past it the model extrapolates
    n_ctx = args.n_ctx or g.n_ctx_train or 4096
    if g.n_ctx_train and n_ctx > g.n_ctx_train:
        warn(f"--n-ctx {n_ctx} exceeds the model's trained context of {g.n_ctx_train} tokens")
    if g.recurrent:
        _no_semantics(args, "a recurrent cache")
        # llama.cpp keeps recurrent states in f32 whatever the K/V types asked for
        return plan_recurrent(g.n_layer, g.n_embd_k_s, g.n_embd_v_s, args.n_seq_max,
                              n_embd_k_gqa=list(g.n_embd_k_gqa), n_embd_v_gqa=list(g.n_embd_v_gqa), n_ctx=n_ctx)
    common = dict(n_ctx=n_ctx, n_layer=g.n_layer, n_embd_k_gqa=list(g.n_embd_k_gqa),
                  n_embd_v_gqa=list(g.n_embd_v_gqa), n_seq_max=args.n_seq_max, type_k=args.type_k or "f16",
                  type_v=args.type_v or "f16", flash_attn=args.flash_attn)
    if g.hybrid:
        if args.semantics != "2026":
            raise ValueError(f"{path} is a hybrid {g.arch!r} model, whose memory is today's llama.cpp's: "
                             f"give --semantics 2026")
        window: dict = {}
        if g.n_swa:
            # llama_memory_hybrid_iswa: the attention part an iSWA pair
            window = dict(n_swa=g.n_swa, swa_type=g.swa_type, swa_layers=g.swa_layers, swa_full=args.swa_full,
                          **_iswa_batch(args, n_ctx))
        else:
            for name in ("swa_full", "n_batch", "n_ubatch"):
                if getattr(args, name) is not None:
                    raise ValueError(f"{_flag(name)} applies to sliding-window models; {path} has none")
        return plan_hybrid(**{**common, **_semantics(args)}, recurrent_layers=g.recurrent_layers,
                           attn_layers=g.attn_layers, n_embd_r=g.n_embd_k_s, n_embd_s=g.n_embd_v_s,
                           n_rs_seq=args.n_rs_seq if g.rs_rollback else 0, **window)
    if args.n_rs_seq:
        raise ValueError(f"--n-rs-seq applies to hybrid models; {path} is a {g.arch!r} model")
    if g.swa_type == "none":
        for name in ("swa_full", "n_batch", "n_ubatch"):
            if getattr(args, name) is not None:
                raise ValueError(f"{_flag(name)} applies to sliding-window models; {path} has none")
        return plan_unified(**{**common, **_semantics(args)})
    return plan_iswa(**{**common, **_semantics(args)}, swa_layers=g.swa_layers, n_swa=g.n_swa,
                     swa_type=g.swa_type, swa_full=args.swa_full, **_iswa_batch(args, n_ctx))


def run(args: argparse.Namespace) -> int:
    import sys

    from kvcache.plan import format_plan

    plan = build_plan(args, warn=lambda text: print(f"{args._prog}: warning: {text}", file=sys.stderr))
    if args.json:
        print_json(plan.to_dict())
    else:
        print(format_plan(plan))
    return 0
