"""mok.fp8 (PyTorch) against the C++ host implementation (mok/fp8.hpp) byte for byte, and
the properties of the scaling: the block's largest magnitude fits, the error stays within
half a quantum, the MXFP8 conversion changes no value. On a Hopper GPU also the CUDA weight
quantization (mok.fp8.quantize_weights) against mok.fp8.quantize."""

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


@pytest.mark.parametrize("scale", [1e-45, 1e-40, 1e-37, 1e-36, 1.0, 1e38])
def test_bytes_equal_the_cpp_implementation_at_the_ends_of_the_range(scale):
    """Blocks whose amax is tiny (torch.ldexp's 2^-e overflowed past e < -127: every value of a
    1e-37 block came back as 448 2^e) or subnormal (the C++ host's log2 underflowed and its loop
    never ended), and near the largest float."""
    x = _data(4, 256, 5) * scale
    for block in ((1, 128), (2, 128)):
        values, exponents = fp8.quantize(x, block)
        cpp_values, cpp_exponents = mok._C.fp8_quantize(x.numpy(), *block)
        assert values.view(torch.uint8).flatten().tolist() == list(cpp_values)
        assert exponents.flatten().tolist() == list(cpp_exponents)
    tiny = torch.zeros(1, 128)
    tiny[0, :3] = torch.tensor([1e-37, 5e-38, 3.3e-38])
    again = fp8.dequantize(*fp8.quantize(tiny))
    assert torch.allclose(again[0, :3], tiny[0, :3], rtol=0.07, atol=0)


def test_scales_stay_in_e8m0_range_so_every_tensor_converts_to_mxfp8():
    """A block whose amax is below 1.75 2^-119 takes the scale 2^-127 (E8M0's smallest), so that
    to_mxfp8 takes any tensor this module quantizes, tiny blocks included, and gives back its values."""
    x = _data(4, 256, 9) * torch.tensor([1e-45, 1e-40, 1e-36, 1.0]).repeat_interleave(64).repeat(4, 1)
    values, exponents = fp8.quantize(x, (1, 128))
    assert exponents.min().item() == -127 and exponents.max().item() <= 127
    mx_values, e8m0 = fp8.to_mxfp8(values, exponents, (1, 128))
    assert torch.equal(fp8.dequantize_mxfp8(mx_values, e8m0), fp8.dequantize(values, exponents, (1, 128)))
    cpp_values, cpp_exponents = mok._C.fp8_quantize(x.numpy(), 1, 128)
    assert exponents.flatten().tolist() == list(cpp_exponents)
    assert values.view(torch.uint8).flatten().tolist() == list(cpp_values)


def test_non_finite_values_quantize_as_the_cpp_implementation():
    """NaN takes no part in a block's amax and stays NaN (one byte, 0x7f); an infinity gives
    the block the scale 2^0 (as the kernels) and saturates to 448."""
    x = _data(2, 256, 6)
    x[0, 0], x[0, 5], x[1, 3], x[1, 200] = float("inf"), float("nan"), float("-inf"), -float("nan")
    values, exponents = fp8.quantize(x, (1, 128))
    cpp_values, cpp_exponents = mok._C.fp8_quantize(x.numpy(), 1, 128)
    assert values.view(torch.uint8).flatten().tolist() == list(cpp_values)
    assert exponents.flatten().tolist() == list(cpp_exponents)
    assert exponents[0, 0] == 0 and exponents[1, 0] == 0 and exponents[0, 1] != 0


def test_exponents_of_another_block_are_refused():
    x = _data(256, 256, 12)
    values, e = fp8.quantize(x, (128, 128))
    with pytest.raises(ValueError, match="'exponents' shape must be"):
        fp8.to_mxfp8(values, e)  # (the default block is (1, 128))
    with pytest.raises(ValueError, match="'exponents' shape must be"):
        fp8.dequantize(values, e, (1, 128))
    with pytest.raises(ValueError, match="'e8m0' shape must be"):
        fp8.dequantize_mxfp8(values, torch.zeros(2, 8, dtype=torch.uint8))
    with pytest.raises(ValueError, match="'block' must be"):
        fp8.quantize(x, 128)


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


