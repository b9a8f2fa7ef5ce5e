"""A prompt cache for llama-cpp-python backed by a :class:`kvcache.store.PrefixStore`.

``Llama.set_cache()`` takes a ``BaseLlamaCache``; llama-cpp-python asks it for the state of the
longest cached prefix of a prompt (``cache[prompt_tokens]``), loads that state into the context
(``Llama.load_state``) when it is longer than what the context already holds, and stores the
context's state after every completion (``cache[prompt + completion] = llama.save_state()``).
Its own caches keep one whole-context state per completion and scan every key for the longest
prefix. :class:`LlamaPromptCache` keeps chunks instead (a shared prefix once, however many
prompts extend it), finds a prefix by hashing the prompt's chunks (whatever it holds), and
answers with a whole-context state of just that prefix, assembled by kvcache in the layout the
installed llama.cpp reads ("2025" for llama-cpp-python 0.3.10, "2026" for today's), which
llama.cpp's own ``llama_state_set_data`` loads. With ``path``, the chunks live in a directory
that other processes (and later runs) with the same model and cache types share.

    llama = llama_cpp.Llama(model_path=..., n_ctx=4096)
    llama.set_cache(LlamaPromptCache(llama, path="/var/cache/kvcache"))

A prefix is restored in whole chunks of ``chunk_tokens`` tokens (at most all of the prompt but
its last token: the model needs the last token's logits). Models with an unsupported cache
(sliding-window pairs, recurrent and hybrid models) are refused when the cache is made.
"""
from __future__ import annotations

import io
import os
from typing import Any, Sequence

import numpy as np

import llama_cpp  # type: ignore[import-not-found,unused-ignore]
from llama_cpp.llama_cache import BaseLlamaCache  # type: ignore[import-not-found,unused-ignore]

from kvcache import statefile
from kvcache.geometry import read_gguf
from kvcache.store import PrefixStore
from kvcache.unified import UnifiedCache

__all__ = ["LlamaPromptCache", "layout_of_installed"]


def layout_of_installed() -> str:
    """The state layout the installed llama-cpp-python's llama.cpp reads: "2026" from 0.3.11 on
    (today's llama.cpp), "2025" for 0.3.10 and before."""
    parts = tuple(int(x) for x in llama_cpp.__version__.split(".")[:3] if x.isdigit())
    return "2026" if parts >= (0, 3, 11) else "2025"


def _flash_attn(params: Any) -> bool | None:
    """Whether the context stores V untransposed: 0.3.10's flash_attn flag, or today's
    flash_attn_type (-1 auto, which kvcache's "2026" default follows)."""
    if hasattr(params, "flash_attn_type"):
        t = int(params.flash_attn_type)
        return None if t < 0 else bool(t)
    return bool(params.flash_attn)


class LlamaPromptCache(BaseLlamaCache):
    """A prompt cache for ``llama.set_cache()`` that keeps prefixes as chunks of a PrefixStore.

    llama: the Llama whose context it serves (its model file and context parameters give the
    geometry). path: a store directory shared with other processes (None: host memory only).
    capacity_bytes: the host tier's cap; disk_bytes: the directory's. chunk_tokens: tokens per
    chunk (restores are whole chunks). salt: a namespace (a LoRA adapter, a tenant).

    ``store`` is the PrefixStore (its ``stats`` count hits and misses); ``cache_size`` is the
    bytes of K/V in host memory."""

    def __init__(self, llama: Any, path: str | os.PathLike[str] | None = None, *, capacity_bytes: int = 2 << 30,
                 disk_bytes: int = 8 << 30, chunk_tokens: int = 64, salt: str | bytes | None = None) -> None:
        super().__init__(capacity_bytes)
        self.llama = llama
        self.layout = layout_of_installed()
        semantics = "2026" if self.layout == "2026" else "2025"
        p = llama.context_params
        geo = read_gguf(llama.model_path)
        self.arch = geo.arch
        kw: dict[str, Any] = {}
        if semantics == "2026":
            kw["kv_unified"] = bool(getattr(p, "kv_unified", True))
        cache = geo.make_cache(llama.n_ctx(), n_seq_max=int(p.n_seq_max), type_k=int(p.type_k), type_v=int(p.type_v),
                               flash_attn=_flash_attn(p), semantics=semantics, **kw)
        if not isinstance(cache, UnifiedCache):
            raise ValueError(f"llama: a model whose cache is a {type(cache).__name__} ({geo.arch}); the prompt "
                             "cache serves models with one unified K/V cache")
        self.scratch = cache
        self.store = PrefixStore(cache, path, chunk_tokens=chunk_tokens, host_bytes=capacity_bytes,
                                 disk_bytes=disk_bytes if path is not None else 0)
        self.salt = salt

    @property
    def cache_size(self) -> int:
        return self.store.host_used

    def _usable(self, key: Sequence[int]) -> int:
        """Tokens of key a restore would give: whole chunks, at most all but the last token."""
        toks = list(key)
        return self.store.match(toks[:max(0, len(toks) - 1)], self.salt)

    def __contains__(self, key: Sequence[int]) -> bool:
        return self._usable(key) > 0

    def __getitem__(self, key: Sequence[int]) -> Any:
        toks = np.asarray(list(key), dtype=np.int32)
        if len(toks) < 2:
            raise KeyError("Key not found")
        cache = self.scratch
        cache.clear()
        k = self.store.load(cache, 0, toks, self.salt, max_tokens=len(toks) - 1)
        if k == 0:
            raise KeyError("Key not found")
        buf = io.BytesIO()
        statefile.write_context_state(buf, cache, self.arch, layout=self.layout)
        blob = buf.getvalue()
        cache.clear()
        llama = self.llama
        input_ids = np.full(llama._n_ctx, -1, dtype=np.intc)
        input_ids[:k] = toks[:k]
        # llama-cpp-python copies these scores over the rows of the restored tokens: one row of
        # zeros broadcasts (the model only needs the logits it computes for the rest)
        scores = np.zeros((1, llama._n_vocab), dtype=np.single)
        return llama_cpp.llama.LlamaState(input_ids=input_ids, scores=scores, n_tokens=k, llama_state=blob,
                                          llama_state_size=len(blob), seed=llama._seed)

    def __setitem__(self, key: Sequence[int], value: Any) -> None:
        n = int(value.n_tokens)
        toks = np.asarray(value.input_ids[:n], dtype=np.int32)
        if len(toks) < self.store.geometry.chunk_tokens:
            return
        cache = self.scratch
        cache.clear()
        try:
            statefile.parse_context_state(value.llama_state, layout=self.layout).restore(cache)
            self.store.save(cache, 0, toks, self.salt)
        finally:
            cache.clear()
