"""The schemas of the public ops ``dash_fa3::fwd`` and ``dash_fa3::bwd``, and of
``dash_fa3::fwd_general`` / ``bwd_general`` (sliding windows, softcap, packed
variable-length batches; the fp32 reference on CPU; on CUDA the kernels,
softcap in DASH_FA3_SOFTCAP=1 builds, dash_fa3/ops.py).

They are defined in Python so the CPU reference can serve them on machines
without the compiled extension; the extension registers its CUDA kernel for
``dash_fa3::fwd`` when it loads (csrc/api/binding.cpp), and ``_ext`` imports
this module first so the schema always exists by then.
"""

import torch

LIB = torch.library.Library("dash_fa3", "DEF")
LIB.define("fwd(Tensor q, Tensor k, Tensor v, float softmax_scale, bool causal, int sm_margin) -> (Tensor, Tensor)")
LIB.define(
    "bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, float softmax_scale, bool causal, "
    "bool deterministic, str schedule, int sm_margin) -> (Tensor, Tensor, Tensor)"
)
# window_left/right: FA3's window_size with causal folded in (right = 0); -1 = unbounded.
# cu_seqlens_q/k: None for (batch, seqlen, heads, d) tensors, else int32 offsets of packed
# (total, heads, d) tensors; max_seqlen_q/k are then the longest documents (0 otherwise).
LIB.define(
    "fwd_general(Tensor q, Tensor k, Tensor v, Tensor? cu_seqlens_q, Tensor? cu_seqlens_k, int max_seqlen_q, "
    "int max_seqlen_k, float softmax_scale, int window_left, int window_right, float softcap, int sm_margin) "
    "-> (Tensor, Tensor)"
)
LIB.define(
    "bwd_general(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor? cu_seqlens_q, "
    "Tensor? cu_seqlens_k, int max_seqlen_q, int max_seqlen_k, float softmax_scale, int window_left, "
    "int window_right, float softcap, bool deterministic, str schedule, int sm_margin) -> (Tensor, Tensor, Tensor)"
)
