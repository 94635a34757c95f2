"""The schemas of the public ops ``dash_fa3::fwd`` and ``dash_fa3::bwd``.

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
