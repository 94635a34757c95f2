"""What the Megatron-Core adapter's tests share (import after importorskip("megatron.core"))."""

import contextlib
import os
import socket

import torch.distributed as dist
from megatron.core import parallel_state


@contextlib.contextmanager
def world_of_one():
    """A world of one rank (gloo) with Megatron's tensor/pipeline parallel state of size 1,
    as for one GPU; the environment and the process group are restored afterwards."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    saved = {k: os.environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT")}
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
