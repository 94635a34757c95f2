// Op registration. TORCH_LIBRARY (not pybind11) keeps the .so free of the
// Python ABI, so one build loads under every CPython via torch.ops.load_library.
// The Python package builds the public dash_fa3:: ops on these.
#include <torch/library.h>

#include "api.h"

TORCH_LIBRARY(dash_fa3_C, m) {
  m.def("fwd(Tensor q, Tensor k, Tensor v, float softmax_scale, bool causal, int sm_margin) -> (Tensor, Tensor)");
  // The forward with a window (left, right), -1 unbounded; dash_fa3::fwd_general runs it.
  m.def(
      "fwd_window(Tensor q, Tensor k, Tensor v, float softmax_scale, int window_left, int window_right,"
      " float softcap, int sm_margin) -> (Tensor, Tensor)");
  // The forward over packed documents (FA3's varlen layout); dash_fa3::fwd_general runs it.
  m.def(
      "fwd_varlen(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, int max_seqlen_q,"
      " int max_seqlen_k, float softmax_scale, int window_left, int window_right, float softcap, int sm_margin)"
      " -> (Tensor, Tensor)");
  // The whole backward in one call; schedule is dash_fa3.schedule's flat int32
  // metadata on the device, schedule_header its first entries on the host
  // (checked before launch); the window picks the mask kind as in fwd_window.
  m.def(
      "bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor schedule,"
      " Tensor schedule_header, float softmax_scale, int window_left, int window_right, float softcap,"
      " bool deterministic)"
      " -> (Tensor, Tensor, Tensor)");
  // The deterministic backward with fp32 dK/dV (the group sums, not rounded):
  // context parallelism's partials (dash_fa3/distributed/superblocks.py).
  m.def(
      "bwd_dkv_fp32(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor schedule,"
      " Tensor schedule_header, float softmax_scale, int window_left, int window_right)"
      " -> (Tensor, Tensor, Tensor)");
  // The backward over packed documents; dash_fa3::bwd_general runs it.
  m.def(
      "bwd_varlen(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor cu_seqlens_q,"
      " Tensor cu_seqlens_k, int max_seqlen_q, int max_seqlen_k, Tensor schedule, Tensor schedule_header,"
      " float softmax_scale, int window_left, int window_right, float softcap, bool deterministic)"
      " -> (Tensor, Tensor, Tensor)");
  m.def(
      "bwd_preprocess(Tensor out, Tensor dout, Tensor lse, int block_m)"
      " -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("bwd_postprocess(Tensor dq_accum, int seqlen_q, float softmax_scale, ScalarType dtype) -> Tensor");
  // The variant names of one kernel family (packed documents, softcap).
  m.def("built_fwd_variants(bool packed, bool softcap) -> str[]", &dash_fa3::built_fwd_variants);
  m.def("built_bwd_variants(bool packed, bool softcap) -> str[]", &dash_fa3::built_bwd_variants);
}

TORCH_LIBRARY_IMPL(dash_fa3_C, CUDA, m) {
  m.impl("fwd", &dash_fa3::fwd);
  m.impl("fwd_window", &dash_fa3::fwd_window);
  m.impl("fwd_varlen", &dash_fa3::fwd_varlen);
  m.impl("bwd", &dash_fa3::bwd);
  m.impl("bwd_dkv_fp32", &dash_fa3::bwd_dkv_fp32);
  m.impl("bwd_varlen", &dash_fa3::bwd_varlen);
  m.impl("bwd_preprocess", &dash_fa3::bwd_preprocess);
  m.impl("bwd_postprocess", &dash_fa3::bwd_postprocess);
}

// The public forward op, dash_fa3::fwd, is defined in Python (dash_fa3/ops.py,
// so the CPU reference serves it without this library); its CUDA kernel is
// this function directly, so an eager call crosses into Python only once.
TORCH_LIBRARY_IMPL(dash_fa3, CUDA, m) { m.impl("fwd", &dash_fa3::fwd); }