hopper = torch.cuda.is_available() and torch.cuda.get_device_capability(0) == (9, 0)


@pytest.mark.skipif(not hopper, reason="needs a Hopper GPU")
@pytest.mark.parametrize("concatenated", [False, True])
def test_gpu_weight_quantization_equals_quantize(concatenated):
    g = torch.Generator().manual_seed(11)
    rows, cols = 200, 320
    w = torch.randn(3, 2 * rows if concatenated else rows, cols, generator=g)
    w = (w * torch.pow(2.0, torch.randint(-20, 20, (3, 1, 1), generator=g).float())).to(torch.bfloat16).cuda()
    if concatenated:
        w = w[:, rows:]  # the up half of [E, 2I, H]: a strided view
    values, exponents = fp8.quantize_weights(w)
    want_values, want_exponents = fp8.quantize(w.float().cpu(), block=(128, 128))  # (checked against C++ above)
    assert torch.equal(values.view(torch.uint8).cpu(), want_values.view(torch.uint8).cpu())
    assert torch.equal(exponents.cpu(), want_exponents.cpu())


@pytest.mark.skipif(not hopper, reason="needs a Hopper GPU")
def test_gpu_transposed_weight_quantization_is_the_transposes():
    g = torch.Generator().manual_seed(12)
    w = (torch.randn(2, 200, 320, generator=g) * 0.02).to(torch.bfloat16).cuda()
    values, exponents = fp8.quantize_weights(w, transpose=True)
    want_values, want_exponents = fp8.quantize(w.float().cpu().transpose(1, 2).contiguous(), block=(128, 128))
    assert values.shape == (2, 320, 200) and exponents.shape == (2, 3, 2)
    assert torch.equal(values.view(torch.uint8).cpu(), want_values.view(torch.uint8))
    assert torch.equal(exponents.cpu(), want_exponents)
    plain_values, plain_exponents = fp8.quantize_weights(w)
    assert torch.equal(values.view(torch.uint8), plain_values.view(torch.uint8).transpose(1, 2))
    assert torch.equal(exponents, plain_exponents.transpose(1, 2))


def test_weight_quantization_refuses_bad_input():
    with pytest.raises(TypeError, match="w must be a CUDA bfloat16 tensor"):
        fp8.quantize_weights(torch.zeros(2, 128, 128))
    with pytest.raises(ValueError, match=r"w must be a CUDA bfloat16 tensor \[E, rows, cols\], got torch.bfloat16 "
                                         r"\(2, 128, 128\) on cpu"):
        fp8.quantize_weights(torch.zeros(2, 128, 128, dtype=torch.bfloat16))


def test_strides_of_size_one_dimensions_are_not_read():
    """PyTorch 1.13 to 2.9 exported a DLPack stride of 1 for every dimension of size 1: an E = 1
    expert stack [1, rows, cols] came with strides (1, cols, 1), and the exponents of I = 128,
    [E, 1, n], with (n, 1, 1) — refused as overlapping rows. The extension takes such a stride as
    the extent of the dimensions after it, so these arguments pass the shape and row checks and
    reach the device check that follows them (CPU tensors: refused there, before any launch)."""
    from mok import _C

    on_cpu = "argument 'w': must be on a CUDA device, got cpu"
    w = torch.zeros(1, 256, 128, dtype=torch.bfloat16).as_strided((1, 256, 128), (1, 128, 1))
    with pytest.raises(ValueError, match=on_cpu):
        _C.fp8_quantize_weights(w, torch.zeros(1, 256, 128, dtype=torch.uint8),
                                torch.zeros(1, 2, 1, dtype=torch.int32).as_strided((1, 2, 1), (1, 1, 1)), 0)
    rows = torch.zeros(2, 1, 2, dtype=torch.int32).as_strided((2, 1, 2), (2, 1, 1))  # ([E, 1, n] exponents)
    with pytest.raises(ValueError, match=on_cpu):
        _C.fp8_quantize_weights(torch.zeros(2, 128, 256, dtype=torch.bfloat16), torch.zeros(2, 128, 256, dtype=torch.uint8),
                                rows, 0)
    # (a real overlap is still refused: two experts on the same rows)
    overlapping = torch.zeros(2, 256, 128, dtype=torch.bfloat16).as_strided((2, 256, 128), (128, 128, 1))
    with pytest.raises(ValueError, match="argument 'w': must have contiguous, non-overlapping rows"):
        _C.fp8_quantize_weights(overlapping, torch.zeros(2, 256, 128, dtype=torch.uint8),
                                torch.zeros(2, 2, 1, dtype=torch.int32), 0)


