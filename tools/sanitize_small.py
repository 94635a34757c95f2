"""Small fwd+bwd calls for compute-sanitizer, over whatever bf16 kernels the build has (a narrowed build,
e.g. ``DASH_FA3_VARIANTS=hdim256-bf16-full,hdim256-bf16-causal DASH_FA3_LAYOUTS=dense``, runs the cases
its kernels cover; MLA's (192, v 128) included): full and causal masks and sliding windows (the local
kernels; one of them hides the first KV tile from every query, a backward task without steps), both
modes, MHA and GQA (4 query heads on 2 KV heads), 200 (or 100) query and 333 key tokens (ragged tiles),
and 1000 x 1000 (many steps per backward task, so both dQ writers and every hand-off barrier take
turns); then forward calls, dense and, where built, packed, with more query tiles than the device has
SMs, so that CTAs reuse their O slots (csrc/kernels/fwd/fwd_epilogue.h).
Run on the GPU machine:

    compute-sanitizer --tool memcheck|racecheck|synccheck --error-exitcode 9 python tools/sanitize_small.py
"""

import torch

import dash_fa3
from dash_fa3 import _ext, variants


def _built(hdim, hdim_v, mask, packed=False):
    """Whether both directions' bf16 kernels of this mask kind and layout are built."""
    name = variants.Variant(hdim, "bf16", mask, hdim_v).name
    return all(name in _ext.built_variants(d, packed, False) for d in ("fwd", "bwd"))


PAIRS = sorted({(v.hdim, v.hdim_v) for v in map(variants.Variant.parse, _ext.built_variants("bwd", False, False))
                if v.dtype == "bf16"})

CASES = [  # (seqlen_q, seqlen_k, mask kind, flash_attn_func mask arguments)
    (200, 333, "full", dict(causal=False)),
    (200, 333, "causal", dict(causal=True)),
    (1000, 1000, "full", dict(causal=False)),
    (1000, 1000, "causal", dict(causal=True)),
    (200, 333, "local", dict(window_size=(30, 20))),
    (100, 333, "local", dict(window_size=(64, 0))),  # keys < 169 are seen by no query: KV tile 0 has no step
]

ran = 0
for d, dv in PAIRS:
    for sq, sk, kind, mask in CASES:
        if not _built(d, dv, kind):
            continue
        for det in (False, True):
            for hq, hk in ((2, 2), (4, 2)):
                q = torch.randn(1, sq, hq, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                k = torch.randn(1, sk, hk, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                v = torch.randn(1, sk, hk, dv, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                out = dash_fa3.flash_attn_func(q, k, v, deterministic=det, **mask)
                out = out[0] if isinstance(out, tuple) else out
                out.float().sum().backward()
                ran += 1

# 16 heads x 16 query tiles of 128 rows: about two tiles per CTA on 132 SMs.
for d, dv in PAIRS:
    for causal, kind in ((False, "full"), (True, "causal")):
        if not _built(d, dv, kind):
            continue
        q = torch.randn(1, 2048, 16, d, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(1, 1000, 16, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(1, 1000, 16, dv, device="cuda", dtype=torch.bfloat16)
        dash_fa3.flash_attn_func(q, k, v, causal=causal)
        ran += 1
        if _built(d, dv, kind, packed=True):
            # Packed documents: whole tiles leave by TMA, each document's partial last tile from registers.
            cu = torch.tensor([0, 700, 1000, 1900, 2048], dtype=torch.int32, device="cuda")
            vp = torch.randn(2048, 16, dv, device="cuda", dtype=torch.bfloat16)
            dash_fa3.flash_attn_varlen_func(q[0], q[0], vp, cu, cu, 900, 900, causal=causal)
            ran += 1
# Dense causal at 4096 query rows (hdim 64 runs its three-warpgroup kernel from 2048); the causal kernels
# take their tiles off a counter through the producer-to-MMA hand-off (fwd_tile_scheduler.h).
for d, dv in PAIRS:
    if not _built(d, dv, "causal"):
        continue
    q = torch.randn(1, 4096, 8, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 4096, 8, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(1, 4096, 8, dv, device="cuda", dtype=torch.bfloat16)
    dash_fa3.flash_attn_func(q, k, v, causal=True)
    ran += 1
torch.cuda.synchronize()
if ran == 0:
    raise SystemExit("sanitize_small: the build has no bf16 kernel pair to run")
print(f"sanitize_small: all {ran} calls ran (pairs {PAIRS})")
