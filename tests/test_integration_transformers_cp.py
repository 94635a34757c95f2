"""Context parallelism with the transformers adapter: ``examples/context_parallel_transformers.py``
run by 2 gloo ranks on the CPU (this file is also the worker), and what
``dash_fa3.integrations.transformers.context_parallel`` refuses."""

import json
import os
import sys

import pytest
import torch

pytest.importorskip("transformers", minversion="5", reason="transformers 5.x is not installed")

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import cp_train_utils as cpu  # noqa: E402


def _worker(argv):
    """Runs the example's main() on this rank, counting the adapter's context-parallel calls."""
    rank, P, jobfile, outdir = int(argv[0]), int(argv[1]), argv[3], argv[4]   # argv[2]: the example uses env://
    torch.set_num_threads(1)
    with open(jobfile) as f:
        job = json.load(f)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(P), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(job["port"]))
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    import context_parallel_transformers as example

    from dash_fa3.integrations import transformers as dtf

    calls = []
    real = dtf.context_parallel_attn

    def counting(q, k, v, group, **kw):
        calls.append((tuple(q.shape), kw["layout"], kw["deterministic"]))
        return real(q, k, v, group, **kw)

    dtf.context_parallel_attn = counting
    rc = example.main(job["args"])
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
        json.dump({"rc": rc, "calls": calls}, f)


def test_example_trains_over_two_ranks(tmp_path, capfd):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = ["--device", "cpu", "--steps", "2", "--seqlen", "512", "--layers", "1", "--check"]
    res = cpu.launch(os.path.abspath(__file__), 2, {"port": port, "args": args}, tmp_path, sys.executable)
    log = (tmp_path / "rank0.log").read_text()
    assert res[0]["rc"] == 0 and res[1]["rc"] == 0, log
    assert "check: loss" in log and "step 2: loss" in log, log
    for r in (0, 1):
        # one call per layer and step, each on this rank's 256 tokens, zigzag, deterministic
        assert res[r]["calls"] == [[[1, 256, 4, 64], "zigzag", True]] * 2, res[r]["calls"]


def test_refusals_inside_context_parallel(tmp_path):
    import torch.distributed as dist

    from dash_fa3.integrations import transformers as dtf

    with pytest.raises(ValueError, match="unknown layout"), dtf.context_parallel(object(), layout="ring"):
        pass
    q = torch.zeros(1, 4, 256, 64, dtype=torch.bfloat16)   # (batch, heads, seq, dim), as transformers hands it
    module = torch.nn.Module()
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        with dtf.context_parallel(dist.group.WORLD):
            with pytest.raises(dtf.UnsupportedAttention, match="zigzag positions under context parallelism"):
                dtf.attention_forward(module, q, q, q, None, position_ids=torch.arange(256)[None] + 3)
            with pytest.raises(dtf.UnsupportedAttention, match="without position_ids"):
                dtf.attention_forward(module, q, q, q, None)
            with pytest.raises(dtf.UnsupportedAttention, match="a KV cache"):
                dtf.attention_forward(module, q[:, :, :1], q, q, None, position_ids=torch.arange(256)[None])
            with pytest.raises(dtf.UnsupportedAttention, match="sliding window"):
                dtf.attention_forward(module, q, q, q, None, position_ids=torch.arange(256)[None], sliding_window=8)
            out, _ = dtf.attention_forward(module, q, q, q, None, position_ids=torch.arange(256)[None])
            assert out.shape == (1, 256, 4, 64)
        assert dtf._cp[0] is None   # the context manager restores the single-device path
    finally:
        if owned:
            dist.destroy_process_group()


if __name__ == "__main__":
    _worker(sys.argv[1:])
