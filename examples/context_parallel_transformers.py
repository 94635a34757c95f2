"""Train a Hugging Face transformers Llama with its sequence split over several ranks
(context parallelism) through ``attn_implementation="dash_fa3"``.

    torchrun --nproc-per-node 2 examples/context_parallel_transformers.py [--steps 20] [--seqlen 2048]
    torchrun --nproc-per-node 2 examples/context_parallel_transformers.py --device cpu --steps 2 --check

transformers and accelerate shard sequences only for their SDPA attention, so this script does
it around the adapter: every rank holds the whole batch, keeps its tokens with
``dash_fa3.distributed.shard(x, group, layout="zigzag")`` (rank r: chunks r and 2P-1-r of 2P,
which balances causal work), and runs the model inside
``dash_fa3.integrations.transformers.context_parallel(group)``, where each attention layer calls
``dash_fa3.distributed.context_parallel_attn`` on the local queries, keys and values. Everything
else in a decoder works token by token, so the rest of the model needs nothing. The loss is the
sum of the ranks' per-token losses over the global token count; the parameter gradients,
partial sums over each rank's tokens, are all-reduced over the group as data parallelism does.

``--deterministic`` (the default) runs the deterministic algorithm (superblocks: the same bits
for every number of ranks, any num_key_value_heads). ``--check`` also runs the first step's forward on the
whole sequence in one process (no context parallelism) and compares the losses.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--seqlen", type=int, default=2048, help="global tokens per row (a multiple of 2*ranks*128)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--nondeterministic", dest="deterministic", action="store_false")
    p.add_argument("--check", action="store_true", help="compare step 1's loss with a one-process forward")
    return p.parse_args(argv)


def build_model(args, device):
    from transformers import LlamaConfig, LlamaForCausalLM

    import dash_fa3.integrations.transformers  # noqa: F401  (registers attn_implementation="dash_fa3")

    config = LlamaConfig(vocab_size=256, hidden_size=args.heads * args.head_dim, intermediate_size=512,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.kv_heads, head_dim=args.head_dim,
                         max_position_embeddings=args.seqlen, attention_dropout=0.0)
    torch.manual_seed(0)   # the same weights on every rank
    model = LlamaForCausalLM(config).to(device=device, dtype=torch.bfloat16)
    model.config._attn_implementation = "dash_fa3"
    return model


def per_token_loss(model, ids, positions, labels):
    logits = model(input_ids=ids, position_ids=positions, attention_mask=torch.ones_like(ids), use_cache=False).logits
    return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="none")


def main(argv=None):
    args = parse_args(argv)
    from dash_fa3.distributed import shard
    from dash_fa3.integrations.transformers import context_parallel, set_defaults

    backend = "nccl" if args.device == "cuda" else "gloo"
    dist.init_process_group(backend)
    rank, ranks = dist.get_rank(), dist.get_world_size()
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    device = torch.device(args.device, torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    group = dist.group.WORLD
    model = build_model(args, device)
    set_defaults(deterministic=args.deterministic)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    g = torch.Generator().manual_seed(1)
    n_tokens = args.batch * args.seqlen
    failed = False
    for step in range(args.steps):
        seq = torch.randint(0, model.config.vocab_size, (args.batch, args.seqlen + 1), generator=g).to(device)
        ids, labels = seq[:, :-1], seq[:, 1:]
        positions = torch.arange(args.seqlen, device=device).expand(args.batch, -1)
        local = [shard(t, group, seq_dim=1, layout="zigzag") for t in (ids, positions, labels)]
        with context_parallel(group, layout="zigzag"):
            losses = per_token_loss(model, *local)
        loss = losses.sum() / n_tokens
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad, group=group)
        total = loss.detach().clone()
        dist.all_reduce(total, group=group)
        if step == 0 and args.check:
            with torch.no_grad():
                whole = per_token_loss(model, ids, positions, labels).sum().item() / n_tokens
            diff = abs(whole - total.item())
            failed = diff > 1e-2 * abs(whole)
            if rank == 0:
                print(f"check: loss {total.item():.6f} over {ranks} ranks, {whole:.6f} in one process, "
                      f"|difference| {diff:.2e}{' FAILED' if failed else ''}")
        opt.step()
        opt.zero_grad(set_to_none=True)
        if rank == 0:
            print(f"step {step + 1}: loss {total.item():.6f}")
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
