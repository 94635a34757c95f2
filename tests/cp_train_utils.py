"""What the frameworks' context-parallel training tests share: a launcher for gloo worker
processes, the zigzag token order, and a gradient reduction whose bits do not depend on the
number of CP ranks.

Why a reduction of our own: a parameter's gradient is a sum over tokens. A framework's data- /
context-parallel all-reduce adds each rank's partial sum over its own tokens, so its bits depend
on how the tokens were split, whatever the attention does. ``BlockOrderedGrads`` instead
recomputes each parametrised module's gradient on fixed 128-token blocks of the global sequence
(the same shapes at every CP size) and adds the blocks in global order in fp32. Its result is
then bitwise the same for every CP size exactly when every token's activations and activation
gradients are, which is what the attention adapters under test must deliver."""

import json
import os
import subprocess
import time

import pytest
import torch
import torch.distributed as dist

BLOCK = 128  # dash_fa3.distributed.G: a global length is a multiple of 2 * P * BLOCK


def zigzag_blocks(num_tokens: int, P: int, rank: int) -> list[int]:
    """The global 128-token blocks rank ``rank`` holds, in local order: chunks rank and
    2P-1-rank of 2P (Megatron's and TorchTitan's load balancing, dash_fa3's zigzag)."""
    chunk = num_tokens // (2 * P)
    assert chunk % BLOCK == 0, (num_tokens, P)
    per = chunk // BLOCK
    return [c * per + i for c in (rank, 2 * P - 1 - rank) for i in range(per)]


