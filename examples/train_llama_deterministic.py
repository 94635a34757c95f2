"""Train a small Llama twice with dash_fa3's deterministic backward and once with
torch SDPA: the two dash_fa3 runs give bitwise-identical losses, the SDPA run
gives the reference loss curve.

    python examples/train_llama_deterministic.py [--steps 300] [--plot docs/img/train_llama_deterministic.png]

The model is a Hugging Face transformers Llama (4 layers, heads 8/2, head dim
64, bf16, AdamW) built from one seed for every run, through
``dash_fa3.integrations.transformers`` (``attn_implementation="dash_fa3"``).
The data is synthetic and learnable without a download: each sequence is a
random walk through a fixed sparse token chain (4 successors per token),
repeated, so the loss falls as the model learns the chain's bigrams and then
to copy the repeats through attention. Every run sees the same batches.

Determinism of the whole step, not only attention: the dash_fa3 runs enable
``torch.use_deterministic_algorithms`` (embedding and cross-entropy backward
use their deterministic kernels; cuBLAS needs CUBLAS_WORKSPACE_CONFIG, set
below before CUDA starts). The SDPA run is the ordinary non-deterministic
training a user compares against.

Prints per run the final loss and tokens/s, whether the two dash_fa3 runs'
losses are bitwise identical (every step, compared as float32 bit patterns),
and the largest |loss difference| to the SDPA run over the first 100 steps.
Exit status 1 if the dash_fa3 runs differ. ``--device cpu`` runs the same on
the CPU reference path (slow; for smoke tests with a tiny ``--layers`` etc.).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import textwrap
import time

# cuBLAS picks reduction orders per workspace; a fixed workspace makes its GEMMs
# reproducible (torch.use_deterministic_algorithms requires it). Set before CUDA starts.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402

RUNS = ("dash_fa3 det #1", "dash_fa3 det #2", "sdpa")
BRANCHING = 4  # successors per token in the synthetic data


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive finite number, got {text}")
    return value


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=_positive, default=300)
    ap.add_argument("--batch", type=_positive, default=8)
    ap.add_argument("--seqlen", type=_positive, default=1024)
    ap.add_argument("--layers", type=_positive, default=4)
    ap.add_argument("--heads", type=_positive, default=8)
    ap.add_argument("--heads-kv", type=_positive, default=2)
    ap.add_argument("--headdim", type=_positive, default=64)
    ap.add_argument("--vocab", type=_positive, default=4096)
    ap.add_argument("--prefix", type=_positive, default=256, help="length of the random walk that is repeated")
    ap.add_argument("--lr", type=_positive_float, default=1e-3, help="peak learning rate (linear warm-up over 10%% of the steps)")
    ap.add_argument("--schedule", default="auto", help="dash_fa3's deterministic schedule")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--plot", help="write a PNG (or PDF/SVG) of the loss curves and tokens/s (needs matplotlib)")
    ap.add_argument("--json", help="write the losses and timings as JSON")
    args = ap.parse_args(argv)
    if args.heads % args.heads_kv:
        ap.error(f"--heads {args.heads} must be a multiple of --heads-kv {args.heads_kv}")
    if args.prefix >= args.seqlen:
        ap.error(f"--prefix {args.prefix} must be shorter than --seqlen {args.seqlen}")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device here (use --device cpu for the slow reference path)")
    return args


def transitions(args) -> torch.Tensor:
    """(vocab, BRANCHING) table: the tokens that may follow each token."""
    g = torch.Generator().manual_seed(args.seed + 1)
    return torch.randint(0, args.vocab, (args.vocab, BRANCHING), generator=g)


def make_batches(args) -> list[torch.Tensor]:
    """`steps` batches of (batch, seqlen) token ids. Each row is a walk of
    `prefix` tokens through a fixed random chain (every token has BRANCHING
    equally likely successors: ln(BRANCHING) nats to learn from bigrams),
    repeated to the sequence length (the copies are learnable only through
    attention). The same for every run (CPU generator)."""
    succ = transitions(args)
    g = torch.Generator().manual_seed(args.seed + 2)
    reps = -(-args.seqlen // args.prefix)
    batches = []
    for _ in range(args.steps):
        walk = torch.empty(args.batch, args.prefix, dtype=torch.long)
        walk[:, 0] = torch.randint(0, args.vocab, (args.batch,), generator=g)
        choice = torch.randint(0, BRANCHING, (args.batch, args.prefix), generator=g)
        for i in range(1, args.prefix):
            walk[:, i] = succ[walk[:, i - 1], choice[:, i]]
        batches.append(walk.repeat(1, reps)[:, : args.seqlen].contiguous())
    return batches


def build_model(args, attn: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.heads * args.headdim, intermediate_size=4 * args.heads * args.headdim,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.heads_kv,
        head_dim=args.headdim, max_position_embeddings=args.seqlen, tie_word_embeddings=False,
    )
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(config).to(device=args.device, dtype=torch.bfloat16)
    model.set_attn_implementation(attn)
    model.train()
    return model


def train(args, run: str, batches) -> dict:
    """One training run; returns its per-step losses (float32) and timing."""
    dash = run.startswith("dash_fa3")
    torch.use_deterministic_algorithms(dash)
    model = build_model(args, "dash_fa3" if dash else "sdpa")
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    warmup = max(1, args.steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / warmup))
    kwargs = {"deterministic": True, "schedule": args.schedule} if dash else {}
    losses = []
    if args.device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for ids in batches:
        ids = ids.to(args.device)
        loss = model(input_ids=ids, labels=ids, **kwargs).loss
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach().float())
    losses = torch.stack(losses).cpu()
    if args.device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    torch.use_deterministic_algorithms(False)
    return {"losses": losses, "seconds": seconds, "tokens_per_s": args.batch * args.seqlen * args.steps / seconds}


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


def plot(path: str, args, results: dict, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_tps) = plt.subplots(1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [3, 1]})
    steps = range(1, args.steps + 1)
    styles = {"dash_fa3 det #1": ("C0", "-", 2.5), "dash_fa3 det #2": ("C1", "--", 1.2), "sdpa": ("C2", ":", 1.5)}
    for run, res in results.items():
        color, style, width = styles[run]
        ax_loss.plot(steps, res["losses"].tolist(), color=color, linestyle=style, linewidth=width, label=run)
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("training loss")
    ax_loss.set_yscale("log")
    ax_loss.legend()
    ax_loss.grid(alpha=0.3)
    names = list(results)
    ax_tps.bar(range(len(names)), [results[n]["tokens_per_s"] / 1e3 for n in names],
               color=[styles[n][0] for n in names])
    ax_tps.set_xticks(range(len(names)), [n.replace(" det ", "\ndet ") for n in names])
    ax_tps.set_ylabel("tokens/s (thousands)")
    fig.suptitle(textwrap.fill(title, 150), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    args = parse_args(argv)
    import transformers

    import dash_fa3.integrations.transformers  # noqa: F401  (registers attn_implementation="dash_fa3")
    from dash_fa3._timing import commit_label

    device = torch.cuda.get_device_name() if args.device == "cuda" else "CPU (reference path)"
    title = (f"{device}, commit {commit_label()}, torch {torch.__version__}, transformers {transformers.__version__}; "
             f"Llama {args.layers} layers, heads {args.heads}/{args.heads_kv}, head dim {args.headdim}, bf16, "
             f"AdamW lr {args.lr}; batch {args.batch} x {args.seqlen} tokens, {args.steps} steps, "
             f"schedule {args.schedule}")
    print("#", title)
    batches = make_batches(args)
    results = {run: train(args, run, batches) for run in RUNS}
    a, b, ref = (results[r]["losses"] for r in RUNS)
    identical = bitwise_equal(a, b)
    first = min(100, args.steps)
    max_diff = float((a[:first] - ref[:first]).abs().max())
    for run, res in results.items():
        print(f"{run}: final loss {res['losses'][-1].item():.4f}, {res['tokens_per_s']:.0f} tokens/s")
    print(f"dash_fa3 det runs bitwise identical over {args.steps} steps: {identical}")
    print(f"max |loss(dash_fa3) - loss(sdpa)| over the first {first} steps: {max_diff:.4f}")
    if args.plot:
        plot(args.plot, args, results, title)
        print(f"plot: {args.plot}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"title": title, "args": vars(args), "identical": identical, "max_diff_first_100": max_diff,
                       "runs": {r: {"losses": res["losses"].tolist(), "seconds": res["seconds"],
                                    "tokens_per_s": res["tokens_per_s"]} for r, res in results.items()}}, f)
    return 0 if identical else 1


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.exit(main())
