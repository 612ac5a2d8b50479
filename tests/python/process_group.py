"""Running a check in two processes of a gloo group on this machine (CPU tests of the
expert-parallel paths)."""

import os
import socket
import sys


def _in_process_group(rank, world, port, check, *args):
    """One process of a gloo group on this machine: runs check(rank, world, *args)."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        check(rank, world, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # Passed: leave without the interpreter's teardown, where gloo's worker threads can still
    # free tensors and abort the process ("terminate called without an active exception",
    # SIGABRT; seen with torch 2.11 and 2.15, pytorch/pytorch#179291). A failure above raises
    # instead, and mp.spawn reports it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_in_two_processes(check, *args):
    """check(rank, world, *args) in two processes of a gloo group (a failure in one fails the test)."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_in_process_group, args=(2, port, check) + args, nprocs=2, join=True)
