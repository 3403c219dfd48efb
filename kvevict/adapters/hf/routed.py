"""`RoutedCache`: MoE-nD's per-layer eviction and quantization in a ``transformers.Cache``.

Source: Sun et al., "MoE-nD" (arXiv:2604.17695, 2026): each layer is routed to its own
``(keep ratio, key bits, value bits)`` tuple under one memory budget, chosen by an
offline-calibrated greedy solver (`kvevict.tokens.solver.route`), and eviction and quantization
are applied together at inference.

Here, when the first forward (the context's prefill) ends, each full-attention layer ``l``
keeps ``kept_tokens(ratio_l, C)`` of the ``C`` context tokens, chosen by a token policy that
needs no attention matrix (``knorm`` by default, or a learned ``lkv_t`` / ``kvp``), and stores
them **quantized** (`kvevict.tokens.quant`: keys per channel, values per token, packed codes
and float16 scales). Every later forward dequantizes them for attention and appends its own
tokens in full precision after them (the residual, as transformers' ``QuantizedCache`` keeps
recent tokens): the compression happens once, after prefill, as in kvpress and the MoE-nD paper.
`nbytes` counts what the layers hold.

Layers keep different token counts while transformers builds one mask per forward, sized for
the widest layer (`RoutedCache.get_mask_sizes`). The model therefore runs under
`routed_attention(model)`: eager attention whose mask is cut to each layer's own keys from the
end (the newest tokens are last in every layer, and without padding every older column is
visible). Batches must be unpadded. `calibrate` measures each layer's answer-loss increase per
tuple, the table `route` needs.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from transformers.cache_utils import Cache, CacheLayerMixin

from kvevict.errors import ConfigError
from kvevict.tokens import TOKEN_POLICIES, ScorerShape, TokenPolicy, make_token_policy
from kvevict.tokens.base import eager_attention
from kvevict.tokens.quant import QuantizedKV, quantize
from kvevict.tokens.solver import Tuple, check_tuple, kept_tokens, route, total_bytes
from kvevict.tokens.tasks import TaskItem, batches

__all__ = ["ROUTED_ATTENTION", "ResidualLayer", "RoutedCache", "RoutedLayer", "attention_function",
           "calibrate", "full_attention_layers", "greedy_answers", "refine_route",
           "routed_answers", "routed_attention"]

#: The attention implementation name `routed_attention` registers.
ROUTED_ATTENTION = "kvevict_routed"


def _routed_eager(module: Any, query: Tensor, key: Tensor, value: Tensor,
                  attention_mask: Tensor | None, scaling: float | None = None,
                  dropout: float = 0.0, **_: Any) -> tuple[Tensor, Tensor]:
    """Eager attention with the mask cut to this layer's keys, from the end."""
    bias = None if attention_mask is None else attention_mask[..., -key.shape[-2]:]
    return eager_attention(query, key, value, bias, scaling)


