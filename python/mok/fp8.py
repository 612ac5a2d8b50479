"""FP8 (E4M3) blockwise quantization in PyTorch, the scaling the FP8 layer uses (docs/fp8.md): values
scaled per block by a power of two 2^e, the smallest that fits the block's largest magnitude
into E4M3's 448 (and at least 2^-127, E8M0's smallest), rounded to nearest (ties to even),
saturating. Power-of-two scales in E8M0's range make the conversion to MXFP8 (an E8M0 exponent per
32 elements of a row) exact for every tensor this module quantizes.

    values, exponents = mok.fp8.quantize(w, block=(128, 128))   # weights [..., rows, cols]
    values, exponents = mok.fp8.quantize(x, block=(1, 128))     # activations
    x_again = mok.fp8.dequantize(values, exponents, block=(1, 128))
    mx_values, e8m0 = mok.fp8.to_mxfp8(values, exponents, block=(1, 128))
    values, exponents = mok.fp8.quantize_weights(w)             # the same as block (128, 128), one CUDA kernel

Bytes equal to the C++ host implementation (mok/fp8.hpp; tests/python/test_fp8.py).
"""

from typing import Optional, Tuple

import torch

E4M3_MAX = 448.0


def _blocks(t: torch.Tensor, block: Tuple[int, int]):
    """t [..., rows, cols] as [..., rows/br, br, cols/bc, bc] (padded with zeros to whole blocks)."""
    br, bc = block  # (checked by the callers: _check_block)
    rows, cols = t.shape[-2], t.shape[-1]
    pr, pc = (-rows) % br, (-cols) % bc
    if pr or pc:
        t = torch.nn.functional.pad(t, (0, pc, 0, pr))
    return t.reshape(*t.shape[:-2], (rows + pr) // br, br, (cols + pc) // bc, bc), rows, cols


def _ldexp(x: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """x * 2^e exactly for the exponents a scale takes (|e| up to ~160): torch.ldexp multiplies
    by 2^e in x's dtype, which overflows to inf past 2^127 (an fp32 block of amax < 2^-119 has
    e < -127) or flushes to 0 below 2^-149; two halves of e stay inside the range."""
    e = e.to(torch.int32)
    half = torch.div(e, 2, rounding_mode="floor")
    return torch.ldexp(torch.ldexp(x, half.to(x.dtype)), (e - half).to(x.dtype))


def scale_exponents(amax: torch.Tensor) -> torch.Tensor:
    """The smallest e >= -127 (E8M0's smallest, so that every scale is an MXFP8 scale) with
    amax / 2^e <= 448 (0 where amax is 0, infinite or NaN, as the C++ host and the kernels), int32.
    With amax = m 2^x, m in [0.5, 1) (frexp: exact, subnormals too): 448 = 0.875 2^9, so e = x - 9,
    plus one where m > 0.875."""
    amax = amax.float()
    mantissa, x = torch.frexp(amax)
    e = torch.clamp(x - 9 + (mantissa > 0.875).to(x.dtype), min=-127)
    return torch.where((amax > 0) & torch.isfinite(amax), e, torch.zeros_like(e)).to(torch.int32)


def _check_block(where: str, block) -> None:
    if not (isinstance(block, (tuple, list)) and len(block) == 2
            and all(isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in block)):
        raise ValueError(f"{where}: 'block' must be (rows, cols) of positive ints, got {block!r}")


def _check_exponents(where: str, values: torch.Tensor, exponents: torch.Tensor, block: Tuple[int, int]) -> None:
    """exponents must be the [..., ceil(rows/br), ceil(cols/bc)] of values [..., rows, cols] and block."""
    _check_block(where, block)
    if not isinstance(exponents, torch.Tensor) or exponents.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{where}: 'exponents' must be an int32 tensor, got "
                        + (str(exponents.dtype) if isinstance(exponents, torch.Tensor) else type(exponents).__name__))
    if values.dim() < 2:
        raise ValueError(f"{where}: 'values' must be [..., rows, cols], got shape {tuple(values.shape)}")
    br, bc = block
    rows, cols = values.shape[-2], values.shape[-1]
    expected = (*values.shape[:-2], -(-rows // br), -(-cols // bc))
    if tuple(exponents.shape) != expected:
        raise ValueError(f"{where}: 'exponents' shape must be {expected} for values {tuple(values.shape)} in blocks "
                         f"{tuple(block)}, got {tuple(exponents.shape)} (quantized with another block?)")


def quantize(t: torch.Tensor, block: Tuple[int, int] = (1, 128)) -> Tuple[torch.Tensor, torch.Tensor]:
    """(values float8_e4m3fn [..., rows, cols], exponents int32 [..., ceil(rows/br), ceil(cols/bc)])
    of t [..., rows, cols]: value = e4m3(t / 2^e) per block; leading dimensions (experts) are
    quantized independently."""
    _check_block("mok.fp8.quantize", block)
    if t.dim() < 2:
        raise ValueError(f"mok.fp8.quantize: needs [..., rows, cols], got shape {tuple(t.shape)}")
    b, rows, cols = _blocks(t.float(), block)
    magnitude = b.abs()
    # (NaN takes no part in a block's amax, as fmaxf in the kernels and std::max in the C++ host)
    amax = torch.where(torch.isnan(magnitude), 0.0, magnitude).amax(dim=(-3, -1))
    e = scale_exponents(amax)
    scaled = _ldexp(b, -e[..., :, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX)
    scaled = torch.where(torch.isnan(scaled), float("nan"), scaled)  # (one NaN byte, 0x7f, as the host's)
    values = scaled.to(torch.float8_e4m3fn).reshape(*t.shape[:-2], b.shape[-4] * block[0], b.shape[-2] * block[1])
    return values[..., :rows, :cols].contiguous(), e


def dequantize(values: torch.Tensor, exponents: torch.Tensor, block: Tuple[int, int] = (1, 128),
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """values * 2^e per block, in `dtype`."""
    _check_exponents("mok.fp8.dequantize", values, exponents, block)
    b, rows, cols = _blocks(values.float(), block)
    out = _ldexp(b, exponents[..., :, None, :, None])
    return out.reshape(*values.shape[:-2], b.shape[-4] * block[0], b.shape[-2] * block[1])[..., :rows, :cols].to(dtype)


def to_mxfp8(values: torch.Tensor, exponents: torch.Tensor,
             block: Tuple[int, int] = (1, 128)) -> Tuple[torch.Tensor, torch.Tensor]:
    """MXFP8 of a blockwise-quantized tensor: the same E4M3 values and an E8M0 scale (uint8,
    exponent + 127) per 32 consecutive elements of a row, [..., rows, ceil(cols / 32)]. Exact:
    block columns must be a multiple of 32."""
    _check_exponents("mok.fp8.to_mxfp8", values, exponents, block)
    br, bc = block
    if bc % 32:
        raise ValueError(f"mok.fp8.to_mxfp8: the block's columns must be a multiple of 32, got {bc}")
    if exponents.numel() and (exponents.min() < -127 or exponents.max() > 127):
        raise ValueError("mok.fp8.to_mxfp8: a scale exponent is outside E8M0's range [-127, 127]")
    rows, cols = values.shape[-2], values.shape[-1]
    per_row = exponents.repeat_interleave(br, dim=-2)[..., :rows, :]
    per_group = per_row.repeat_interleave(bc // 32, dim=-1)[..., : (cols + 31) // 32]
    return values, (per_group + 127).to(torch.uint8)


def dequantize_mxfp8(values: torch.Tensor, e8m0: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """values * 2^(e8m0 - 127) per 32 elements of a row."""
    cols = values.shape[-1]
    expected = (*values.shape[:-1], -(-cols // 32))
    if not isinstance(e8m0, torch.Tensor) or tuple(e8m0.shape) != expected:
        raise ValueError(f"mok.fp8.dequantize_mxfp8: 'e8m0' shape must be {expected} (one scale per 32 elements of a "
                         f"row of values {tuple(values.shape)}), got "
                         + (str(tuple(e8m0.shape)) if isinstance(e8m0, torch.Tensor) else type(e8m0).__name__))
    scale = e8m0.to(torch.int32).repeat_interleave(32, dim=-1)[..., :cols] - 127
    return _ldexp(values.float(), scale).to(dtype)


def _check_weight(w, where="mok.fp8.quantize_weights", name="w") -> None:
    if not isinstance(w, torch.Tensor) or w.dtype != torch.bfloat16:
        raise TypeError(f"{where}: {name} must be a CUDA bfloat16 tensor [E, rows, cols], got "
                        + (f"{w.dtype} {tuple(w.shape)} on {w.device}" if isinstance(w, torch.Tensor) else type(w).__name__))
    if w.dim() != 3 or not w.is_cuda:  # (a dtype is a TypeError, anything else a ValueError)
        raise ValueError(f"{where}: {name} must be a CUDA bfloat16 tensor [E, rows, cols], got "
                         f"{w.dtype} {tuple(w.shape)} on {w.device}")


def quantize_weights(w: torch.Tensor, transpose: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """quantize(w, block=(128, 128)) of CUDA bf16 expert weights w [E, rows, cols] by one
    kernel on the current stream (the same bytes): (values float8_e4m3fn [E, rows, cols],
    exponents int32 [E, ceil(rows/128), ceil(cols/128)]). w may be a strided view with
    contiguous rows (e.g. one half of a concatenated [E, 2I, H]); nothing is copied.
    transpose: the quantization of w^T ([E, cols, rows], exponents [E, ceil(cols/128),
    ceil(rows/128)]): the same blocks, so the transposed values (K-major for GEMMs by w^T)."""
    from torch.utils.dlpack import to_dlpack

    from mok import _C

    _check_weight(w)
    E, rows, cols = w.shape
    if transpose:
        rows, cols = cols, rows
    values = torch.empty(E, rows, cols, dtype=torch.uint8, device=w.device)
    exponents = torch.empty(E, -(-rows // 128), -(-cols // 128), dtype=torch.int32, device=w.device)
    stream = torch.cuda.current_stream(w.device).cuda_stream
    _C.fp8_quantize_weights(to_dlpack(w.detach()), to_dlpack(values), to_dlpack(exponents), stream, transpose)
    return values.view(torch.float8_e4m3fn), exponents


def _through(t: torch.Tensor, block: Tuple[int, int]) -> torch.Tensor:
    """t quantized to E4M3 per block and back, fp32."""
    return dequantize(*quantize(t, block), block)


def moe_reference(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w_gate: torch.Tensor,
                  w_up: Optional[torch.Tensor], w_down: torch.Tensor, shared=None, swiglu_limit=None) -> torch.Tensor:
    """y (fp32 [T, H]) of the layer on the FP8 recipe's quantized operands, in PyTorch on the
    tensors' device (the full-size accuracy oracle of an FP8 kernel): x per 1 x 128 block of
    each token, each routed expert's W_gate, W_up [E, I, H] and W_down [E, H, I] per 128 x 128
    block, the SwiGLU output h per 1 x 128 block of each routed row; the shared expert (gate,
    up, down) unquantized. fp32 products and sums: y = shared + sum over slots j, in
    ascending j, of w[t, j] * down(h). The same recipe as mok._C.reference_forward_fp8 (fp64,
    CPU; tests/python/test_fp8.py compares them). w_up None: w_gate is [E, 2I, H] (gate rows,
    then up rows; I a multiple of 128, so its blocks are the halves' blocks)."""
    from mok.torch_path import _swiglu as swiglu  # (the layer's SwiGLU with its clamp)

    if w_up is None:
        w_gate, w_up = w_gate.chunk(2, dim=1)

    T, k = topk_ids.shape
    H = x.shape[1]
    xq = _through(x, (1, 128))
    gate, up, down = (_through(w, (128, 128)) for w in (w_gate, w_up, w_down))
    y = torch.zeros(T, H, dtype=torch.float32, device=x.device)
    if shared is not None:
        sg, su, sd = (s.float() for s in shared)
        xf = x.float()
        y += swiglu(xf @ sg.t(), xf @ su.t(), swiglu_limit) @ sd.t()
    ids = topk_ids.long()
    for j in range(k):
        slot = torch.zeros(T, H, dtype=torch.float32, device=x.device)
        for e in torch.unique(ids[:, j]).tolist():
            if e < 0:
                continue
            tokens = (ids[:, j] == e).nonzero().squeeze(1)
            rows = xq.index_select(0, tokens)
            h = _through(swiglu(rows @ gate[e].t(), rows @ up[e].t(), swiglu_limit), (1, 128))
            slot.index_copy_(0, tokens, h @ down[e].t())
        y += topk_weights[:, j:j + 1].float() * slot
    return y


# The FP8 layer's weights (mok.moe(..., precision="fp8", fp8_experts=quantize_experts(...))).
from mok.fp8_layer import Fp8Experts, dgrad_pays, quantize_experts, weights_changed  # noqa: E402,F401
