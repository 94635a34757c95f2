"""Shared helpers of the attention tests: the low-precision baseline and error checks."""

import pytest
import torch

from dash_fa3 import _ext, reference

TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}

# Our error may be at most this multiple of a plain PyTorch low-precision
# implementation's error on the same inputs (plus a tiny absolute floor).
ERR_FACTOR = 2.0
ERR_FLOOR = 1e-5


def attention_lowp(q, k, v, softmax_scale, causal, window_size=(-1, -1), softcap=0.0):
    """A plain PyTorch bf16/fp16 attention: matmuls in the input dtype, softmax in fp32.
    ``window_size`` as FA3's (with ``causal`` folded in); ``softcap`` > 0 caps the scores
    (softcap * tanh(scores / softcap), in fp32)."""
    heads = q.shape[2]
    qh, kh, vh = (reference._bhsd(t, heads, t.dtype) for t in (q, k, v))
    s = torch.matmul(qh, kh.transpose(-1, -2)).float() * softmax_scale
    if softcap > 0:
        s = torch.tanh(s / softcap) * softcap
    if causal or tuple(window_size) != (-1, -1):
        keep = reference.visible_mask(q.shape[1], k.shape[1], window_size, causal, q.device)
        s = s.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    shift = lse.masked_fill(lse == float("-inf"), float("inf"))
    p = torch.exp(s - shift.unsqueeze(-1)).to(q.dtype)
    return torch.matmul(p, vh).transpose(1, 2), lse


def max_abs_err(x, ref):
    return (x.double() - ref.double()).abs().max().item()


#: Below this many nonzero reference values the maximum error is one draw of a rounding
#: pattern, not a measure of precision. With causal masks and one to three visible keys (65
#: queries against 2 keys: two nonzero dQ rows) a dQ element is the 16-bit-rounded dS of
#: one or two keys times K; ours and the baseline round the same products, and the largest
#: of about 128 such errors exceeds twice the baseline's largest in a few percent of seeds,
#: in the deterministic and the non-deterministic mode alike (their bits are equal there).
#: ``test_gpu_bwd.py::test_dq_error_at_few_keys_is_rounding_noise`` measures this. There the
#: root-mean-square errors are compared instead, which such a draw does not dominate.
FEW_VALUES = 1024


def rms_err(x, ref):
    return (x.double() - ref.double()).pow(2).mean().sqrt().item()


def error_problem(ours, lowp, ref):
    """None if ``ours`` is within ERR_FACTOR of the low-precision baseline's error against the
    reference (the maximum error; the RMS error where fewer than FEW_VALUES reference values are
    nonzero), else what is wrong."""
    if torch.isnan(ours).any():
        return "NaN in output (unwritten or wrong)"
    finite = torch.isfinite(ref)
    if not torch.equal(torch.isfinite(ours), finite):
        return "infinities differ from the reference"
    ours, lowp, ref = ours[finite], lowp[finite], ref[finite]
    e_ours, e_lowp = max_abs_err(ours, ref), max_abs_err(lowp, ref)
    if e_ours <= ERR_FACTOR * e_lowp + ERR_FLOOR:
        return None
    if int(torch.count_nonzero(ref)) < FEW_VALUES:
        r_ours, r_lowp = rms_err(ours, ref), rms_err(lowp, ref)
        if r_ours <= ERR_FACTOR * r_lowp + ERR_FLOOR:
            return None
        return f"RMS error {r_ours:.3g} > {ERR_FACTOR} x baseline {r_lowp:.3g} (few values)"
    return f"error {e_ours:.3g} > {ERR_FACTOR} x baseline {e_lowp:.3g}"


def assert_close_to_ref(name, ours, lowp, ref):
    """ours vs the fp32 reference, within ERR_FACTOR of the low-precision baseline's error
    (:func:`error_problem`)."""
    problem = error_problem(ours, lowp, ref)
    assert problem is None, f"{name}: {problem}"


def assert_bitwise_repeatable(run, repeats):
    """``run()`` (a tuple of tensors) gives the same bits ``repeats`` more times on the current
    stream and once more on a side stream."""
    first = run()
    for _ in range(repeats):
        assert all(torch.equal(a, b) for a, b in zip(run(), first))
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        other = run()
    stream.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(other, first))


def require_built(v, direction, layout="dense", softcap=False):
    """Skip unless the extension has the ``direction`` ("fwd"/"bwd") kernel of variant ``v`` for
    ``layout`` (variants.LAYOUTS), the softcap one if ``softcap`` (variants.SOFTCAP_ENV)."""
    if v.name not in _ext.built_variants(direction, layout == "packed", softcap):
        pytest.skip(f"no {layout}{' softcap' if softcap else ''} {direction} kernel for {v.name} in this build")


def make_inputs(v, shape, seed):
    """Fresh random q, k, v and dout on the GPU for variant ``v`` (v and dout with its value
    head dim) and shape (batch, seqlen_q, seqlen_k, heads, heads_kv)."""
    b, sq, sk, h, hkv = shape
    g = torch.Generator(device="cuda").manual_seed(seed)
    dt = TORCH_DTYPES[v.dtype]
    return (
        torch.randn(b, sq, h, v.hdim, device="cuda", dtype=dt, generator=g),
        torch.randn(b, sk, hkv, v.hdim, device="cuda", dtype=dt, generator=g),
        torch.randn(b, sk, hkv, v.hdim_v, device="cuda", dtype=dt, generator=g),
        torch.randn(b, sq, h, v.hdim_v, device="cuda", dtype=dt, generator=g),
    )


def assert_model_close_to_reference(results, param_keys, baseline, factor, floor, min_checked=0):
    """A model run three ways: ``results`` maps "ref" (fp32), "eager" (the framework's
    own low-precision attention) and "ours" to (logits, {parameter name: gradient}).
    Our logits, and the gradients of every parameter whose name contains one of
    ``param_keys`` (relative to the gradient's largest entry), must be within
    ``factor`` of the baseline's error against fp32, plus ``floor`` (5 x for the
    gradients); at least ``min_checked`` such gradients are checked."""

    def err(a, b):
        return (a - b).abs().max().item()

    ref_logits, ref_grads = results["ref"]
    e_ours, e_eager = err(results["ours"][0], ref_logits), err(results["eager"][0], ref_logits)
    assert e_ours <= factor * e_eager + floor, f"logits: {e_ours:.3g} vs {baseline} {e_eager:.3g}"
    checked = 0
    for name, g in ref_grads.items():
        if not any(key in name for key in param_keys):
            continue
        scale = g.abs().max().item()
        e_ours, e_eager = err(results["ours"][1][name], g) / scale, err(results["eager"][1][name], g) / scale
        assert e_ours <= factor * e_eager + 5 * floor, f"{name}: {e_ours:.3g} vs {baseline} {e_eager:.3g}"
        checked += 1
    assert checked >= min_checked
