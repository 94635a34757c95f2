"""Small fwd+bwd calls for compute-sanitizer: every head-dim pair whose bf16 kernels the build has for
every mask kind (MLA's (192, v 128) included), full and causal masks and sliding windows (the local kernels; one of them
hides the first KV tile from every query, a backward task without steps), both
modes, MHA and GQA (4 query heads on 2 KV heads), 200 (or 100) query and 333
key tokens (ragged tiles); then forward calls, dense and packed, with more query
tiles than the device has SMs, so that CTAs reuse their O slots
(csrc/kernels/fwd/fwd_epilogue.h).
Run on the GPU machine:

    compute-sanitizer --tool memcheck|racecheck|synccheck --error-exitcode 9 python tools/sanitize_small.py
"""

import torch

import dash_fa3
from dash_fa3 import _ext, variants

# (head dim, value head dim) of every bf16 pair whose full, causal and local kernels the build has, dense and
# packed, both directions (the cases below run all three masks).
def _built_everywhere(name):
    return all(name in _ext.built_variants(d, packed, False) for d in ("fwd", "bwd") for packed in (False, True))


PAIRS = sorted({(v.hdim, v.hdim_v) for v in map(variants.Variant.parse, _ext.built_variants("bwd", False, False))
                if v.dtype == "bf16" and all(_built_everywhere(variants.Variant(v.hdim, "bf16", m, v.hdim_v).name)
                                             for m in ("full", "causal", "local"))})

CASES = [  # (seqlen_q, flash_attn_func mask arguments)
    (200, dict(causal=False)),
    (200, dict(causal=True)),
    (200, dict(window_size=(30, 20))),
    (100, dict(window_size=(64, 0))),  # keys < 169 are seen by no query: KV tile 0 has no step
]

for d, dv in PAIRS:
    for sq, mask in CASES:
        for det in (False, True):
            for hq, hk in ((2, 2), (4, 2)):
                q = torch.randn(1, sq, hq, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                k = torch.randn(1, 333, hk, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                v = torch.randn(1, 333, hk, dv, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                out = dash_fa3.flash_attn_func(q, k, v, deterministic=det, **mask)
                out = out[0] if isinstance(out, tuple) else out
                out.float().sum().backward()

# 16 heads x 16 query tiles of 128 rows: about two tiles per CTA on 132 SMs.
for d, dv in PAIRS:
    for causal in (False, True):
        q = torch.randn(1, 2048, 16, d, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(1, 1000, 16, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(1, 1000, 16, dv, device="cuda", dtype=torch.bfloat16)
        dash_fa3.flash_attn_func(q, k, v, causal=causal)
        # Packed documents: whole tiles leave by TMA, each document's partial last tile from registers.
        cu = torch.tensor([0, 700, 1000, 1900, 2048], dtype=torch.int32, device="cuda")
        vp = torch.randn(2048, 16, dv, device="cuda", dtype=torch.bfloat16)
        dash_fa3.flash_attn_varlen_func(q[0], q[0], vp, cu, cu, 900, 900, causal=causal)
# Dense causal at 4096 query rows (hdim 64 runs its three-warpgroup kernel from 2048); the causal kernels
# take their tiles off a counter through the producer-to-MMA hand-off (fwd_tile_scheduler.h).
for d, dv in PAIRS:
    q = torch.randn(1, 4096, 8, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 4096, 8, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(1, 4096, 8, dv, device="cuda", dtype=torch.bfloat16)
    dash_fa3.flash_attn_func(q, k, v, causal=True)
torch.cuda.synchronize()
print("sanitize_small: all calls ran")
