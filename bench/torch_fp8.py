"""The FP8 baseline of issue 19 (`torch-fp8` in layer_bench): the compiled PyTorch layer with
rowwise-scaled FP8 grouped GEMMs (torch._scaled_grouped_mm, the FP8 grouped GEMM PyTorch
ships for sm_90), forward only: PyTorch has no autograd formula for it.

Recipe (PyTorch's rowwise one, not DeepSeek's blockwise one that mok's FP8 path will use):
each routed x row and each h row quantized to E4M3 with one fp32 scale per row (amax / 448),
each expert's weights with one scale per output column, quantized once before the timing (a
training step would keep them per weight version), bf16 GEMM outputs, SwiGLU and the fp32
combine as torch_baseline.moe_compilable, the shared expert in bf16.

Off the GPU (the tests) scaled_grouped_mm computes the same product from the dequantized
operands, group by group.
"""
import torch

import torch_baseline as tb

FP8 = torch.float8_e4m3fn
E4M3_MAX = 448.0


def quantize_rows(t):
    """(values, scales) with t ≈ values.float() * scales[..., None]: E4M3 values, one fp32
    scale per row of the last dimension (amax / 448; a row of zeros keeps a tiny scale)."""
    scale = t.detach().abs().amax(dim=-1).float().clamp(min=1e-12) / E4M3_MAX
    return (t.float() / scale.unsqueeze(-1)).to(FP8), scale


def scaled_grouped_mm(a, a_scale, b, b_scale, offs):
    """bf16 [M, N]: rows [offs[e-1], offs[e]) of a (E4M3 [M, K], scales [M]) times expert e's
    b (E4M3 [E, N, K], scales [E, N]) transposed. On the GPU torch._scaled_grouped_mm (b
    passed as the column-major [E, K, N] view it asks for); elsewhere the dequantized product."""
    if a.is_cuda:
        return torch._scaled_grouped_mm(a, b.transpose(-2, -1), a_scale, b_scale, offs=offs, out_dtype=torch.bfloat16)
    out = torch.empty(a.shape[0], b.shape[1], dtype=torch.bfloat16)
    start = 0
    for e, end in enumerate(offs.tolist()):
        rows = a[start:end].float() * a_scale[start:end, None]
        out[start:end] = (rows @ (b[e].float() * b_scale[e][:, None]).t()).to(torch.bfloat16)
        start = end
    return out


def moe_fp8(x, ids, weights, w_gate_up_q, w_gate_up_s, w_down_q, w_down_s, limit, shared_gate_up=None,
            shared_down=None):
    """y (bf16 [T, H]) of the layer with FP8 routed experts: w_gate_up_q [E, 2I, H] and w_down_q
    [E, H, I] E4M3 with their per-output-column scales (quantize_rows of the weights: a weight's
    rows are its output columns). Every id in [0, E)."""
    T, k = ids.shape
    E, two_i, H = w_gate_up_q.shape
    sorted_ids, order = torch.sort(ids.reshape(-1), stable=True)
    bounds = torch.arange(E, device=ids.device, dtype=sorted_ids.dtype)
    offs = torch.searchsorted(sorted_ids, bounds, right=True).to(torch.int32)  # end of each expert's rows
    xq, xs = quantize_rows(x.index_select(0, order // k))  # (a token's k rows quantize alike)
    gu = scaled_grouped_mm(xq, xs, w_gate_up_q, w_gate_up_s, offs)
    g, u = gu.split(two_i // 2, dim=-1)
    hq, hs = quantize_rows(tb.swiglu(g, u, limit))
    out = scaled_grouped_mm(hq, hs, w_down_q, w_down_s, offs)
    per_slot = torch.index_copy(torch.empty_like(out), 0, order, out)  # row order[i] <- out[i]
    y = (per_slot.view(T, k, H).float() * weights.unsqueeze(-1)).sum(1)
    if shared_gate_up is not None:
        y = y + tb.shared_mlp(x, shared_gate_up, shared_down, limit).float()
    return y.to(x.dtype)


class TorchFp8:
    """The `torch-fp8` implementation on one problem (layer_bench's inputs): the weights
    quantized once, the layer under torch.compile (fullgraph) on the GPU; forward only."""

    def __init__(self, d, compile=True):
        self.d = d
        with torch.no_grad():
            self.gate_up = quantize_rows(d["w_gate_up"])  # (rows: output columns)
            self.down = quantize_rows(d["w_down"])
        self.layer = torch.compile(moe_fp8, dynamic=False, fullgraph=True) if compile else moe_fp8

    def _call(self):
        d = self.d
        return self.layer(d["x"], d["ids"], d["weights"], *self.gate_up, *self.down, d["limit"], d["shared_gate_up"],
                          d["shared_down"])

    def step(self, pass_):
        if pass_ != "fwd":
            raise ValueError(f"torch-fp8 has no {pass_} (no autograd formula for torch._scaled_grouped_mm)")

        def fwd():
            with torch.no_grad():
                return self._call()
        return fwd, None

    def outputs(self, pass_):
        return {"y": self.step(pass_)[0]()}

    def release(self):
        self.gate_up = self.down = None
