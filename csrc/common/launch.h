// Kernel entry points, one per direction and variant. The instantiation files
// (csrc/instantiations/, generated from dash_fa3/variants.py) define them; the
// dispatch in csrc/api/ picks one from the runtime arguments.
#pragma once

#include <cuda_runtime.h>

#include "kernel_contract.h"  // generated: bwd_block_m / bwd_block_n (dash_fa3/schedule/contract.py)
#include "params.h"

namespace dash_fa3 {

// kPacked: the instantiation for packed documents (FwdParams::cu_seqlens_q
// given); the dense one carries no per-document code. kSoftcap: the one for
// softcap > 0 (common/softcap.h); the others carry no tanh. kHeadDimV: the
// head dim of V and O (equal to kHeadDim but for MLA's (192, 128)).
template <int kHeadDim, int kHeadDimV, DType kDType, MaskKind kMask, bool kPacked, bool kSoftcap>
void run_fwd(const FwdParams& params, cudaStream_t stream);

// Before a packed forward (run_fwd<..., true> launches it).
void run_fwd_packed_order(const FwdPackedOrderParams& params, cudaStream_t stream);

void run_bwd_preprocess(const BwdPreprocessParams& params, DType dtype, cudaStream_t stream);
void run_bwd_postprocess(const BwdPostprocessParams& params, DType dtype, cudaStream_t stream);

}  // namespace dash_fa3

namespace dash_fa3 {

// Backward main kernel (csrc/kernels/bwd/bwd_launch.cuh). Its tiles are
// bwd_block_m(headdim) x bwd_block_n(headdim) (kernel_contract.h); block_m is
// also the preprocess's rounding of seqlen_q. kHeadDimV, kPacked and kSoftcap
// as for run_fwd.
template <int kHeadDim, int kHeadDimV, DType kDType, MaskKind kMask, bool kPacked, bool kSoftcap>
void run_bwd(const BwdParams& params, cudaStream_t stream);

}  // namespace dash_fa3
