"""The package's module state, in one place: the workspaces of mok.moe (one per layer shape
and device) and the live expert-parallel groups of mok.ep, released at exit."""

import atexit
import weakref

# mok.moe: (device, H, I, E, k, I_s, swiglu_limit, precision, recompute, backward_column_blocks, compute_sms)
# -> mok._C.Workspace for the largest T seen
workspaces = {}

# mok.ep: live groups by id (the custom ops take an int). Weak, so that a group, its process
# group and its symmetric memory go with the last module that holds it (a process group kept
# alive past destroy_process_group until the interpreter's teardown can abort there).
ep_groups = weakref.WeakValueDictionary()


@atexit.register
def _release_at_exit() -> None:
    """Frees the workspaces and EP ranks while the interpreter and CUDA are still up (objects
    of the extension alive at its teardown are reported as leaks by nanobind)."""
    if workspaces:
        import torch

        torch.cuda.synchronize()
        workspaces.clear()
    for group in list(ep_groups.values()):
        group.release()
