"""The buffers one call of the layer hands the extension: its scratch, the DLPack capsules of its
tensors, and the backward's gradients (mok.ops re-exports each under a leading underscore)."""

import torch
from torch.utils.dlpack import to_dlpack


def scratch(nbytes, device):
    """One call's scratch from PyTorch's caching allocator: freed when the call returns
    (stream-ordered), so the forward's bytes serve the backward and the next layer."""
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


def capsules(tensors):
    """The tensors as DLPack capsules (None stays None) for the extension: torch's C entry
    to_dlpack takes ~0.4 µs a tensor; Tensor.__dlpack__, which the extension would call when
    handed the tensors, queries and compares CUDA streams in Python (~10 µs a tensor). The
    streams need no handshake: everything runs on the stream the call passes."""
    return [None if t is None else to_dlpack(t) for t in tensors]


def empty_grads(x, topk_weights, w_gate, w_up, w_down, shared_gate, shared_up, shared_down, paired=False):
    """dx, d_topk_weights, d_w_gate, d_w_up, d_w_down[, the shared expert's], each like its
    input (d_w_up: empty when w_up is None, d_w_gate then [E, 2I, H]). paired: when both weights
    are contiguous and alike, d_w_gate and d_w_up as one [2, E, I, H] block in d_w_gate's place
    (d_w_up then empty; gate_up_grads gives the two halves), so that the backward keeps its
    routed dy rows and w*h across both gradients (a smaller scratch: gate_up_adjacent)."""
    if paired and pairs(w_gate, w_up):
        d_gate, d_up = torch.empty((2, *w_gate.shape), dtype=w_gate.dtype, device=w_gate.device), w_gate.new_empty(0)
    else:
        d_gate = torch.empty_like(w_gate)
        d_up = w_gate.new_empty(0) if w_up is None else torch.empty_like(w_up)
    grads = [torch.empty_like(x), torch.empty_like(topk_weights), d_gate, d_up, torch.empty_like(w_down)]
    if shared_gate is not None:
        grads += [torch.empty_like(shared_gate), torch.empty_like(shared_up), torch.empty_like(shared_down)]
    return grads


def pairs(w_gate, w_up):
    """Whether empty_grads(paired=True) gives w_gate's and w_up's gradients as one block."""
    return w_up is not None and w_gate.is_contiguous() and w_up.is_contiguous() and \
        w_gate.shape == w_up.shape and w_gate.dtype == w_up.dtype


def gate_up_grads(grads, w_up):
    """(d_w_gate, d_w_up) of empty_grads' list: the block's two halves (views), the two
    tensors, or ([E, 2I, H], None) when w_up is None."""
    if w_up is None:
        return grads[2], None
    if grads[2].dim() == 4:
        return tuple(grads[2].unbind(0))
    return grads[2], grads[3]


def gate_up_adjacent(d_gate, d_up):
    """Whether W_up's gradient (None: w_up is None) directly follows W_gate's in one block of
    2 E I H elements (one contiguous [E, 2I, H] gradient, or the halves of empty_grads' block):
    the extension then may place the backward's rows across both, and needs the smaller
    scratch it sizes for that."""
    if d_gate.dtype != torch.bfloat16 or not d_gate.is_contiguous():
        return False
    if d_up is None:
        return True
    return d_up.is_contiguous() and d_up.data_ptr() == d_gate.data_ptr() + d_gate.numel() * d_gate.element_size()