@contextmanager
def attention_function(model: Any, name: str, function: Callable[..., Any],
                       restore: str = "eager") -> Iterator[Any]:
    """Run ``model`` with ``function`` (transformers' ``AttentionInterface`` signature, given
    eager's float causal mask) registered as ``name`` for every layer; ``restore`` is the
    implementation set back afterwards (transformers has no public getter for the current
    one)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(name, function)
    AttentionMaskInterface.register(name, eager_mask)
    model.set_attn_implementation(name)
    try:
        yield model
    finally:
        model.set_attn_implementation(restore)


def routed_attention(model: Any, restore: str = "eager") -> Any:
    """The attention a `RoutedCache` needs (`attention_function` with the mask cut to each
    layer's keys from the end), as a context manager."""
    return attention_function(model, ROUTED_ATTENTION, _routed_eager, restore)


def full_attention_layers(model: Any, who: str) -> int:
    """The number of ``model``'s layers; `ConfigError` (naming ``who``) unless every one is full
    attention (the caches that compress after the prefill cut one mask per layer or head)."""
    cfg = model.config
    layers = cfg.num_hidden_layers
    kinds = getattr(cfg, "layer_types", None) or ["full_attention"] * layers
    if any(k != "full_attention" for k in kinds):
        raise ConfigError(f"{who} needs a model whose layers are all full attention, got layer "
                          f"types {sorted(set(kinds))}")
    return layers


def greedy_answers(model: Any, prompt: Tensor, cache: Any, n: int) -> list[tuple[int, ...]]:
    """Each row's greedy continuation of ``prompt`` through ``generate()`` with ``cache`` (which
    may already hold a prefix of it): ``n`` tokens, ending where the model ends it. A row that
    ends (``EOS``) early is right-padded with the pad token, so an answer that stops too soon
    never equals one of ``n`` tokens. ``EOS`` is not suppressed: the tasks' answers end with it.
    """
    pad = model.config.pad_token_id
    gen = model.generate(input_ids=prompt, cache=cache, do_sample=False, max_new_tokens=n,
                         pad_token_id=pad)
    rows = gen[:, prompt.shape[1]:].tolist()
    return [tuple(r) + (pad,) * (n - len(r)) for r in rows]


class ResidualLayer(CacheLayerMixin):
    """A layer that compresses its context once, after the prefill, and keeps every later token
    in full precision after it (the residual, in ``keys`` / ``values``). `RoutedLayer` and
    `kvevict.adapters.hf.heads.HeadLayer` add what they keep of the context."""

    is_sliding = False
    is_compileable = False

    def __init__(self, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.seen = 0  #: tokens fed so far (the sequence length)

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.keys = key_states[:, :, :0]
        self.values = value_states[:, :, :0]
        self.is_initialized = True

    def append(self, key_states: Tensor, value_states: Tensor) -> None:
        """Add a forward's new tokens to the residual."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.seen += key_states.shape[-2]
        self.keys = torch.cat([self.keys, key_states], dim=-2)
        self.values = torch.cat([self.values, value_states], dim=-2)

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return -1


class RoutedLayer(ResidualLayer):
    """One layer of a `RoutedCache`: quantized kept context tokens, then a full-precision
    residual of the tokens fed after the compression."""

    def __init__(self, layer_idx: int, route: Tuple) -> None:
        super().__init__(layer_idx)
        self.route = route
        self.compressed = False
        self.kept_positions: Tensor | None = None  #: [B, K] once compressed
        self.qkeys: QuantizedKV | Tensor | None = None
        self.qvalues: QuantizedKV | Tensor | None = None

    @property
    def stored(self) -> int:
        """Slots held: kept context tokens plus the residual."""
        return 0 if self.keys is None else int(self.keys.shape[-2]) + self._kept()

    def _kept(self) -> int:
        return 0 if self.kept_positions is None else int(self.kept_positions.shape[1])

    def _dequantized(self) -> tuple[Tensor, Tensor]:
        def dq(x: QuantizedKV | Tensor) -> Tensor:
            return x.dequantize(self.dtype) if isinstance(x, QuantizedKV) else x
        assert self.qkeys is not None and self.qvalues is not None
        return dq(self.qkeys), dq(self.qvalues)

    def update(self, key_states: Tensor, value_states: Tensor, *args: Any,
               **kwargs: Any) -> tuple[Tensor, Tensor]:
        self.append(key_states, value_states)
        if not self.compressed:
            return self.keys, self.values
        k, v = self._dequantized()
        return torch.cat([k, self.keys], dim=-2), torch.cat([v, self.values], dim=-2)

    def rerouted(self, route: Tuple) -> RoutedLayer:
        """A layer holding this (uncompressed) layer's prefill that will compress with
        ``route``. The prefill's tensors are shared, not copied: compressing gathers new ones
        and never writes into them."""
        if self.compressed:
            raise ConfigError("a compressed layer cannot be rerouted")
        layer = RoutedLayer(self.layer_idx, route)
        if self.is_initialized:
            layer.lazy_initialization(self.keys, self.values)
            layer.keys, layer.values, layer.seen = self.keys, self.values, self.seen
        return layer

    def compress(self, make_policy: Callable[[int], TokenPolicy]) -> None:
        """Keep this layer's share of the context and quantize it (once, after prefill);
        ``make_policy(budget)`` gives the token policy that chooses."""
        keys, values = self.keys, self.values
        batch, _, length, _ = keys.shape
        keep = kept_tokens(self.route.keep_ratio, length)
        positions = torch.arange(length, device=keys.device).expand(batch, length)
        valid = torch.ones((batch, length), dtype=torch.bool, device=keys.device)
        if keep < length:
            slots = make_policy(keep).select(self.layer_idx, keys, values, positions, valid)
        else:
            slots = positions
        index = slots[:, None, :, None]
        k = keys.gather(2, index.expand(-1, keys.shape[1], -1, keys.shape[3]))
        v = values.gather(2, index.expand(-1, values.shape[1], -1, values.shape[3]))
        self.kept_positions = slots
        kb, vb = self.route.key_bits, self.route.value_bits
        self.qkeys = k.contiguous() if kb is None else quantize(k, kb, axis="channel")
        self.qvalues = v.contiguous() if vb is None else quantize(v, vb, axis="token")
        self.keys, self.values = keys[:, :, :0], values[:, :, :0]
        self.compressed = True

    def nbytes(self) -> int:
        """Bytes held: the kept tokens (quantized or not) plus the residual."""
        def size(x: QuantizedKV | Tensor | None) -> int:
            if x is None:
                return 0
            return x.nbytes if isinstance(x, QuantizedKV) else x.numel() * x.element_size()
        residual = 0 if self.keys is None else size(self.keys) + size(self.values)
        return size(self.qkeys) + size(self.qvalues) + residual

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.stored + query_length, self.seen - self.stored


class RoutedCache(Cache):
    """A cache whose layers each keep their own ratio of the context at their own bit widths.

    Args:
        model: a decoder-only transformers model whose layers are all full attention.
        routing: one ``(keep_ratio, key_bits, value_bits)`` per layer (`kvevict.tokens.solver`;
            bits None = the model's dtype).
        token_policy: how each layer chooses its kept tokens: a name or an instance of a
            policy that needs no attention matrix. Default ``"knorm"``.
        token_params: parameters for a policy given by name (e.g. ``scorer=`` for ``lkv_t``).
    """

    def __init__(self, model: Any, routing: Sequence[Any], *,
                 token_policy: str | TokenPolicy = "knorm",
                 token_params: dict[str, Any] | None = None) -> None:
        layers = full_attention_layers(model, "RoutedCache")
        routes = [check_tuple(tuple(t)) for t in routing]
        if len(routes) != layers:
            raise ConfigError(f"routing has {len(routes)} tuples but the model has {layers} "
                              "layers; give one per layer")
        params = dict(token_params or {})
        if isinstance(token_policy, str):
            kind = TOKEN_POLICIES.get(token_policy)
            if isinstance(params.get("scorer"), (str, Path)) and "shape" not in params:
                params["shape"] = ScorerShape.of(model)
        elif isinstance(token_policy, TokenPolicy):
            if params:
                raise ConfigError("token_params were given together with a policy instance")
            kind = type(token_policy)
        else:
            raise ConfigError(f"token_policy must be a name or a TokenPolicy, got "
                              f"{type(token_policy).__name__}")
        if kind.needs_attention:
            raise ConfigError(f"RoutedCache compresses without an attention matrix; "
                              f"{token_policy!r} needs one (use knorm, streamingllm, lkv_t, kvp)")
        self.token_policy, self.token_params = token_policy, params
        self.routing = routes
        super().__init__(layers=[RoutedLayer(i, r) for i, r in enumerate(routes)])

    @property
    def compressed(self) -> bool:
        return all(layer.compressed for layer in self.layers)

    def compress(self) -> None:
        """Compress every layer now (call once, after the context's prefill)."""
        if self.compressed:
            raise ConfigError("this RoutedCache was already compressed")
        for layer in self.layers:
            if not layer.is_initialized:
                raise ConfigError("compress() needs a prefill first")
            layer.compress(self._policy_for)

    def rerouted(self, routing: Sequence[Any]) -> RoutedCache:
        """A cache holding this one's prefill (not compressed yet) that will compress with
        ``routing``: one prefill serves every routing calibration tries."""
        routes = [check_tuple(tuple(t)) for t in routing]
        if len(routes) != len(self.layers):
            raise ConfigError(f"routing has {len(routes)} tuples but the model has "
                              f"{len(self.layers)} layers; give one per layer")
        clone = copy.copy(self)
        clone.routing = routes
        clone.layers = [layer.rerouted(r) for layer, r in zip(self.layers, routes, strict=True)]
        return clone

    def _policy_for(self, budget: int) -> TokenPolicy:
        """The token policy keeping ``budget`` tokens (a copy of an instance)."""
        if isinstance(self.token_policy, str):
            return make_token_policy(self.token_policy, budget, **self.token_params)
        policy = copy.copy(self.token_policy)
        policy.budget = budget
        return policy

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        """The widest layer's sizes: a one-token forward's mask covers every layer."""
        stored = max(layer.stored for layer in self.layers)
        seen = self.layers[0].seen
        return stored + query_length, seen - stored

    def nbytes(self) -> int:
        """Bytes every layer holds (kept tokens at their bit widths plus the residual)."""
        return sum(layer.nbytes() for layer in self.layers)


@torch.no_grad()
def routed_answers(model: Any, items: Sequence[TaskItem], routing: Sequence[Any], *,
                   token_policy: str | TokenPolicy = "knorm",
                   token_params: dict[str, Any] | None = None,
                   batch: int = 16) -> tuple[list[tuple[int, ...]], int]:
    """Greedy answers under ``routing``: prefill the context, compress, then ``generate()``
    from the question on (under `routed_attention`). Returns the answers and the bytes one
    sequence's cache held right after the compression (the most over the batches)."""
    answers: list[tuple[int, ...]] = []
    held = 0
    with routed_attention(model):
        for start in range(0, len(items), batch):
            chunk = items[start:start + batch]
            cache = _compressed(model, chunk, routing, token_policy, token_params)
            held = max(held, cache.nbytes() // len(chunk))
            prompt = torch.tensor([it.prompt for it in chunk])
            n = len(chunk[0].answer)
            answers += greedy_answers(model, prompt, cache, n)
    return answers, held


def _prefilled(model: Any, items: Sequence[TaskItem], routing: Sequence[Any],
               token_policy: str | TokenPolicy, token_params: dict[str, Any] | None
               ) -> RoutedCache:
    """A `RoutedCache` holding ``items``' contexts, prefilled, not compressed yet."""
    (items,) = batches(items, len(items))  # one batch: equal lengths, checked
    cache = RoutedCache(model, routing, token_policy=token_policy, token_params=token_params)
    model(input_ids=torch.tensor([it.context for it in items]), cache=cache, use_cache=True)
    return cache


def _compressed(model: Any, items: Sequence[TaskItem], routing: Sequence[Any],
                token_policy: str | TokenPolicy, token_params: dict[str, Any] | None
                ) -> RoutedCache:
    """A `RoutedCache` holding ``items``' contexts, prefilled and compressed."""
    cache = _prefilled(model, items, routing, token_policy, token_params)
    cache.compress()
    return cache


@torch.no_grad()
def _answer_nll(model: Any, items: Sequence[TaskItem], cache: RoutedCache) -> float:
    """Mean negative log-likelihood of the answer tokens, teacher-forced, on ``cache`` (the
    items' contexts, compressed)."""
    ctx = len(items[0].context)
    rest = torch.tensor([(*it.question, *it.answer[:-1]) for it in items])
    logits = model(input_ids=rest, cache=cache, use_cache=True).logits.float()
    answer = torch.tensor([it.answer for it in items])
    first = len(items[0].prompt) - 1 - ctx  # the position predicting the first answer token
    logp = torch.log_softmax(logits[:, first:], dim=-1)
    return float(-logp.gather(2, answer[:, :, None]).mean())


@contextmanager
def _joint_nll(model: Any, items: Sequence[TaskItem], token_policy: str | TokenPolicy,
               token_params: dict[str, Any] | None
               ) -> Iterator[Callable[[Sequence[Tuple]], float]]:
    """Prefill ``items``' contexts once (one batch: equal lengths) and yield ``nll(routing)``:
    the answers' mean negative log-likelihood after that prefill is compressed with
    ``routing`` (`RoutedCache.rerouted`), remembered per routing. A prefill does not depend
    on the routing: every layer attends to its whole context until `RoutedCache.compress`."""
    whole = [Tuple(1.0, None, None)] * model.config.num_hidden_layers
    known: dict[tuple[Tuple, ...], float] = {}
    with routed_attention(model), torch.no_grad():
        prefill = _prefilled(model, items, whole, token_policy, token_params)

        def nll(routing: Sequence[Tuple]) -> float:
            key = tuple(routing)
            value = known.get(key)
            if value is None:
                cache = prefill.rerouted(list(key))
                cache.compress()
                value = known[key] = _answer_nll(model, items, cache)
            return value

        yield nll


def calibrate(model: Any, items: Sequence[TaskItem], tuples: Sequence[Any], *,
              token_policy: str | TokenPolicy = "knorm",
              token_params: dict[str, Any] | None = None) -> list[dict[Tuple, float]]:
    """MoE-nD's offline calibration: ``losses[l][t]``, the increase of the answers' mean
    negative log-likelihood when layer ``l`` alone is compressed with tuple ``t`` (every other
    layer kept whole, unquantized), on calibration ``items`` (one batch: equal lengths).

    The contexts are prefilled once; each tuple compresses that prefill
    (`RoutedCache.rerouted`)."""
    tuples = [check_tuple(tuple(t)) for t in tuples]
    whole = [Tuple(1.0, None, None)] * model.config.num_hidden_layers
    with _joint_nll(model, items, token_policy, token_params) as nll:
        return _losses_around(nll, whole, [tuples] * len(whole))


def _losses_around(nll: Callable[[Sequence[Tuple]], float], routing: Sequence[Tuple],
                   tuples: Sequence[Sequence[Tuple]]) -> list[dict[Tuple, float]]:
    """``losses[l][t]``: how much the answers' NLL rises when layer ``l`` of ``routing`` takes
    tuple ``t``, every other layer as ``routing`` has it (0 for ``routing``'s own tuple)."""
    base = nll(routing)
    table: list[dict[Tuple, float]] = []
    for layer, row in enumerate(tuples):
        table.append({t: 0.0 if t == routing[layer] else
                      nll([*routing[:layer], t, *routing[layer + 1:]]) - base for t in row})
    return table


def refine_route(model: Any, items: Sequence[TaskItem], costs: Sequence[Mapping[Any, int]],
                 budget_bytes: float, starts: Sequence[Sequence[Any]], *,
                 token_policy: str | TokenPolicy = "knorm",
                 token_params: dict[str, Any] | None = None,
                 rounds: int = 2) -> tuple[list[Tuple], float, list[float]]:
    """Routings checked, and improved, on the joint calibration loss.

    `route` adds up each layer's loss measured alone, with the other layers whole. On the
    judge those losses do not add up to the loss of the layers compressed together
    (``docs/tokens_quant.md``). This measures what `calibrate` measures around each
    candidate routing instead of around the whole cache. From the first of ``starts``
    (`route`'s routing, say), each round measures, for every layer and every tuple of
    ``costs``, the NLL of the current routing with that layer's tuple changed and the others
    as routed. It routes again on that table (`route`, whose additive assumption is then
    exact for any single change), and keeps the new routing when its joint NLL is lower. It
    stops after ``rounds`` rounds or at a round that lowers nothing. The other ``starts`` (the
    best uniform tuple, say) are measured as they are.

    Args:
        model, items, token_policy, token_params: as for `calibrate` (one batch of
            calibration items).
        costs: ``costs[layer][tuple]`` (`kvevict.tokens.solver.cost_table`); every tuple a
            layer may take.
        budget_bytes: the most bytes all layers together may take; every start must fit.
        starts: candidate routings, one tuple per layer each; the search starts from the
            first.
        rounds: search rounds from the first start (0: only measure the starts).

    Returns:
        The routing of lowest joint NLL (ties: the earliest found), its NLL, and the NLL of
        each start in order.

    Raises:
        ConfigError: no starts, a start of the wrong length or over the budget, or
            ``rounds`` below 0.
    """
    layers = model.config.num_hidden_layers
    if not starts:
        raise ConfigError("refine_route needs at least one start routing (route's, say)")
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 0:
        raise ConfigError(f"rounds must be an int >= 0, got {rounds!r}")
    routings = [[check_tuple(tuple(t)) for t in start] for start in starts]
    for i, routing in enumerate(routings):
        if len(routing) != layers:
            raise ConfigError(f"starts[{i}] has {len(routing)} tuples; the model has "
                              f"{layers} layers")
        spent = total_bytes(routing, costs)
        if spent > budget_bytes:
            raise ConfigError(f"starts[{i}] takes {spent} bytes, over the budget of "
                              f"{budget_bytes}")
    tuples = [[check_tuple(tuple(t)) for t in row] for row in costs]
    with _joint_nll(model, items, token_policy, token_params) as nll:
        measured = [nll(routing) for routing in routings]
        best = min(range(len(routings)), key=lambda i: (measured[i], i))
        chosen, lowest = routings[best], measured[best]
        current, here = routings[0], measured[0]
        for _ in range(rounds):
            moved = route(_losses_around(nll, current, tuples), costs, budget_bytes)
            there = nll(moved)
            if there >= here:
                break
            current, here = moved, there
            if here < lowest:
                chosen, lowest = current, here
    return chosen, lowest, measured
