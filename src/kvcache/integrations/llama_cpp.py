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

The chunks are named under the model's fingerprint (its file's size and sampled bytes, its LoRA
adapter, the context's RoPE parameters: what the K/V depend on beyond the store's geometry), so
that Llamas of two models, quantizations or RoPE settings sharing a directory never restore
each other's K/V: for them a prefix of the other is a miss.
"""
from __future__ import annotations

import hashlib
import io
import math
import operator
import os
import sys
from typing import Any, Sequence

import numpy as np

import llama_cpp  # type: ignore[import-not-found,unused-ignore]
from llama_cpp.llama_cache import BaseLlamaCache  # type: ignore[import-not-found,unused-ignore]

from kvcache import statefile
from kvcache._atomic import open_regular
from kvcache._store_format import _salt_bytes, _tokens_array
from kvcache.geometry import read_gguf
from kvcache.store import PrefixStore, _check_bytes
from kvcache.unified import UnifiedCache

__all__ = ["LlamaPromptCache", "layout_of_installed", "model_fingerprint"]

# the context parameters the K/V depend on beyond the cache's geometry (RoPE rotates every K row)
_ROPE_PARAMS = ("rope_scaling_type", "rope_freq_base", "rope_freq_scale", "yarn_ext_factor", "yarn_attn_factor",
                "yarn_beta_fast", "yarn_beta_slow", "yarn_orig_ctx")
_EDGE = 1 << 20      # bytes read at each end of the model file
_SAMPLES = 256       # blocks read between them, evenly spaced: a changed tensor larger than the
_SAMPLE = 4096       # file / _SAMPLES is seen in its bytes, whatever its place in the file


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


def model_fingerprint(llama: Any) -> bytes:
    """16 bytes naming what a context's K/V depend on beyond the cache's geometry: the model
    file (its size, its first and last MiB and 256 blocks spread between them: two files of one
    architecture, such as two quantizations or fine-tunes, differ there; the whole file is not
    hashed, as a model is gigabytes), the LoRA adapter and scale, and the context's RoPE
    parameters. Reads about 3 MiB of the model file."""
    h = hashlib.blake2b(digest_size=16, person=b"kvcache-llama")
    with open_regular(os.fspath(llama.model_path)) as f:
        size = os.fstat(f.fileno()).st_size
        h.update(size.to_bytes(8, "little"))
        spots = [(0, _EDGE), (max(0, size - _EDGE), _EDGE)]
        spots += [(i * size // (_SAMPLES + 1), _SAMPLE) for i in range(1, _SAMPLES + 1)]
        for off, n in spots:
            f.seek(off)
            h.update(f.read(n))
    p = llama.context_params
    extra = [repr(getattr(p, name, None)) for name in _ROPE_PARAMS]
    extra += [repr(getattr(llama, name, None)) for name in ("lora_base", "lora_path", "lora_scale")]
    h.update("\0".join(extra).encode("utf-8"))
    return h.digest()


def _keeps_all_logits(llama: Any) -> bool:
    """Whether the Llama keeps the logits of every token (logits_all, or a draft model)."""
    v = getattr(llama, "_logits_all", None)      # today's llama-cpp-python
    if v is None:
        v = getattr(llama.context_params, "logits_all", False)    # 0.3.10 keeps it there
    return bool(v)


class LlamaPromptCache(BaseLlamaCache):
    """A prompt cache for ``llama.set_cache()`` that keeps prefixes as chunks of a PrefixStore.

    llama: the Llama whose context it serves (its model file and context parameters give the
    geometry; it serves no other Llama). path: a store directory shared with other processes
    (None: host memory only). capacity_bytes: the host tier's cap; disk_bytes: the directory's.
    chunk_tokens: tokens per chunk (restores are whole chunks). salt: a namespace of its own (a
    tenant, an adapter applied otherwise than by ``lora_path``), within the model's
    (:func:`model_fingerprint`).

    A restored prefix comes without its tokens' logits (the model computes those of the rest of
    the prompt), so a Llama that keeps every token's logits (``logits_all=True``, or a draft
    model) is refused: its prompt logprobs (``echo=True`` with ``logprobs``) would be wrong.
    ``allow_logits_all=True`` takes it anyway, for a caller that never reads a prompt token's
    logits: a restored token's row of ``llama.scores`` is then NaN.

    ``store`` is the PrefixStore (its ``stats`` count hits and misses); ``cache_size`` is the
    bytes of K/V in host memory; ``fingerprint`` names the model (:func:`model_fingerprint`),
    ``namespace`` is the salt the store holds its chunks under (the fingerprint, then ``salt``)."""

    def __init__(self, llama: Any, path: str | os.PathLike[str] | None = None, *, capacity_bytes: int = 2 << 30,
                 disk_bytes: int = 8 << 30, chunk_tokens: int = 64, salt: str | bytes | None = None,
                 allow_logits_all: bool = False) -> None:
        _check_bytes("capacity_bytes", capacity_bytes)
        _check_bytes("disk_bytes", disk_bytes)
        user_salt = _salt_bytes(salt)
        if not isinstance(allow_logits_all, bool):
            raise TypeError(f"allow_logits_all must be a bool, not {type(allow_logits_all).__name__}")
        self.all_logits = _keeps_all_logits(llama)
        if self.all_logits and not allow_logits_all:
            raise ValueError("llama keeps the logits of every token (logits_all=True or a draft model), and a "
                             "restored prefix has none: its prompt logprobs (echo=True with logprobs) would be "
                             "wrong. Make the Llama with logits_all=False, use llama_cpp.LlamaRAMCache (which "
                             "keeps them), or pass allow_logits_all=True if no prompt token's logits are read")
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
        self.fingerprint = model_fingerprint(llama)
        self.namespace = self.fingerprint + user_salt    # the store's namespace: the model's, then the caller's

    @property
    def cache_size(self) -> int:
        return self.store.host_used

    def _own_llama(self, op: str) -> None:
        """Refuse a call made for another Llama (the cache set on one it was not made for): the
        state it would answer is of this one's geometry and context size, and llama-cpp-python
        half-loads a state that does not fit before it fails. llama-cpp-python calls the cache
        from a method of the Llama it serves, whose frame names it."""
        try:
            caller = sys._getframe(2).f_locals.get("self")
        except ValueError:
            return
        if isinstance(caller, llama_cpp.Llama) and caller is not self.llama:
            raise ValueError(f"LlamaPromptCache.{op}: this cache serves the Llama it was made for, not another: "
                             "make one per Llama (llama.set_cache(LlamaPromptCache(llama, ...)))")

    def _usable(self, toks: np.ndarray) -> int:
        """Tokens of toks a restore would give: whole chunks, at most all but the last token."""
        return self.store.match(toks[:max(0, len(toks) - 1)], self.namespace)

    def __contains__(self, key: Sequence[int]) -> bool:
        self._own_llama("__contains__")
        return self._usable(_tokens_array(key)) > 0

    def __getitem__(self, key: Sequence[int]) -> Any:
        self._own_llama("__getitem__")
        toks = _tokens_array(key)
        if len(toks) < 2:
            raise KeyError("Key not found")
        cache = self.scratch
        cache.clear()
        k = self.store.load(cache, 0, toks, self.namespace, max_tokens=len(toks) - 1)
        if k == 0:
            raise KeyError("Key not found")
        buf = io.BytesIO()
        statefile.write_context_state(buf, cache, self.arch, layout=self.layout)
        blob = buf.getvalue()
        cache.clear()
        llama = self.llama
        input_ids = np.full(llama._n_ctx, -1, dtype=np.intc)
        input_ids[:k] = toks[:k]
        # llama-cpp-python copies these scores over the rows of the restored tokens, one row
        # broadcast (the model only needs the logits it computes for the rest): where it keeps
        # every token's logits they are unknown, not zero
        scores = np.full((1, llama._n_vocab), math.nan if self.all_logits else 0.0, dtype=np.single)
        return llama_cpp.llama.LlamaState(input_ids=input_ids, scores=scores, n_tokens=k, llama_state=blob,
                                          llama_state_size=len(blob), seed=llama._seed)

    def __setitem__(self, key: Sequence[int], value: Any) -> None:
        self._own_llama("__setitem__")
        n = operator.index(value.n_tokens)
        ids = _tokens_array(value.input_ids)
        if not 0 <= n <= len(ids):
            raise ValueError(f"the state's n_tokens {n} is not within its {len(ids)} input_ids")
        toks = ids[:n]
        if len(toks) < self.store.geometry.chunk_tokens:
            return
        cache = self.scratch
        cache.clear()
        try:
            statefile.parse_context_state(value.llama_state, layout=self.layout).restore(cache)
            self.store.save(cache, 0, toks, self.namespace)
        finally:
            cache.clear()
