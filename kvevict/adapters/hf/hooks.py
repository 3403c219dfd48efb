"""Forward hooks that tell a cache where each forward of the model starts and ends.

transformers calls ``Cache.update`` once per layer and says nothing about the forward around it.
A paged cache needs more: the new tokens' ids, the 2-D padding mask and the positions before the
first layer runs (and, to evict by attention, each attention module's input), and a signal once
the last layer is done, to write the new slots through to the pool. Hooks on the model's decoder
(``model.base_model``) deliver that; they are installed once per model and ignore every cache
that is not of the type they were installed for.

The cache type implements ``begin_forward(decoder, arguments) -> mask or None`` (a returned
2-D mask replaces the forward's ``attention_mask``), ``end_forward()`` and, for attention
hooks, ``wants_queries``, ``capture_queries(module, hidden_states, position_embeddings)`` and
``head_mask(module) -> mask or None`` (a returned mask replaces that attention module's
``attention_mask``: per-head masks, which transformers' one mask for all heads cannot say).
"""

from __future__ import annotations

import inspect
from functools import partial
from typing import Any

from torch import nn

from kvevict.adapters.hf.model import attention_modules

__all__ = ["install_hooks", "remove_hooks"]

_HOOKS = "_kvevict_hooks"


def _cache_argument(names: list[str], args: tuple, kwargs: dict) -> Any:
    """The cache a forward was given: ``cache=``, the deprecated ``past_key_values=``, or
    positional."""
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    if cache is None and "cache" in names and len(args) > names.index("cache"):
        cache = args[names.index("cache")]
    return cache


def _forward_pre_hook(cache_type: type, names: list[str], module: nn.Module, args: tuple,
                      kwargs: dict) -> tuple[tuple, dict] | None:
    cache = _cache_argument(names, args, kwargs)
    if not isinstance(cache, cache_type):
        return None
    arguments = dict(zip(names, args))
    arguments.update(kwargs)
    mask = cache.begin_forward(module, arguments)
    if mask is None:
        return None
    position = names.index("attention_mask") if "attention_mask" in names else len(names)
    if "attention_mask" not in kwargs and len(args) > position:
        args = (*args[:position], mask, *args[position + 1:])
    else:
        kwargs = {**kwargs, "attention_mask": mask}
    return args, kwargs


def _forward_hook(cache_type: type, names: list[str], module: nn.Module, args: tuple,
                  kwargs: dict, output: Any) -> None:
    cache = _cache_argument(names, args, kwargs)
    if isinstance(cache, cache_type):
        cache.end_forward()


def _attention_pre_hook(cache_type: type, module: nn.Module, args: tuple,
                        kwargs: dict) -> tuple[tuple, dict] | None:
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    if not isinstance(cache, cache_type):
        return None
    if cache.wants_queries:
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        rope = kwargs.get("position_embeddings", args[1] if len(args) > 1 else None)
        cache.capture_queries(module, hidden, rope)
    mask = cache.head_mask(module)
    if mask is None:
        return None
    return args, {**kwargs, "attention_mask": mask}


def install_hooks(decoder: nn.Module, cache_type: type, *, attention: bool) -> None:
    """Install the forward hooks on ``decoder`` once (and the attention-module hooks once, when
    ``attention`` is asked for); they serve caches of ``cache_type`` only."""
    hooks = getattr(decoder, _HOOKS, None)
    if hooks is None:
        names = list(inspect.signature(decoder.forward).parameters)
        hooks = {"forward": [
            decoder.register_forward_pre_hook(partial(_forward_pre_hook, cache_type, names),
                                              with_kwargs=True),
            decoder.register_forward_hook(partial(_forward_hook, cache_type, names),
                                          with_kwargs=True),
        ], "attention": None}
        setattr(decoder, _HOOKS, hooks)
    if attention and hooks["attention"] is None:
        hooks["attention"] = [
            module.register_forward_pre_hook(partial(_attention_pre_hook, cache_type),
                                             with_kwargs=True)
            for module in attention_modules(decoder).values()]


def remove_hooks(model: nn.Module) -> None:
    """Remove the hooks `PagedCache` installed on ``model`` (they are no-ops for other caches;
    this is for a model that will never see a `PagedCache` again)."""
    decoder = getattr(model, "base_model", model)
    hooks = getattr(decoder, _HOOKS, None)
    if hooks is not None:
        for handle in hooks["forward"] + (hooks["attention"] or []):
            handle.remove()
        delattr(decoder, _HOOKS)
