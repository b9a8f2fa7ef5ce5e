"""Prefill in one process, decode in another: a sequence's KV moves with NIXL (UCX, DRAM to DRAM).

Starts a "prefill" process that prefills a prompt with the demo's toy model into its
kvcache.UnifiedCache, registers the cache's K/V memory with a NIXL agent and sends the sequence's
header, its regions and the agent's metadata over a pipe. This ("decode") process registers its
own cache, begins the import, READs the regions straight into the reserved cells, commits and
decodes. The prefill process decodes the same tokens without the move as the reference. Prints
what moved and how fast; exits 1 unless the tokens and logits match.

    python docs/examples/handoff_nixl.py [--tokens 512] [--decode 16]

Needs the ``nixl`` extra of kvcache (nixl 1.5.1; UCX comes with the wheel; no GPU needed).
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import time

import numpy as np


def _exit_past_nixl(code: int) -> None:
    """Leave the process without the interpreter's teardown: with nixl 1.5.1 (UCX backend) every
    process that created an agent dies of SIGSEGV in that teardown, after all its work is done."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _kv_size(args: argparse.Namespace) -> int:
    return ((args.tokens + args.decode + 255) // 256) * 256


def _prompt(args: argparse.Namespace) -> list[int]:
    return [int(t) for t in np.random.default_rng(1).integers(0, 256, args.tokens)]


def prefill_process(conn, args: argparse.Namespace) -> None:
    from nixl._api import nixl_agent, nixl_agent_config

    from kvcache.integrations.nixl import register_cache
    from toy_serving import decode, prefill, toy_cache, toy_model

    model = toy_model()
    cache = toy_cache(model, _kv_size(args))
    first = prefill(model, cache, _prompt(args))
    agent = nixl_agent("prefill", nixl_agent_config(backends=["UCX"]))
    reg = register_cache(agent, cache)
    exp = cache.seq_export(0)
    conn.send((agent.get_agent_metadata(), exp.header, np.asarray(exp.regions), first))
    # the cache must not change (nor the memory go away) until the receiver has read it
    while not agent.check_remote_xfer_done("decode", b"kvcache-handoff"):
        time.sleep(0.001)
    conn.send(decode(model, cache, first, args.tokens, args.decode))
    conn.recv()
    agent.deregister_memory(reg)
    conn.close()
    _exit_past_nixl(0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=512, help="prompt length")
    ap.add_argument("--decode", type=int, default=16, help="tokens decoded after the hand-off")
    args = ap.parse_args()
    from nixl._api import nixl_agent, nixl_agent_config

    from kvcache.integrations.nixl import pull_sequence, register_cache
    from toy_serving import decode, toy_cache, toy_model

    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=prefill_process, args=(there, args))
    proc.start()
    try:
        model = toy_model()
        cache = toy_cache(model, _kv_size(args))
        agent = nixl_agent("decode", nixl_agent_config(backends=["UCX"]))
        reg = register_cache(agent, cache)
        metadata, header, regions, first = here.recv()
        remote = agent.add_remote_agent(metadata)
        stats = pull_sequence(agent, remote, cache, header, regions)
        toks, logits = decode(model, cache, first, args.tokens, args.decode)
        ref_toks, ref_logits = here.recv()
        here.send("done")
        agent.remove_remote_agent(remote)
        agent.deregister_memory(reg)
    finally:
        proc.join(60)
    diff = float(np.max(np.abs(logits - ref_logits))) if len(logits) else 0.0
    n_cells = cache.seq_pos_max(0) + 1 - args.decode
    ok = toks == ref_toks and diff <= 1e-5 and n_cells == args.tokens and proc.exitcode == 0
    n_bytes = stats["bytes"]
    print(f"moved sequence 0: {n_cells} cells, header {len(header)} bytes, K/V {n_bytes / 2**20:.2f} MiB "
          f"in {int(stats['regions'])} regions, NIXL READ over UCX")
    print(f"import begin {stats['begin'] * 1e3:.2f} ms, transfer {stats['transfer'] * 1e3:.2f} ms "
          f"({n_bytes / max(stats['transfer'], 1e-9) / 1e9:.2f} GB/s), commit {stats['commit'] * 1e3:.2f} ms")
    print(f"decoded {len(toks)} tokens after the move: {'match' if ok else 'MISMATCH'} "
          f"(max |logit difference| {diff:.3g})")
    return 0 if ok else 1


if __name__ == "__main__":
    _exit_past_nixl(main())
