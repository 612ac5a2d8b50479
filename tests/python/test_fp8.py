"""mok.fp8 (PyTorch) against the C++ host implementation (mok/fp8.hpp) byte for byte, and
the properties of the scaling: the block's largest magnitude fits, the error stays within
half a quantum, the MXFP8 conversion changes no value. CPU only."""

import pytest
import torch

import mok
from mok import fp8


def _data(rows, cols, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g)
    return x * torch.pow(2.0, (torch.arange(rows * cols) % 9 - 4).float()).reshape(rows, cols)


@pytest.mark.parametrize("block", [(1, 128), (128, 128), (1, 48)])
def test_bytes_equal_the_cpp_implementation(block):
    x = _data(200, 300, 3)
    x[5, :7] = 0.0
    x[7, 0] = 1e6  # saturates nowhere: the scale takes it
    values, exponents = fp8.quantize(x, block)
    cpp_values, cpp_exponents = mok._C.fp8_quantize(x.numpy(), *block)
    assert values.view(torch.uint8).flatten().tolist() == list(cpp_values)
    assert exponents.flatten().tolist() == list(cpp_exponents)


def test_scale_fits_the_block_and_error_is_within_half_a_quantum():
    x = _data(130, 256, 5)
    for block in ((1, 128), (128, 128)):
        values, e = fp8.quantize(x, block)
        y = fp8.dequantize(values, e, block)
        scale = torch.ldexp(torch.ones_like(x), e.repeat_interleave(block[0], 0)[:130]
                            .repeat_interleave(block[1], 1)[:, :256].float())
        scaled = (x / scale).abs()
        assert scaled.max() <= fp8.E4M3_MAX
        binade = torch.where(scaled >= 2.0 ** -6, torch.floor(torch.log2(scaled)), torch.full_like(scaled, -6.0))
        assert ((x - y).abs() <= torch.ldexp(scale, binade - 4)).all()


def test_experts_are_quantized_independently():
    w = _data(4 * 128, 256, 8).reshape(4, 128, 256)
    w[2] *= 1000.0
    values, e = fp8.quantize(w, (128, 128))
    assert e.shape == (4, 1, 2)
    for i in range(4):
        v, ei = fp8.quantize(w[i], (128, 128))
        assert torch.equal(values[i].view(torch.uint8), v.view(torch.uint8)) and torch.equal(e[i], ei)


def test_mxfp8_conversion_changes_no_value():
    x = _data(130, 320, 11)
    for block in ((1, 128), (128, 128)):
        values, e = fp8.quantize(x, block)
        mx_values, e8m0 = fp8.to_mxfp8(values, e, block)
        assert e8m0.shape == (130, 10) and e8m0.dtype == torch.uint8
        assert torch.equal(fp8.dequantize_mxfp8(mx_values, e8m0), fp8.dequantize(values, e, block))
    with pytest.raises(ValueError, match="multiple of 32"):
        fp8.to_mxfp8(*fp8.quantize(x, (1, 48)), (1, 48))
