"""The constructor parameters of the classes kvcache._core defines, one Python function per class.

A compiled class's ``__cinit__`` takes ``*args, **kwargs`` and binds them by calling its function
here, so that a wrong call is refused in Python's own words under the class's name
(``UnifiedCache() missing 2 required positional arguments: ...``), and ``inspect.signature`` of
the class shows these parameters (:class:`ClassSignature`). Each function only returns its
arguments, in order."""
from __future__ import annotations

import functools
import inspect
from typing import Any, Callable


def unified(kv_size, n_layer, n_embd_k_gqa, n_embd_v_gqa, type_k="f16", type_v="f16", v_trans=True, n_seq_max=1,
            n_pad=32, n_swa=0, swa_type="none", layers=None, buffers="owned", n_embd_head_k=None, rope=None,
            semantics=None, kv_unified=True, cell_ext=False, ple_token=None):
    """kvcache.UnifiedCache's parameters (semantics None: the class's; UnifiedCache's is "2025")."""
    return (kv_size, n_layer, n_embd_k_gqa, n_embd_v_gqa, type_k, type_v, v_trans, n_seq_max, n_pad, n_swa,
            swa_type, layers, buffers, n_embd_head_k, rope, semantics, kv_unified, cell_ext, ple_token)


def iswa(kv_size, n_layer, n_embd_k_gqa, n_embd_v_gqa, swa_layers, n_swa, swa_type="standard", n_batch=512,
         swa_full=None, type_k="f16", type_v="f16", v_trans=True, n_seq_max=1, n_pad=32, buffers="owned",
         n_embd_head_k=None, rope=None, semantics=None, kv_unified=True, cell_ext=False, ple_token=None,
         layers=None):
    """kvcache.ISWACache's parameters (semantics None: the class's, "2025" for ISWACache)."""
    return (kv_size, n_layer, n_embd_k_gqa, n_embd_v_gqa, swa_layers, n_swa, swa_type, n_batch, swa_full, type_k,
            type_v, v_trans, n_seq_max, n_pad, buffers, n_embd_head_k, rope, semantics, kv_unified, cell_ext,
            ple_token, layers)


def recurrent(n_seq_max, n_layer, n_embd_k_gqa, n_embd_v_gqa, type_k="f32", type_v="f32", kv_size=None,
              n_embd_k_s=0, n_embd_v_s=0, buffers="owned", semantics=None, n_rs_seq=0):
    """kvcache.RecurrentCache's parameters (semantics None: the class's; RecurrentCache's is "2025")."""
    return (n_seq_max, n_layer, n_embd_k_gqa, n_embd_v_gqa, type_k, type_v, kv_size, n_embd_k_s, n_embd_v_s,
            buffers, semantics, n_rs_seq)


def hybrid(kv_size, n_layer, recurrent_layers, n_embd_k_gqa, n_embd_v_gqa, n_embd_r, n_embd_s=0, n_seq_max=1,
           type_k="f16", type_v="f16", v_trans=True, n_rs_seq=0, attn_layers=None, kv_unified=True,
           n_embd_head_k=None, rope=None, buffers="owned", n_swa=0, swa_type="standard", swa_layers=None,
           n_batch=512, swa_full=None):
    """kvcache.HybridCache's parameters."""
    return (kv_size, n_layer, recurrent_layers, n_embd_k_gqa, n_embd_v_gqa, n_embd_r, n_embd_s, n_seq_max, type_k,
            type_v, v_trans, n_rs_seq, attn_layers, kv_unified, n_embd_head_k, rope, buffers, n_swa, swa_type,
            swa_layers, n_batch, swa_full)


def ubatch(pos, seq_id, n_seq_tokens=1, output=None, *, tokens=None, pos_x=None, pos_y=None):
    """kvcache.UBatch's parameters."""
    return pos, seq_id, n_seq_tokens, output, tokens, pos_x, pos_y


def batch(pos, seq_id, output=None, logits_all=False, simple_split=True, *, tokens=None, pos_x=None, pos_y=None):
    """kvcache.Batch's parameters."""
    return pos, seq_id, output, logits_all, simple_split, tokens, pos_x, pos_y


