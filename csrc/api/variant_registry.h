// The compiled variants of one direction (forward or backward) and the lookup
// that maps runtime arguments to one of them, shared by the two dispatch files.
// A window picks its mask kind with mask_kind_of (common/params.h).
#pragma once

#include <string>
#include <vector>

#include <cuda_runtime.h>

#include "common/params.h"
#include "message.h"

namespace dash_fa3 {

template <class Params>
struct KernelVariant {
  int hdim;
  int hdim_v;  // V's (and O's) head dim
  DType dtype;
  MaskKind mask;
  bool packed;   // the packed-document instantiation (DASH_FA3_LAYOUTS)
  bool softcap;  // the softcap instantiation (DASH_FA3_SOFTCAP)
  const char* name;
  void (*launch)(const Params&, cudaStream_t);
};

// The names of the table's kernels of one family (layout, softcap).
template <class Params>
std::vector<std::string> variant_names(const std::vector<KernelVariant<Params>>& table, bool packed, bool softcap) {
  std::vector<std::string> names;
  for (const auto& v : table) {
    if (v.packed == packed && v.softcap == softcap) names.emplace_back(v.name);
  }
  return names;
}

// The kernel for (hdim, hdim_v, dtype, mask) in the family (packed, softcap); a
// TORCH_CHECK error naming what this family was built with otherwise, and the
// build switches that add the missing kernel. direction: "forward" or "backward".
template <class Params>
const KernelVariant<Params>& find_variant(const std::vector<KernelVariant<Params>>& table, const char* direction,
                                          int64_t hdim, int64_t hdim_v, DType dtype, MaskKind mask, bool packed,
                                          bool softcap) {
  const KernelVariant<Params>* found = nullptr;
  for (const auto& v : table) {
    if (v.hdim == hdim && v.hdim_v == hdim_v && v.dtype == dtype && v.mask == mask && v.packed == packed &&
        v.softcap == softcap) {
      found = &v;
    }
  }
  if (found == nullptr) {
    std::string built;
    for (const auto& name : variant_names(table, packed, softcap)) built += (built.empty() ? "" : ", ") + name;
    TORCH_CHECK(false, msg("dash_fa3: no ", packed ? "packed " : "", softcap ? "softcap " : "", direction,
                           " kernel for hdim", hdim, hdim_v == hdim ? "" : msg("v", hdim_v), "-",
                           dtype == DType::kBF16 ? "bf16" : "fp16", "-",
                           mask_kind_name(mask), " in this build (built: ", built.empty() ? std::string("none") : built,
                           "); rebuild with DASH_FA3_VARIANTS naming it (e.g. DASH_FA3_VARIANTS=hdim", hdim,
                           hdim_v == hdim ? "" : msg("v", hdim_v), ")",
                           packed ? ", DASH_FA3_LAYOUTS unset or naming packed" : "",
                           softcap ? ", DASH_FA3_SOFTCAP=1" : ""));
  }
  return *found;
}

}  // namespace dash_fa3
