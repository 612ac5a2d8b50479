"""MoK for Hopper: a deterministic fused Mixture-of-Experts layer.

    y = mok.moe(x, topk_ids, topk_weights, w_gate, w_up, w_down)

computes y[t] = shared(x[t]) + sum_j topk_weights[t, j] * down_e(silu(gate_e x[t]) * up_e x[t])
with e = topk_ids[t, j] (-1 = no expert), fp32 accumulation, bf16 output, in one fused
kernel on a Hopper GPU. `mok.moe_torch` is the same layer in plain PyTorch
(`mok.moe_torch_ep` its expert-parallel form over torch.distributed), `mok.MoE` a module
with a router, `mok.hf` a Hugging Face experts backend, `mok.reference_forward` the
fp64 CPU oracle.

Status: forward and backward on one GPU (autograd through `mok.moe`); expert parallelism
over torch.distributed in `mok.ep` (`mok.MoE(..., group=mok.ep.ExpertParallel(pg))`),
run on two H200s under torchrun (forward and gradients bitwise equal to one GPU).
"""

from mok._C import __version__, cuda_device_count, reference_forward  # noqa: F401

try:  # the PyTorch API needs torch; the CPU reference does not
    import torch as _torch  # noqa: F401
except ImportError:  # pragma: no cover - exercised only without torch
    pass
else:
    from mok import fp8  # noqa: F401 (mok.fp8.quantize_experts, the FP8 layer's weights)
    from mok.module import MoE  # noqa: F401
    from mok.ops import check, moe, set_backward_column_blocks, set_compute_sms, set_fp8_weight_gradients  # noqa: F401
    from mok.torch_path import moe_torch, moe_torch_ep  # noqa: F401

__all__ = ["MoE", "__version__", "check", "cuda_device_count", "moe", "moe_torch", "moe_torch_ep", "reference_forward",
           "set_backward_column_blocks", "set_compute_sms", "set_fp8_weight_gradients"]