def rope_params(n_rot, mode=0, n_ctx_orig=0, freq_base=10000.0, freq_scale=1.0, ext_factor=0.0, attn_factor=1.0,
                beta_fast=32.0, beta_slow=1.0, freq_factors=None, layer_freq_base=None, layer_freq_scale=None):
    """kvcache.RopeParams's parameters."""
    return (n_rot, mode, n_ctx_orig, freq_base, freq_scale, ext_factor, attn_factor, beta_fast, beta_slow,
            freq_factors, layer_freq_base, layer_freq_scale)


def cells(pos, shift, seq_mask, ext=None):
    """kvcache.Cells's parameters."""
    return pos, shift, seq_mask, ext


def update_plan(k_shift=None, rotated=False, defrag_runs=None, moved=False, need_reserve=False):
    """kvcache.UpdatePlan's parameters."""
    return k_shift, rotated, defrag_runs, moved, need_reserve


def stream_update(status, had_shift, copies, has_shift, shift, rotated=False):
    """kvcache.StreamUpdate's parameters."""
    return status, had_shift, copies, has_shift, shift, rotated


def bind(params: Callable[..., tuple[Any, ...]], cls: type, args: tuple[Any, ...],
         kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """The arguments of a call of ``cls`` bound to the parameters of ``params``, in order; a call
    that does not fit them raises Python's TypeError, naming ``cls``."""
    try:
        return params(*args, **kwargs)
    except TypeError as e:
        # the function only returns its arguments: a TypeError is the binding's
        raise TypeError(str(e).replace(f"{params.__name__}()", f"{cls.__name__}()", 1)) from None


def named_errors(init: Callable[..., None]) -> Callable[..., None]:
    """A Python class's ``__init__`` whose calls with arguments that do not fit are refused under
    the class's name (``ISWACache() missing ...``, not ``ISWACache.__init__() missing ...``)."""

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        try:
            init(self, *args, **kwargs)
        except TypeError as e:
            if e.__traceback__ is not None and e.__traceback__.tb_next is not None:
                raise  # raised inside __init__, not by binding its arguments
            raise TypeError(str(e).replace(f"{init.__qualname__}()", f"{type(self).__name__}()", 1)) from None

    return __init__


def _a(name: str) -> str:
    """A class name with its article: "a UnifiedCache", "an ISWACache" (a leading U is spoken "you")."""
    return f"{'an' if name[0] in 'AEIO' else 'a'} {name}"


def factory_make(factory: type, cls: type, params: Callable[..., tuple[Any, ...]], args: tuple[Any, ...],
                 kwargs: dict[str, Any], by_semantics: dict[str, type]) -> Any:
    """What a factory class (UnifiedCache, RecurrentCache, ISWACache) makes: the class of
    by_semantics its constructor's ``semantics`` names (its arguments bound by params; None: the
    first), built from the same arguments; TypeError / ValueError for another semantics, and for
    a subclass of the factory that is not one of those classes."""
    if cls is not factory:
        kinds = " or ".join(_a(k.__name__) for k in by_semantics.values())
        raise TypeError(f"{cls.__name__}: {_a(factory.__name__)} is {kinds}; derive from one of them")
    choices = tuple(by_semantics)
    semantics = bind(params, cls, args, kwargs)[params.__code__.co_varnames.index("semantics")]
    if semantics is None:
        semantics = choices[0]
    if not isinstance(semantics, str):
        raise TypeError(f"semantics must be a str, not {type(semantics).__name__}")
    if semantics not in choices:
        raise ValueError(f"semantics = {semantics!r}: expected one of {', '.join(choices)}")
    return by_semantics[semantics](*args, **kwargs)


class ClassSignature:
    """``__signature__`` of a class whose constructor takes the parameters of a function of this
    module, with the given defaults in place of the function's (computed when asked for:
    importing kvcache does not need inspect's parsing)."""

    def __init__(self, params: Callable[..., tuple[Any, ...]], **defaults: Any) -> None:
        self._params = params
        self._defaults = defaults

    def __get__(self, obj: Any, owner: Any = None) -> inspect.Signature:
        sig = inspect.signature(self._params)
        if not self._defaults:
            return sig
        return sig.replace(parameters=[p.replace(default=self._defaults.get(p.name, p.default))
                                       for p in sig.parameters.values()])