def test_recipe_reference_takes_a_concatenated_gate_up():
    g = torch.Generator().manual_seed(8)
    x = torch.randn(6, 128, generator=g).bfloat16()
    ids = torch.tensor([[0, 1], [1, -1], [2, 0], [1, 2], [0, 2], [2, 1]], dtype=torch.int32)
    w = torch.rand(6, 2, generator=g)
    gate, up = (torch.randn(3, 128, 128, generator=g).bfloat16() * 0.1 for _ in range(2))
    down = torch.randn(3, 128, 128, generator=g).bfloat16() * 0.1
    assert torch.equal(fp8.moe_reference(x, ids, w, torch.cat([gate, up], 1), None, down),
                       fp8.moe_reference(x, ids, w, gate, up, down))


@pytest.mark.parametrize("shared,limit", [(False, None), (True, 7.0)])
def test_recipe_reference_in_pytorch_matches_the_cpp_one(shared, limit):
    """mok.fp8.moe_reference (PyTorch, fp32, any device: the full-size oracle of an FP8
    kernel) against mok._C.reference_forward_fp8 (fp64, CPU) on the same bf16 inputs: the same
    quantized operands, sums in another precision; and both within FP8's error of the exact
    layer (mok._C.reference_forward)."""
    g = torch.Generator().manual_seed(21)
    T, H, I, E, k, Is = 96, 256, 256, 8, 2, 128
    bf = lambda *shape, s=1.0: (torch.randn(*shape, generator=g) * s).to(torch.bfloat16)  # noqa: E731
    x, w_gate, w_up, w_down = bf(T, H), bf(E, I, H, s=0.06), bf(E, I, H, s=0.06), bf(E, H, I, s=0.06)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).to(torch.int32)
    ids[3, 1] = -1  # a slot routed nowhere
    weights = torch.rand(T, k, generator=g)
    sh = (bf(Is, H, s=0.06), bf(Is, H, s=0.06), bf(H, Is, s=0.06)) if shared else None
    y = fp8.moe_reference(x, ids, weights, w_gate, w_up, w_down, sh, limit).double()

    as64 = lambda t: t.double().numpy()  # noqa: E731
    extra = dict(shared_gate=as64(sh[0]), shared_up=as64(sh[1]), shared_down=as64(sh[2])) if shared else {}
    args = (as64(x), ids.numpy(), as64(weights), as64(w_gate), as64(w_up), as64(w_down))
    cpp = torch.from_numpy(mok._C.reference_forward_fp8(*args, swiglu_limit=limit, **extra))
    exact = torch.from_numpy(mok._C.reference_forward(*args, swiglu_limit=limit, **extra))
    rel = lambda a, b: float((a - b).norm() / b.norm())  # noqa: E731
    cos = lambda a, b: float((a * b).sum() / (a.norm() * b.norm()))  # noqa: E731
    assert rel(y, cpp) < 1e-4 and cos(y, cpp) > 0.99999  # (4.5e-8 seen: only the sums differ)
    assert 1e-3 < rel(y, exact) < 0.1 and cos(y, exact) > 0.99  # (FP8's error, not none)
