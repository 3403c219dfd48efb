"""Real K/V quantization: asymmetric min-max integer codes at 2, 4 or 8 bits, packed into bytes.

`quantize` turns a float tensor (one layer's keys or values, ``[B, Hkv, T, D]``, or any tensor
whose last two axes are tokens and channels) into a `QuantizedKV`: integer codes packed into
``uint8``, one float16 scale ``s`` and one float16 zero point ``z`` per group. `dequantize
<QuantizedKV.dequantize>` gives the tensor back as ``code * s + z``. `kv_bytes` says what a
layer's K/V take for a number of tokens at given bit widths, so eviction (fewer tokens) and
quantization (fewer bits per token) are compared on one axis: bytes.

**Groups.** ``axis="token"`` groups along the last (channel, head) axis of each token: one
scale per token (per ``group_size`` channels). KIVI quantizes values this way. ``axis=
"channel"`` groups along the token axis (second to last) of each channel: one scale per channel
(per ``group_size`` tokens). KIVI quantizes keys this way, because a few key channels carry
outliers far larger than the rest and a per-token group would spend its whole range on them
(Liu et al., "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache", ICML 2024,
arXiv:2402.02750, section 3). ``group_size=None`` makes the whole axis one group. transformers'
``QuantizedCache`` exposes the same choice as ``axis_key`` / ``axis_value`` with
``q_group_size`` (its quanto and HQQ backends).

**Codes.** ``2**bits - 1`` levels, stored little-end first along the last axis: at 2 bits
element ``j`` of a row sits in byte ``j // 4`` at bit ``2 * (j % 4)``, at 4 bits in byte
``j // 2`` at bit ``4 * (j % 2)``, at 8 bits one per byte. A last axis that is not a multiple
of the codes per byte is padded with zero codes, so every token row owns whole bytes and the
packed codes can be gathered by token like the unquantized cache. The packing is that of HQQ's
``BitPack`` and KIVI's kernels in spirit (several codes per machine word); the exact bit order
is this module's own.

**Scales and zero points in float16.** KIVI's reference implementation keeps each group's
scale and minimum in the model's half precision (fp16), and HQQ (transformers'
``HQQQuantizedLayer``) keeps its metadata in the compute dtype, float16 by default. Fixing
float16 here makes the bytes independent of the model dtype (4 bytes per group) and covers
every value a half-precision model can hold. Inputs with ``|x| > 65504`` (float16's largest
finite value) are refused.

**The bound.** Each group's stored values are chosen so that rounding them to float16 cannot
break min-max coverage: ``z`` is the group minimum rounded *down* to float16 and ``s`` is
``(max - z) / (2**bits - 1)`` rounded *up* to float16: exactly, the smallest float16 with
``z + (2**bits - 1) * s >= max`` (checked in float64, where that product and sum are exact).
Every element then lies in ``[z, z + (2**bits - 1) * s]``, no code is clamped, and rounding to
the nearest code gives, for every element ``x`` with its group's stored ``s``:

    |x - (code * s + z)| <= s / 2 * (1 + 2**-40)

The ``2**-40`` covers the float64 arithmetic that picks the code. The fp16 rounding of the
scale and zero point is inside ``s`` itself, which is larger than the exact min-max scale
``(max - min) / (2**bits - 1)`` by at most ``(min - z) / (2**bits - 1)`` (``min - z`` is
below one float16 step at ``min``) plus one float16 step at ``s``. `dequantize
<QuantizedKV.dequantize>` computes ``code * s + z`` in float32 (float64 for a float64 output):
the product is exact (8-bit code times 11-bit significand), so for a float32 output the result
is the exact value rounded once, and a narrower output is rounded once more; the whole
dequantization adds at most ``(2**-23 + eps(dtype) / 2) * |result|`` (``2**-23``: the float32
step's ``2**-24`` with room for second-order terms) plus half the output dtype's smallest
subnormal (`dequant_error_bound`, used by the tests).

Bad input raises `kvevict.errors.ConfigError`: a bit width other than 2, 4 or 8, an axis other
than "token" or "channel", a group size that does not divide the grouped axis, NaN or inf
values, values outside float16's range.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any

import attrs
import torch
from torch import Tensor

from kvevict.errors import ConfigError
from kvevict.layout import DTYPE_ALIASES, KVLayout
from kvevict.tokens.base import check_int

__all__ = [
    "AXES",
    "BITS",
    "FP16_MAX",
    "META_BYTES",
    "QuantizedKV",
    "dequant_error_bound",
    "kv_bytes",
    "plane_bytes",
    "quantize",
]

#: The bit widths `quantize` accepts.
BITS: tuple[int, ...] = (2, 4, 8)
#: The grouping axes: "token" (groups along the channels of one token, KIVI's values) and
#: "channel" (groups along the tokens of one channel, KIVI's keys).
AXES: tuple[str, ...] = ("token", "channel")
#: float16's largest finite value; scales and zero points are stored in float16.
FP16_MAX = 65504.0
#: Bytes of one group's metadata: a float16 scale and a float16 zero point.
META_BYTES = 4

_CHECK_STEPS = 4  # float16 steps the rounded-up scale may be off by (one at most in practice)


# -- validation ------------------------------------------------------------------------------


def _check_bits(name: str, bits: Any) -> int:
    if isinstance(bits, bool) or not isinstance(bits, numbers.Integral) or int(bits) not in BITS:
        raise ConfigError(f"{name} must be one of {', '.join(map(str, BITS))}, got {bits!r}")
    return int(bits)


def _check_axis(name: str, axis: Any) -> str:
    if axis not in AXES:
        raise ConfigError(f"{name} must be one of {', '.join(map(repr, AXES))}, got {axis!r}")
    return axis


def _group(name: str, group_size: Any, length: int, what: str) -> int:
    """The resolved group size along an axis of ``length`` elements (None = the whole axis)."""
    if group_size is None:
        return length
    size = check_int(name, group_size, minimum=1)
    if length % size:
        raise ConfigError(f"{name} {size} does not divide the {what} length {length}; expected "
                          f"a divisor of {length} (or None: one group over the whole axis)")
    return size


def _codes_per_byte(bits: int) -> int:
    return 8 // bits


# -- float16 rounding with a direction -------------------------------------------------------


def _fp16_down(v: Tensor) -> Tensor:
    """float64 ``v`` rounded to float16 towards -inf (exact when representable)."""
    f = v.to(torch.float16)
    return torch.where(f.double() > v, torch.nextafter(f, torch.full_like(f, -math.inf)), f)


def _fp16_up(v: Tensor) -> Tensor:
    """float64 ``v`` rounded to float16 towards +inf (exact when representable)."""
    f = v.to(torch.float16)
    return torch.where(f.double() < v, torch.nextafter(f, torch.full_like(f, math.inf)), f)


# -- packing ---------------------------------------------------------------------------------


def _pack(codes: Tensor, bits: int) -> Tensor:
    """uint8 codes ``[..., D]`` -> packed uint8 ``[..., ceil(D / (8 // bits))]``."""
    per = _codes_per_byte(bits)
    if per == 1:
        return codes.contiguous()
    width = codes.shape[-1]
    pad = (-width) % per
    if pad:
        codes = torch.nn.functional.pad(codes, (0, pad))
    grouped = codes.reshape(*codes.shape[:-1], -1, per).to(torch.int32)
    shifts = torch.arange(per, device=codes.device, dtype=torch.int32) * bits
    return (grouped << shifts).sum(dim=-1).to(torch.uint8)


def _unpack(packed: Tensor, bits: int, width: int) -> Tensor:
    """The inverse of `_pack`: uint8 ``[..., width]`` codes."""
    per = _codes_per_byte(bits)
    if per == 1:
        return packed
    shifts = torch.arange(per, device=packed.device, dtype=torch.int32) * bits
    mask = (1 << bits) - 1
    codes = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & mask
    return codes.reshape(*packed.shape[:-1], -1)[..., :width].to(torch.uint8)


# -- the quantized tensor --------------------------------------------------------------------


def _meta_shape(shape: tuple[int, ...], axis: str, group: int) -> tuple[int, ...]:
    if axis == "token":
        return (*shape[:-1], shape[-1] // group)
    return (*shape[:-2], shape[-2] // group, shape[-1])


def _packed_shape(shape: tuple[int, ...], bits: int) -> tuple[int, ...]:
    per = _codes_per_byte(bits)
    return (*shape[:-1], -(-shape[-1] // per))


@attrs.frozen(eq=False)
class QuantizedKV:
    """A tensor stored as packed integer codes plus a float16 scale and zero point per group.

    Built by `quantize`. ``codes`` holds the packed codes (uint8, last axis
    ``ceil(D / (8 // bits))``), ``scales`` and ``zeros`` (float16) one entry per group:
    ``[..., T, D // group_size]`` for ``axis="token"``, ``[..., T // group_size, D]`` for
    ``axis="channel"``. ``dtype`` is the dtype of the tensor that was quantized (the default
    of `dequantize`).

    Raises:
        ConfigError: the parts do not fit together (wrong dtypes or shapes).
    """

    codes: Tensor
    scales: Tensor
    zeros: Tensor
    bits: int
    axis: str
    group_size: int
    shape: tuple[int, ...] = attrs.field(converter=tuple)
    dtype: torch.dtype

    def __attrs_post_init__(self) -> None:
        _check_bits("bits", self.bits)
        _check_axis("axis", self.axis)
        need = 1 if self.axis == "token" else 2
        if len(self.shape) < need:
            raise ConfigError(f"shape must have at least {need} axes for axis={self.axis!r}, "
                              f"got {list(self.shape)}")
        length = self.shape[-1] if self.axis == "token" else self.shape[-2]
        _group("group_size", self.group_size, length,
               "channel axis" if self.axis == "token" else "token axis")
        expected = {
            "codes": (self.codes, torch.uint8, _packed_shape(self.shape, self.bits)),
            "scales": (self.scales, torch.float16,
                       _meta_shape(self.shape, self.axis, self.group_size)),
            "zeros": (self.zeros, torch.float16,
                      _meta_shape(self.shape, self.axis, self.group_size)),
        }
        for name, (tensor, dtype, shape) in expected.items():
            if (not isinstance(tensor, Tensor) or tensor.dtype != dtype
                    or tuple(tensor.shape) != shape):
                got = (f"{tensor.dtype} {list(tensor.shape)}" if isinstance(tensor, Tensor)
                       else type(tensor).__name__)
                raise ConfigError(f"{name} must be a {dtype} tensor of shape {list(shape)}, "
                                  f"got {got}")

    @property
    def nbytes(self) -> int:
        """Exact storage in bytes: packed codes + float16 scales + float16 zero points."""
        return (self.codes.numel() * self.codes.element_size()
                + self.scales.numel() * self.scales.element_size()
                + self.zeros.numel() * self.zeros.element_size())

    def unpacked_codes(self) -> Tensor:
        """The integer codes, uint8 in the tensor's shape (values ``0 .. 2**bits - 1``)."""
        return _unpack(self.codes, self.bits, self.shape[-1])

    def expanded(self) -> tuple[Tensor, Tensor]:
        """``(scales, zeros)`` repeated to the tensor's shape (float16), one per element."""
        if self.axis == "token":
            dim = -1
        else:
            dim = -2
        return (self.scales.repeat_interleave(self.group_size, dim=dim),
                self.zeros.repeat_interleave(self.group_size, dim=dim))

    def dequantize(self, dtype: torch.dtype | None = None) -> Tensor:
        """The tensor back: ``code * scale + zero`` in ``dtype`` (default: the quantized one's).

        Computed in float32 (float64 for a float64 result), where the product is exact; see the
        module docstring for the error bound.
        """
        dtype = self.dtype if dtype is None else dtype
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ConfigError(f"dtype must be a float torch.dtype, got {dtype!r}")
        work = torch.float64 if dtype == torch.float64 else torch.float32
        scales, zeros = self.expanded()
        out = self.unpacked_codes().to(work) * scales.to(work) + zeros.to(work)
        return out.to(dtype)


# -- quantize --------------------------------------------------------------------------------


def quantize(x: Tensor, bits: int, *, axis: str = "token",
             group_size: int | None = None) -> QuantizedKV:
    """Asymmetric min-max quantization of ``x`` to ``bits`` bits in groups along ``axis``.

    Args:
        x: a float tensor of any float dtype (float8 included; upcast exactly). The last axis is
            the channel (head) axis, the one before it the token axis.
        bits: 2, 4 or 8.
        axis: ``"token"`` (groups along the last axis of each token; KIVI's choice for values)
            or ``"channel"`` (groups along the token axis of each channel; KIVI's for keys).
        group_size: elements per group along the grouped axis; must divide it. None: the whole
            axis is one group.

    Returns:
        A `QuantizedKV`; each element is within half its group's stored scale of ``x``
        (module docstring).

    Raises:
        ConfigError: bad ``bits``, ``axis`` or ``group_size``; ``x`` not a float tensor, with
            too few axes, with NaN or inf, or with values beyond float16's range.
    """
    bits = _check_bits("bits", bits)
    axis = _check_axis("axis", axis)
    if not isinstance(x, Tensor) or not x.is_floating_point():
        got = f"{x.dtype} tensor" if isinstance(x, Tensor) else type(x).__name__
        raise ConfigError(f"x must be a float tensor, got {got}")
    need = 1 if axis == "token" else 2
    if x.dim() < need:
        raise ConfigError(f"x must have at least {need} axes for axis={axis!r} (…, tokens, "
                          f"channels), got shape {list(x.shape)}")
    shape = tuple(x.shape)
    length = shape[-1] if axis == "token" else shape[-2]
    if length < 1:
        raise ConfigError(f"the grouped axis of x is empty (shape {list(shape)}, axis={axis!r})")
    group = _group("group_size", group_size, length,
                   "channel axis" if axis == "token" else "token axis")
    xd = x.detach().to(torch.float64)
    if xd.numel():
        nan = int(torch.isnan(xd).sum())
        inf = int(torch.isinf(xd).sum())
        if nan or inf:
            raise ConfigError(f"x must be finite; it has {nan} NaN and {inf} inf elements")
        peak = float(xd.abs().max())
        if peak > FP16_MAX:
            raise ConfigError(f"x has |value| up to {peak:g}, beyond float16's {FP16_MAX:g}: "
                              "scales and zero points are stored in float16")

    rows = xd if axis == "token" else xd.transpose(-1, -2)  # groups run along the last axis
    grouped = rows.reshape(*rows.shape[:-1], length // group, group)
    low = grouped.amin(dim=-1)
    high = grouped.amax(dim=-1)
    levels = (1 << bits) - 1
    zero = _fp16_down(low)
    scale = _fp16_up((high - zero.double()) / levels)
    # make ``scale`` the smallest float16 with ``zero + levels * scale >= high``: the division
    # above is rounded, the comparisons are exact in float64 (8-bit times 11-bit products)
    for _ in range(_CHECK_STEPS):
        short = zero.double() + levels * scale.double() < high
        if not bool(short.any()):
            break
        scale = torch.where(short, torch.nextafter(scale, torch.full_like(scale, math.inf)),
                            scale)
    for _ in range(_CHECK_STEPS):
        lower = torch.nextafter(scale, torch.zeros_like(scale))
        spare = (scale > 0) & (zero.double() + levels * lower.double() >= high)
        if not bool(spare.any()):
            break
        scale = torch.where(spare, lower, scale)
    s = scale.double().unsqueeze(-1)
    z = zero.double().unsqueeze(-1)
    steps = torch.where(s > 0, (grouped - z) / torch.where(s > 0, s, 1.0), 0.0)
    codes = steps.round().clamp(0, levels).to(torch.uint8).reshape(rows.shape)
    if axis == "channel":
        codes = codes.transpose(-1, -2)
        scale = scale.transpose(-1, -2)
        zero = zero.transpose(-1, -2)
    return QuantizedKV(codes=_pack(codes, bits), scales=scale.contiguous(),
                       zeros=zero.contiguous(), bits=bits, axis=axis, group_size=group,
                       shape=shape, dtype=x.dtype)


def dequant_error_bound(q: QuantizedKV, dtype: torch.dtype | None = None) -> Tensor:
    """Per element, float64 in the tensor's shape: the most ``|x - q.dequantize(dtype)|`` can be.

    ``s / 2 * (1 + 2**-40)`` (the quantization) plus ``(2**-23 + eps(dtype) / 2) * |result|``
    plus half the smallest subnormal of ``dtype`` (the float rounding of the dequantization);
    for a float64 result only the first term (the dequantization is exact there).
    """
    dtype = q.dtype if dtype is None else dtype
    scales, _ = q.expanded()
    bound = scales.double() / 2 * (1 + 2.0 ** -40)
    if dtype == torch.float64:
        return bound
    info = torch.finfo(dtype)
    result = q.dequantize(dtype).double().abs()
    return bound + (2.0 ** -23 + info.eps / 2) * result + info.smallest_normal * info.eps / 2


# -- bytes -----------------------------------------------------------------------------------


def plane_bytes(shape: Sequence[int], bits: int | None, *, axis: str = "token",
                group_size: int | None = None,
                dtype: torch.dtype | str = torch.float16) -> int:
    """Bytes of a tensor of ``shape``: unquantized in ``dtype`` (``bits=None``) or as `quantize`
    stores it (equal to `QuantizedKV.nbytes`).

    Quantized: ``prod(shape[:-1]) * ceil(D / (8 // bits))`` code bytes plus 4 bytes per group
    (``prod(shape) / group_size`` groups; ``group_size=None`` is the whole grouped axis).
    """
    shape = tuple(shape)
    for n in shape:
        check_int("shape entry", n, minimum=0)
    if bits is None:
        itemsize = _dtype(dtype).itemsize
        return math.prod(shape) * itemsize
    bits = _check_bits("bits", bits)
    axis = _check_axis("axis", axis)
    need = 1 if axis == "token" else 2
    if len(shape) < need:
        raise ConfigError(f"shape must have at least {need} axes for axis={axis!r}, "
                          f"got {list(shape)}")
    length = shape[-1] if axis == "token" else shape[-2]
    if length < 1:
        raise ConfigError(f"the grouped axis is empty (shape {list(shape)}, axis={axis!r})")
    group = _group("group_size", group_size, length,
                   "channel axis" if axis == "token" else "token axis")
    codes = math.prod(_packed_shape(shape, bits))
    return codes + META_BYTES * math.prod(_meta_shape(shape, axis, group))


def _dtype(dtype: torch.dtype | str) -> torch.dtype:
    """A torch dtype, or one of `kvevict.layout.DTYPE_ALIASES`' spellings."""
    if isinstance(dtype, torch.dtype):
        return dtype
    key = dtype.strip().lower().removeprefix("torch.") if isinstance(dtype, str) else None
    if key not in DTYPE_ALIASES:
        raise ConfigError(f"unknown dtype {dtype!r}; expected a torch.dtype or one of: "
                          + ", ".join(DTYPE_ALIASES))
    return DTYPE_ALIASES[key]


def kv_bytes(layout: KVLayout | tuple[int, int, torch.dtype | str], tokens: int,
             key_bits: int | None = None, value_bits: int | None = None, *,
             group_size: int | None = None, key_group_size: int | None = None,
             value_group_size: int | None = None, key_axis: str = "channel",
             value_axis: str = "token", batch: int = 1) -> int:
    """Bytes one layer's K and V take for ``tokens`` tokens of ``batch`` sequences.

    Args:
        layout: a `KVLayout` (one of its layers is counted) or ``(num_kv_heads, head_dim,
            dtype)``.
        tokens: cached tokens per sequence (after eviction), >= 0.
        key_bits, value_bits: 2, 4 or 8, or None for unquantized (the layout's dtype).
        group_size: `quantize`'s group size for both planes (None: the whole grouped axis).
        key_group_size, value_group_size: a group size for one plane, replacing
            ``group_size`` there (keys group along tokens, values along channels by default,
            so one size rarely divides both).
        key_axis, value_axis: the grouping axes; default KIVI's (keys per channel, values per
            token).
        batch: sequences.

    Each plane is ``[batch, num_kv_heads, tokens, head_dim]``, counted by `plane_bytes`, so the
    total equals ``quantize(k, ...).nbytes + quantize(v, ...).nbytes`` for those tensors. The
    judge model (float32, 2 kv heads, head_dim 64) at 1000 tokens: 1024000 bytes unquantized,
    ``kv_bytes(layout, 1000, 4, 4, group_size=None)`` = 64000 + 512 (keys: one group per channel
    per head, 2 * 64 groups) + 64000 + 8000 (values: one group per token per head, 2000
    groups) = 136512.

    Raises:
        ConfigError: an MLA layout (one latent plane, no separate K and V), bad bits, axis or
            group size, or a negative token count.
    """
    if isinstance(layout, KVLayout):
        if layout.kv_planes != 2:
            raise ConfigError(f"kv_bytes counts separate K and V planes; layout "
                              f"{layout.attention!r} caches {layout.kv_planes} plane per token")
        heads, dim, dtype = layout.num_kv_heads, layout.head_dim, layout.dtype
    elif isinstance(layout, tuple) and len(layout) == 3:
        heads = check_int("num_kv_heads", layout[0], minimum=1)
        dim = check_int("head_dim", layout[1], minimum=1)
        dtype = _dtype(layout[2])
    else:
        raise ConfigError("layout must be a KVLayout or a (num_kv_heads, head_dim, dtype) tuple, "
                          f"got {type(layout).__name__}")
    tokens = check_int("tokens", tokens, minimum=0)
    batch = check_int("batch", batch, minimum=1)
    shape = (batch, heads, tokens, dim)
    if tokens == 0:
        return 0
    key_group = group_size if key_group_size is None else key_group_size
    value_group = group_size if value_group_size is None else value_group_size
    return (plane_bytes(shape, key_bits, axis=key_axis, group_size=key_group, dtype=dtype)
            + plane_bytes(shape, value_bits, axis=value_axis, group_size=value_group,
                          dtype=dtype))
