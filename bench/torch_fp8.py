"""The FP8 baseline of issue 19 (`torch-fp8` in layer_bench): the compiled PyTorch layer with
rowwise-scaled FP8 grouped GEMMs (torch._scaled_grouped_mm, the FP8 grouped GEMM PyTorch
ships for sm_90). PyTorch has no autograd formula for that op, so forward+backward goes
through Fp8GroupedMM below: the dgrad GEMMs in FP8 too (the gradient rows and the transposed
weights rowwise-scaled), the weight gradients in bf16 (torch._grouped_mm over each expert's
rows, as autograd of the bf16 grouped GEMM computes them) — the split mok's FP8 training path
makes (FP8 forward and dgrad, bf16 weight gradients).

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


def weight_grad(a, dout, offs):
    """bf16 [E, N, K]: expert e's dout rows transposed times its a rows (rows [offs[e-1], offs[e])),
    the gradient of the weight w [E, N, K] of out = a @ w[e]^T. On the GPU one torch._grouped_mm
    over the rows (its K); elsewhere group by group."""
    if a.is_cuda:
        return torch._grouped_mm(a.t(), dout, offs=offs).transpose(-2, -1)
    out = torch.zeros(offs.numel(), dout.shape[1], a.shape[1], dtype=torch.bfloat16)
    start = 0
    for e, end in enumerate(offs.tolist()):
        out[e] = (dout[start:end].float().t() @ a[start:end].float()).to(torch.bfloat16)
        start = end
    return out


class Fp8GroupedMM(torch.autograd.Function):
    """out = a @ w[e]^T per expert's rows, FP8 both ways: forward a rowwise (w_q, w_s: w per output
    column, quantized once by the caller); backward da = dout @ w[e] with dout rowwise and w^T
    per output column (wt_q, wt_s, likewise once), and dw in bf16 (weight_grad). w itself (the
    bf16 master) only receives its gradient."""

    @staticmethod
    def forward(ctx, a, w, offs, w_q, w_s, wt_q, wt_s):
        aq, a_s = quantize_rows(a)
        ctx.save_for_backward(a, offs, wt_q, wt_s)
        return scaled_grouped_mm(aq, a_s, w_q, w_s, offs)

    @staticmethod
    def backward(ctx, dout):
        a, offs, wt_q, wt_s = ctx.saved_tensors
        dout = dout.contiguous()
        dq, d_s = quantize_rows(dout)
        return scaled_grouped_mm(dq, d_s, wt_q, wt_s, offs), weight_grad(a, dout, offs), None, None, None, None, None


def quantize_weights(w):
    """(w_q, w_s, wt_q, wt_s) of a routed weight w [E, N, K]: w and its transpose [E, K, N], each
    rowwise (a row: one output column of the GEMM that reads it), E4M3."""
    with torch.no_grad():
        return (*quantize_rows(w), *quantize_rows(w.transpose(-2, -1).contiguous()))


def moe_fp8(x, ids, weights, w_gate_up_q, w_gate_up_s, w_down_q, w_down_s, limit, shared_gate_up=None,
            shared_down=None, train=None):
    """y (bf16 [T, H]) of the layer with FP8 routed experts: w_gate_up_q [E, 2I, H] and w_down_q
    [E, H, I] E4M3 with their per-output-column scales (quantize_rows of the weights: a weight's
    rows are its output columns). Every id in [0, E). train: None (no gradients through the
    routed GEMMs) or (w_gate_up, w_gate_up_t_q, w_gate_up_t_s, w_down, w_down_t_q, w_down_t_s):
    the bf16 masters, which receive the weight gradients, and the transposed weights' E4M3 copies
    for the dgrad (quantize_weights)."""
    T, k = ids.shape
    E, two_i, H = w_gate_up_q.shape
    sorted_ids, order = torch.sort(ids.reshape(-1), stable=True)
    bounds = torch.arange(E, device=ids.device, dtype=sorted_ids.dtype)
    offs = torch.searchsorted(sorted_ids, bounds, right=True).to(torch.int32)  # end of each expert's rows

    def gemm(a, w_q, w_s, master):  # master: (w, wt_q, wt_s) of train, or None
        if master is None:
            return scaled_grouped_mm(*quantize_rows(a), w_q, w_s, offs)
        return Fp8GroupedMM.apply(a, master[0], offs, w_q, w_s, master[1], master[2])

    # (a token's k rows quantize alike)
    gu = gemm(x.index_select(0, order // k), w_gate_up_q, w_gate_up_s, None if train is None else train[:3])
    g, u = gu.split(two_i // 2, dim=-1)
    out = gemm(tb.swiglu(g, u, limit), w_down_q, w_down_s, None if train is None else train[3:])
    per_slot = torch.index_copy(torch.empty_like(out), 0, order, out)  # row order[i] <- out[i]
    y = (per_slot.view(T, k, H).float() * weights.unsqueeze(-1)).sum(1)
    if shared_gate_up is not None:
        y = y + tb.shared_mlp(x, shared_gate_up, shared_down, limit).float()
    return y.to(x.dtype)


class TorchFp8(tb.TorchImpl):
    """The `torch-fp8` implementation on one problem (layer_bench's inputs): the weights (and their
    transposes, for the dgrad) quantized once, as a training step would per weight version; the
    layer under torch.compile (fullgraph) on the GPU. fwd: no gradients; fwd+bwd: the gradients
    of x, the routing weights, the bf16 masters and the shared expert (TorchImpl's)."""

    def __init__(self, d, compile=True):
        self.gate_up = quantize_weights(d["w_gate_up"])
        self.down = quantize_weights(d["w_down"])
        super().__init__(d, torch.compile(moe_fp8, dynamic=False, fullgraph=True) if compile else moe_fp8)

    def _call(self):
        d, (gq, gs, gtq, gts), (dq, ds, dtq, dts) = self.d, self.gate_up, self.down
        train = None if not torch.is_grad_enabled() else (d["w_gate_up"], gtq, gts, d["w_down"], dtq, dts)
        return self.layer(d["x"], d["ids"], d["weights"], gq, gs, dq, ds, d["limit"], d["shared_gate_up"],
                          d["shared_down"], train)

    def release(self):
        super().release()
        self.gate_up = self.down = None
