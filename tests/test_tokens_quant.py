"""K/V quantization: exact codes, scales and bytes on hand-built tensors, the round-trip bound on
random tensors of every dtype / bit width / axis / group size, the byte formula, bad input."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from kvevict.errors import ConfigError
from kvevict.layout import KVLayout
from kvevict.tokens.quant import (
    QuantizedKV,
    dequant_error_bound,
    kv_bytes,
    plane_bytes,
    quantize,
)

torch.set_num_threads(1)

FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.float8_e4m3fn)
#: The first judge's shape (4 query heads of 32); the shipped judge has 2 of 64.
JUDGE = KVLayout.gqa(4, 4, 2, 32, "float32")


def fp16_steps(value: float, steps: int) -> float:
    """``value`` (a float16) moved ``steps`` float16 steps up (negative: down)."""
    t = torch.tensor(value, dtype=torch.float16)
    towards = torch.tensor(math.inf if steps > 0 else -math.inf, dtype=torch.float16)
    for _ in range(abs(steps)):
        t = torch.nextafter(t, towards)
    return float(t)


# -- hand-built tensors ----------------------------------------------------------------------


def test_per_token_two_bits_exact():
    x = torch.tensor([[0.0, 1.0, 2.0, 3.0], [-1.0, -1.0, -1.0, -1.0]])
    q = quantize(x, 2)
    assert q.unpacked_codes().tolist() == [[0, 1, 2, 3], [0, 0, 0, 0]]
    # 2 bits, little end first: 0 | 1 << 2 | 2 << 4 | 3 << 6 = 228
    assert q.codes.tolist() == [[228], [0]]
    assert q.codes.dtype == torch.uint8
    assert q.scales.dtype == q.zeros.dtype == torch.float16
    assert q.scales.tolist() == [[1.0], [0.0]]  # a constant group has scale 0
    assert q.zeros.tolist() == [[0.0], [-1.0]]
    assert q.nbytes == 2 + 2 * 2 + 2 * 2
    assert torch.equal(q.dequantize(), x)
    assert q.shape == (2, 4) and q.dtype == torch.float32


def test_per_channel_four_bits_rounds_scale_up_and_zero_down():
    # channel 0 spans [0, 1.5]: 1.5 / 15 = 0.1 is not a float16; the nearest float16 is below
    # 0.1, so the stored scale is the next one up. Channel 1 is constant 0.3, not a float16:
    # the zero point is the float16 below 0.3 and a subnormal scale covers the rest.
    x = torch.tensor([[0.0, 0.3], [0.5, 0.3], [1.0, 0.3], [1.5, 0.3]], dtype=torch.float64)
    q = quantize(x, 4, axis="channel")
    tenth_up = fp16_steps(float(torch.tensor(0.1, dtype=torch.float16)), 1)
    assert tenth_up == 0.10003662109375
    z1 = 0.2998046875  # the float16 just below 0.3
    assert fp16_steps(z1, 1) > 0.3
    s1 = 219 * 2.0 ** -24  # ceil((0.3 - z1) / 15 / 2**-24) steps of the smallest subnormal
    assert q.scales.double().tolist() == [[tenth_up, s1]]
    assert q.zeros.double().tolist() == [[0.0, z1]]
    assert q.unpacked_codes().tolist() == [[0, 15], [5, 15], [10, 15], [15, 15]]
    # 4 bits: channel 0 in the low nibble, channel 1 in the high one
    assert q.codes.tolist() == [[0xF0], [0xF5], [0xFA], [0xFF]]
    expected = [[c * tenth_up, z1 + 15 * s1] for c in (0, 5, 10, 15)]
    assert q.dequantize().tolist() == expected
    assert q.nbytes == 4 + 2 * 2 + 2 * 2


def test_groups_and_odd_width_packing():
    # 3 channels at 4 bits: two bytes per token, the last high nibble is padding (zero)
    x = torch.tensor([[0.0, 7.5, 15.0], [1.0, 2.0, 3.0]])
    q = quantize(x, 4)
    assert q.codes.shape == (2, 2)
    # row 0: 7.5 / 1 ties to even (8); row 1: the scale is 2 / 15 rounded up, so 1 / s < 7.5
    assert q.unpacked_codes().tolist() == [[0, 8, 15], [0, 7, 15]]
    assert q.codes.tolist() == [[0x80, 0x0F], [0x70, 0x0F]]
    assert q.nbytes == 4 + 2 * 2 + 2 * 2
    # per-token groups of 2 along 4 channels: two scales per token
    y = torch.tensor([[0.0, 3.0, 10.0, 16.0]])
    g = quantize(y, 2, group_size=2)
    assert g.scales.tolist() == [[1.0, 2.0]] and g.zeros.tolist() == [[0.0, 10.0]]
    assert g.unpacked_codes().tolist() == [[0, 3, 0, 3]]
    # per-channel groups of 2 tokens: two scales per channel
    col = torch.tensor([[0.0], [255.0], [10.0], [520.0], [11.0]])[:4]
    c = quantize(col, 8, axis="channel", group_size=2)
    assert c.scales.tolist() == [[1.0], [2.0]] and c.zeros.tolist() == [[0.0], [10.0]]
    assert c.unpacked_codes().flatten().tolist() == [0, 255, 0, 255]
    assert torch.equal(c.dequantize(), col)


def test_eight_bits_keeps_one_code_per_byte_and_dtype():
    x = torch.linspace(-2, 2, 256, dtype=torch.bfloat16).reshape(1, 1, 8, 32)
    q = quantize(x, 8, axis="channel")
    assert q.codes.shape == (1, 1, 8, 32)
    assert q.dequantize().dtype == torch.bfloat16
    assert q.dequantize(torch.float32).dtype == torch.float32
    assert q.nbytes == 256 + 4 * 32


# -- the bound ---------------------------------------------------------------------------------


@st.composite
def cases(draw):
    dtype = draw(st.sampled_from(FLOATS))
    bits = draw(st.sampled_from((2, 4, 8)))
    axis = draw(st.sampled_from(("token", "channel")))
    tokens = draw(st.integers(1, 12))
    dim = draw(st.integers(1, 10))
    length = dim if axis == "token" else tokens
    group = draw(st.sampled_from([None, *[g for g in range(1, length + 1) if length % g == 0]]))
    scale = draw(st.sampled_from((1e-6, 1e-3, 1.0, 30.0, 3e3)))
    offset = draw(st.sampled_from((0.0, 0.3, -100.0)))
    seed = draw(st.integers(0, 2**31 - 1))
    return dtype, bits, axis, group, (2, tokens, dim), scale, offset, seed


def limits(q: QuantizedKV, x: Tensor) -> tuple[Tensor, Tensor]:
    """Each element's group minimum and maximum, broadcast to ``x``'s shape (float64)."""
    xd = x.double()
    rows = xd if q.axis == "token" else xd.transpose(-1, -2)
    grouped = rows.reshape(*rows.shape[:-1], -1, q.group_size)
    low = grouped.amin(-1, keepdim=True).expand_as(grouped).reshape(rows.shape)
    high = grouped.amax(-1, keepdim=True).expand_as(grouped).reshape(rows.shape)
    if q.axis == "channel":
        low, high = low.transpose(-1, -2), high.transpose(-1, -2)
    return low, high





@settings(max_examples=60, deadline=None)
@given(cases())
def test_round_trip_within_bound(case):
    dtype, bits, axis, group, shape, scale, offset, seed = case
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=gen, dtype=torch.float64) * scale + offset).to(dtype)
    q = quantize(x, bits, axis=axis, group_size=group)
    levels = 2**bits - 1
    codes = q.unpacked_codes()
    assert int(codes.max()) <= levels
    s, z = (t.double() for t in q.expanded())
    low, high = limits(q, x)
    # the stored zero is the largest float16 <= the group minimum, and the stored scale the
    # smallest float16 that covers the group maximum from it
    assert (z <= low).all()
    up = torch.nextafter(q.zeros, torch.full_like(q.zeros, math.inf))
    z_up = QuantizedKV(q.codes, q.scales, up, q.bits, q.axis, q.group_size, q.shape,
                       q.dtype).expanded()[1].double()
    assert (z_up > low).all()
    assert (z + levels * s >= high).all()
    down = torch.nextafter(q.scales, torch.zeros_like(q.scales))
    s_down = QuantizedKV(q.codes, down, q.zeros, q.bits, q.axis, q.group_size, q.shape,
                         q.dtype).expanded()[0].double()
    assert ((s == 0) | (z + levels * s_down < high)).all()
    # the round-trip error, for the quantized dtype and for float32 and float64 results
    for out in {dtype, torch.float32, torch.float64}:
        err = (x.double() - q.dequantize(out).double()).abs()
        assert (err <= dequant_error_bound(q, out)).all(), (out, float(err.max()))
    # exact results: float64 dequantization is ``code * s + z`` with no rounding
    assert torch.equal(q.dequantize(torch.float64), codes.double() * s + z)
    assert (x.double() - q.dequantize(torch.float64)).abs().le(s / 2 * (1 + 2.0**-40)).all()


def test_bound_is_tight_at_two_bits():
    # the midpoint between two levels is as far as an element can be: exactly s / 2
    x = torch.tensor([[0.0, 0.5, 3.0]], dtype=torch.float64)
    q = quantize(x, 2)
    assert float(q.scales) == 1.0
    err = (x - q.dequantize()).abs()
    assert err.tolist() == [[0.0, 0.5, 0.0]]


def test_bits_shrink_the_error():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(1, 2, 64, 32, generator=gen)
    errors = [float((x - quantize(x, b, axis="channel").dequantize()).abs().max())
              for b in (2, 4, 8)]
    assert errors[0] > errors[1] > errors[2]
    assert errors[2] < 0.05


# -- bytes -----------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("group", [None, 8])
def test_nbytes_equals_the_formula(bits, group):
    gen = torch.Generator().manual_seed(bits)
    k = torch.randn(1, 2, 40, 32, generator=gen)
    v = torch.randn(1, 2, 40, 32, generator=gen)
    qk = quantize(k, bits, axis="channel", group_size=group)
    qv = quantize(v, bits, axis="token", group_size=group)
    assert qk.nbytes == plane_bytes(k.shape, bits, axis="channel", group_size=group)
    assert qv.nbytes == plane_bytes(v.shape, bits, axis="token", group_size=group)
    assert qk.nbytes + qv.nbytes == kv_bytes(JUDGE, 40, bits, bits, group_size=group)
    codes = 2 * 40 * 32 * bits // 8
    k_groups = 2 * 32 * (1 if group is None else 40 // group)
    v_groups = 2 * 40 * (1 if group is None else 32 // group)
    assert qk.nbytes == codes + 4 * k_groups
    assert qv.nbytes == codes + 4 * v_groups


def test_kv_bytes_judge_example():
    assert kv_bytes(JUDGE, 1000) == 2 * 2 * 1000 * 32 * 4 == 512000
    assert kv_bytes(JUDGE, 1000, 4, 4) == 32000 + 256 + 32000 + 8000 == 72256
    assert kv_bytes(JUDGE, 1000, 2, None) == 16000 + 256 + 256000
    assert (kv_bytes(JUDGE, 1000, 8, 8, key_group_size=50, value_group_size=16)
            == 64000 + 4 * 2 * 20 * 32 + 64000 + 4 * 2 * 1000 * 2)
    assert kv_bytes((2, 32, "float16"), 10) == 2 * 2 * 10 * 32 * 2
    assert kv_bytes(JUDGE, 0, 2, 2) == 0
    assert kv_bytes(JUDGE, 10, batch=3) == 3 * kv_bytes(JUDGE, 10)
    assert JUDGE.bytes_per_token * 1000 == JUDGE.num_layers * kv_bytes(JUDGE, 1000)


# -- bad input -------------------------------------------------------------------------------


def test_bad_input():
    x = torch.randn(4, 8)
    with pytest.raises(ConfigError, match="bits must be one of 2, 4, 8, got 3"):
        quantize(x, 3)
    with pytest.raises(ConfigError, match="bits must be one of 2, 4, 8"):
        kv_bytes(JUDGE, 10, 16, None)
    with pytest.raises(ConfigError, match="group_size 3 does not divide the channel axis "
                                          "length 8"):
        quantize(x, 4, group_size=3)
    with pytest.raises(ConfigError, match="group_size 3 does not divide the token axis length 4"):
        quantize(x, 4, axis="channel", group_size=3)
    with pytest.raises(ConfigError, match="group_size 7 does not divide the token axis length 10"):
        kv_bytes(JUDGE, 10, 4, 4, group_size=7)
    with pytest.raises(ConfigError, match="axis must be one of 'token', 'channel'"):
        quantize(x, 4, axis="head")
    nan = x.clone()
    nan[0, 0] = math.nan
    with pytest.raises(ConfigError, match="1 NaN and 0 inf"):
        quantize(nan, 4)
    inf = x.clone()
    inf[1, 1] = -math.inf
    with pytest.raises(ConfigError, match="0 NaN and 1 inf"):
        quantize(inf, 4)
    with pytest.raises(ConfigError, match="beyond float16's 65504"):
        quantize(x * 1e5, 8)
    with pytest.raises(ConfigError, match="float tensor"):
        quantize(torch.ones(2, 2, dtype=torch.int32), 4)
    with pytest.raises(ConfigError, match="at least 2 axes"):
        quantize(torch.ones(4), 4, axis="channel")
    with pytest.raises(ConfigError, match="separate K and V"):
        kv_bytes(KVLayout.mla(2, 16, 8, "float16"), 10, 4, 4)
    with pytest.raises(ConfigError, match="tokens must be >= 0"):
        kv_bytes(JUDGE, -1)
    q = quantize(x, 4)
    with pytest.raises(ConfigError, match=r"scales must be a torch\.float16 tensor"):
        QuantizedKV(q.codes, q.scales.float(), q.zeros, 4, "token", 8, q.shape, q.dtype)
