"""Training throughput of a small Hugging Face Llama with dash_fa3 against torch SDPA.

    python benchmarks/bench_llama.py [--seqlens 1024 2048] [--tokens 16384] [--steps 20] [--rounds 3]

One model per attention implementation, all from the same seed (same weights,
same data), in one process. Each round runs `--steps` full training steps
(forward, backward, AdamW) of every implementation in turn (interleaved), and
the figure is the median over rounds of tokens/s. Implementations:
``sdpa`` (transformers' SDPA attention, torch picks the backend),
``dash_fa3`` (non-deterministic backward) and ``dash_fa3 det``
(deterministic, schedule auto), through ``dash_fa3.integrations.transformers``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _positive(text):
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
    return value


def build_model(impl: str, args):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.heads * args.headdim, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.heads_kv,
        head_dim=args.headdim, max_position_embeddings=max(args.seqlens), tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(device="cuda", dtype=torch.bfloat16)
    model.set_attn_implementation("sdpa" if impl == "sdpa" else "dash_fa3")
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    return model, opt


def run_steps(model, opt, batches, deterministic):
    kwargs = {} if deterministic is None else {"deterministic": deterministic}
    losses = []
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for ids in batches:
        loss = model(input_ids=ids, labels=ids, **kwargs).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    torch.cuda.synchronize()
    return time.perf_counter() - t0, [x.item() for x in losses]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqlens", type=_positive, nargs="+", default=[1024, 2048])
    ap.add_argument("--tokens", type=_positive, default=16384, help="tokens per step (batch = tokens / seqlen)")
    ap.add_argument("--layers", type=_positive, default=8)
    ap.add_argument("--heads", type=_positive, default=16)
    ap.add_argument("--heads-kv", type=_positive, default=4)
    ap.add_argument("--headdim", type=_positive, default=64)
    ap.add_argument("--intermediate", type=_positive, default=2816)
    ap.add_argument("--vocab", type=_positive, default=32000)
    ap.add_argument("--steps", type=_positive, default=20)
    ap.add_argument("--warmup", type=_positive, default=3)
    ap.add_argument("--rounds", type=_positive, default=3)
    ap.add_argument("--impls", default="sdpa,dash_fa3,dash_fa3 det")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    impls = [x.strip() for x in args.impls.split(",") if x.strip()]
    unknown = set(impls) - {"sdpa", "dash_fa3", "dash_fa3 det"}
    if unknown:
        ap.error(f"unknown --impls {sorted(unknown)}; choose from sdpa, dash_fa3, 'dash_fa3 det'")
    if args.heads % args.heads_kv:
        ap.error(f"--heads {args.heads} must be a multiple of --heads-kv {args.heads_kv}")
    if not torch.cuda.is_available():
        print("bench_llama needs a CUDA GPU", file=sys.stderr)
        return 2
    import dash_fa3.integrations.transformers  # noqa: F401  (registers attn_implementation="dash_fa3")
    from dash_fa3._timing import commit_label

    commit = commit_label()
    import transformers

    print(f"# Llama training tokens/s, {torch.cuda.get_device_name()}, {datetime.date.today()}, commit {commit}, "
          f"torch {torch.__version__}, transformers {transformers.__version__}; {args.layers} layers, "
          f"heads {args.heads}/{args.heads_kv}, head dim {args.headdim}, bf16, AdamW; {args.tokens} tokens/step; "
          f"median of {args.rounds} interleaved rounds of {args.steps} steps")
    print("| seqlen | " + " | ".join(f"{i} tok/s" for i in impls) + " | " +
          " | ".join(f"{i} / sdpa" for i in impls if i != "sdpa") + " |")
    print("|---|" + "---|" * (2 * len(impls) - ("sdpa" in impls)))
    results = []
    for seqlen in args.seqlens:
        batch = max(1, args.tokens // seqlen)
        g = torch.Generator(device="cuda").manual_seed(seqlen)
        data = [torch.randint(0, args.vocab, (batch, seqlen), device="cuda", generator=g)
                for _ in range(args.steps)]
        models = {i: build_model(i, args) for i in impls}
        det = {"sdpa": None, "dash_fa3": False, "dash_fa3 det": True}
        for impl, (model, opt) in models.items():
            run_steps(model, opt, data[: args.warmup], det[impl])
        times = {i: [] for i in impls}
        losses = {}
        for _ in range(args.rounds):
            for impl, (model, opt) in models.items():
                seconds, losses[impl] = run_steps(model, opt, data, det[impl])
                times[impl].append(seconds)
        tps = {i: batch * seqlen * args.steps / statistics.median(times[i]) for i in impls}
        ratios = [f"{tps[i] / tps['sdpa']:.3f}" for i in impls if i != "sdpa" and "sdpa" in tps]
        print(f"| {seqlen} | " + " | ".join(f"{tps[i]:.0f}" for i in impls) + " | " + " | ".join(ratios) + " |",
              flush=True)
        results.append({"seqlen": seqlen, "batch": batch, "tokens_per_s": tps, "seconds": times,
                        "last_losses": {i: losses[i][-3:] for i in impls}})
        del models
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "date": str(datetime.date.today()),
                       "commit": commit, "args": vars(args), "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