def gather_tokens(x: torch.Tensor, dim: int, group, num_tokens: int) -> torch.Tensor:
    """The whole sequence in global order from each rank's zigzag tokens (an all-gather)."""
    P = dist.get_world_size(group)
    parts = [torch.empty_like(x.contiguous()) for _ in range(P)]
    dist.all_gather(parts, x.contiguous(), group=group)
    blocks = {}
    for r, part in enumerate(parts):
        for j, b in enumerate(zigzag_blocks(num_tokens, P, r)):
            blocks[b] = part.narrow(dim, j * BLOCK, BLOCK)
    return torch.cat([blocks[b] for b in range(num_tokens // BLOCK)], dim)


class BlockOrderedGrads:
    """Records the calls of every module that owns parameters; ``reduce()`` then returns each
    parameter's gradient (fp32): the sum over global 128-token blocks, in global order, of the
    module's gradient recomputed on that block alone (every parametrised module of the tiny
    models works token by token). ``token_dims(module)`` gives (input dim, output dim) of the
    token axis; tensors of another length along it (weights passed as arguments) go in whole."""

    def __init__(self, model, token_dims, group, num_tokens):
        self.group, self.num_tokens, self.token_dims = group, num_tokens, token_dims
        self.calls = []
        self.recording = True
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.hooks = [m.register_forward_hook(self._record, with_kwargs=True)
                      for m in model.modules() if any(True for _ in m.parameters(recurse=False))]

    def _record(self, module, args, kwargs, output):
        if not self.recording:
            return
        out = output[0] if isinstance(output, tuple) else output
        call = {"module": module, "args": args, "kwargs": kwargs, "grad": None}
        if out.requires_grad:
            out.register_hook(lambda g, call=call: call.__setitem__("grad", g))
        self.calls.append(call)

    def reduce(self):
        P, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        local = len(zigzag_blocks(self.num_tokens, P, rank))
        ids = {id(p): i for i, p in enumerate(self.params)}
        per_block = [torch.zeros(local, *p.shape) for p in self.params]
        self.recording = False
        for call in self.calls:
            if call["grad"] is None:
                continue
            module = call["module"]
            din, dout = self.token_dims(module)
            extra = [v for v in list(call["args"]) + list(call["kwargs"].values())
                     if isinstance(v, torch.nn.Parameter)]
            params = [p for p in list(module.parameters(recurse=False)) + extra if id(p) in ids]
            params = list({id(p): p for p in params}.values())
            for j in range(local):
                args = [self._block(a, din, j, local) for a in call["args"]]
                kwargs = {k: self._block(v, din, j, local) for k, v in call["kwargs"].items()}
                with torch.enable_grad():
                    out = module(*args, **kwargs)
                out = out[0] if isinstance(out, tuple) else out
                dy = call["grad"].narrow(dout, j * BLOCK, BLOCK)
                grads = torch.autograd.grad(out, params, dy, allow_unused=True)
                for p, g in zip(params, grads):
                    if g is not None:
                        per_block[ids[id(p)]][j] += g.float()
        self.recording = True
        self.calls.clear()
        totals = []
        for p, blocks in zip(self.params, per_block):
            total = torch.zeros(p.shape)
            for g in self._gather_blocks(blocks, P):
                total += g
            totals.append(total)
        return totals

    def _block(self, x, dim, j, local):
        if isinstance(x, torch.Tensor) and not isinstance(x, torch.nn.Parameter) and x.dim() > dim \
                and x.shape[dim] == local * BLOCK:
            return x.detach().narrow(dim, j * BLOCK, BLOCK)
        return x

    def _gather_blocks(self, blocks, P):
        parts = [torch.empty_like(blocks) for _ in range(P)]
        dist.all_gather(parts, blocks.contiguous(), group=self.group)
        by_block = {}
        for r, part in enumerate(parts):
            for j, b in enumerate(zigzag_blocks(self.num_tokens, P, r)):
                by_block[b] = part[j]
        return [by_block[b] for b in range(self.num_tokens // BLOCK)]

    def remove(self):
        for h in self.hooks:
            h.remove()


def launch(worker, P, job, tmp_path, python, wait_s=300):
    """Runs ``python worker rank P store jobfile outdir`` as P processes; returns each rank's
    JSON result. Fails (never hangs) when a rank outlives ``wait_s`` or writes no result."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    jobfile = tmp_path / "job.json"
    jobfile.write_text(json.dumps(job))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([root, os.path.join(root, "tests")]))
    if os.path.exists("/sys/class/net/lo"):
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    procs = []
    for r in range(P):
        log = open(tmp_path / f"rank{r}.log", "w")
        procs.append(subprocess.Popen([python, worker, str(r), str(P), str(tmp_path / "store"), str(jobfile),
                                       str(tmp_path)], stdout=log, stderr=subprocess.STDOUT, env=env))
    deadline = time.monotonic() + wait_s
    try:
        for p in procs:
            p.wait(timeout=max(deadline - time.monotonic(), 1))
    except subprocess.TimeoutExpired:
        logs = "\n".join((tmp_path / f"rank{r}.log").read_text()[-1500:] for r in range(P))
        pytest.fail(f"ranks still running after {wait_s} s:\n{logs}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    results = {}
    for r in range(P):
        path = tmp_path / f"rank{r}.json"
        if not path.exists():
            pytest.fail(f"rank {r} wrote no result:\n{(tmp_path / f'rank{r}.log').read_text()[-3000:]}")
        results[r] = json.loads(path.read_text())
    return results


def init_worker(argv):
    """A worker's (rank, P, job, outdir), with its gloo process group up and one thread."""
    import datetime

    rank, P, store, jobfile, outdir = int(argv[0]), int(argv[1]), argv[2], argv[3], argv[4]
    torch.set_num_threads(1)
    with open(jobfile) as f:
        job = json.load(f)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=P,
                            timeout=datetime.timedelta(seconds=job.get("timeout_s", 120)))
    return rank, P, job, outdir


def finish_worker(rank, outdir, result):
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


def train(model, params32, step_fn, steps, lr, group, num_tokens, token_dims):
    """``steps`` SGD steps on fp32 master weights ``params32`` (one per model parameter, in
    ``model.parameters()`` order, all trainable) with the model computing in bf16: ``step_fn()`` runs the forward
    on this rank's tokens and returns the per-token losses (fp32, local tokens along dim 1);
    their sum over the global sequence / num_tokens is the loss. Returns (losses, grad norms),
    each taken in global token / parameter order, so equal bits mean equal runs."""
    grads = BlockOrderedGrads(model, token_dims, group, num_tokens)
    losses, norms = [], []
    for _ in range(steps):
        per_token = step_fn()
        (per_token.sum() / num_tokens).backward()
        reduced = grads.reduce()
        everything = gather_tokens(per_token.detach(), 1, group, num_tokens)
        losses.append(everything.flatten().sum().item() / num_tokens)
        norm = torch.zeros(())
        for g in reduced:
            norm += g.square().sum()
        norms.append(norm.sqrt().item())
        with torch.no_grad():
            for p, master, g in zip(grads.params, params32, reduced):
                master -= lr * g
                p.copy_(master)
                p.grad = None
    grads.remove()
    return losses, norms
