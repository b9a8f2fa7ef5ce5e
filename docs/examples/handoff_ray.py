"""Prefill in one Ray actor, decode in another: a sequence's KV moves through Ray's object store.

Starts a local Ray cluster (two actors, each with its own kvcache.UnifiedCache), prefills a prompt
with the demo's toy model in the "prefill" actor, hands the sequence over (its header and its K/V
bytes as one numpy array in the object store; the decode actor receives a read-only zero-copy
view and scatters it into the cells its cache reserved), then decodes in the "decode" actor. The
prefill actor decodes the same tokens itself, without the move, as the reference. Prints what
moved and how fast; exits 1 unless the tokens and logits match.

    python docs/examples/handoff_ray.py [--tokens 512] [--decode 16]

Needs the ``ray`` extra of kvcache (ray 2.60). Set RAY_AUTH_MODE=disabled for a throwaway local
cluster without Ray's token authentication.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=512, help="prompt length")
    ap.add_argument("--decode", type=int, default=16, help="tokens decoded after the hand-off")
    args = ap.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray

    from kvcache.integrations.ray import export_sequence, import_sequence
    from toy_serving import decode, prefill, toy_cache, toy_model

    kv_size = ((args.tokens + args.decode + 255) // 256) * 256

    @ray.remote(num_cpus=0)
    class Prefill:
        def __init__(self) -> None:
            self.model = toy_model()
            self.cache = toy_cache(self.model, kv_size)

        def prefill(self, prompt: list[int]) -> int:
            self.first = prefill(self.model, self.cache, prompt)
            return self.first

        def export(self) -> tuple[bytes, np.ndarray, float]:
            t = time.perf_counter()
            header, data = export_sequence(self.cache, 0)
            return header, data, time.perf_counter() - t

        def reference(self, pos: int, n: int) -> tuple[list[int], np.ndarray]:
            return decode(self.model, self.cache, self.first, pos, n)

    @ray.remote(num_cpus=0)
    class Decode:
        def __init__(self) -> None:
            self.model = toy_model()
            self.cache = toy_cache(self.model, kv_size)

        def restore(self, header: bytes, data: np.ndarray) -> tuple[bool, int, float]:
            # data arrives resolved: a read-only view of the object store's shared memory
            t = time.perf_counter()
            n = import_sequence(self.cache, header, data)
            return bool(data.flags.writeable), n, time.perf_counter() - t

        def decode(self, token: int, pos: int, n: int) -> tuple[list[int], np.ndarray]:
            return decode(self.model, self.cache, token, pos, n)

    # the actors call toy_serving, which lies beside this script: the workers get this folder
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"working_dir": os.path.dirname(os.path.abspath(__file__))})
    try:
        prompt = [int(t) for t in np.random.default_rng(1).integers(0, 256, args.tokens)]
        p, d = Prefill.remote(), Decode.remote()
        first = ray.get(p.prefill.remote(prompt))
        header_ref, data_ref, t_export_ref = p.export.options(num_returns=3).remote()
        header, t_export = ray.get([header_ref, t_export_ref])
        t0 = time.perf_counter()
        writeable, n_cells, t_import = ray.get(d.restore.remote(header_ref, data_ref))
        t_move = time.perf_counter() - t0
        n_bytes = int(ray.get(data_ref).nbytes)
        toks, logits = ray.get(d.decode.remote(first, args.tokens, args.decode))
        ref_toks, ref_logits = ray.get(p.reference.remote(args.tokens, args.decode))
    finally:
        ray.shutdown()
    diff = float(np.max(np.abs(logits - ref_logits))) if len(logits) else 0.0
    ok = toks == ref_toks and diff <= 1e-5 and not writeable and n_cells == args.tokens
    print(f"moved sequence 0: {n_cells} cells, header {len(header)} bytes, K/V {n_bytes / 2**20:.2f} MiB "
          f"through Ray's object store")
    print(f"export (gather) {t_export * 1e3:.2f} ms, hand-off to the decode actor (import, commit) "
          f"{t_move * 1e3:.2f} ms of which import {t_import * 1e3:.2f} ms "
          f"({n_bytes / max(t_import, 1e-9) / 1e9:.2f} GB/s), zero-copy read-only view: {not writeable}")
    print(f"decoded {len(toks)} tokens after the move: {'match' if ok else 'MISMATCH'} "
          f"(max |logit difference| {diff:.3g})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
