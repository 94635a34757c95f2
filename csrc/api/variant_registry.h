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
  DType dtype;
  MaskKind mask;
  const char* name;
  void (*launch)(const Params&, cudaStream_t);
};

template <class Params>
std::vector<std::string> variant_names(const std::vector<KernelVariant<Params>>& table) {
  std::vector<std::string> names;
  for (const auto& v : table) names.emplace_back(v.name);
  return names;
}

template <class Params>
std::string variant_list(const std::vector<KernelVariant<Params>>& table) {
  std::string list;
  for (const auto& v : table) list += (list.empty() ? "" : ", ") + std::string(v.name);
  return list;
}

// The variant for (hdim, dtype, mask); a TORCH_CHECK error naming what was built otherwise.
// direction names the table in that error ("forward", "packed backward", ...);
// packed: the table of packed-document kernels (DASH_FA3_LAYOUTS may leave it out).
template <class Params>
const KernelVariant<Params>& find_variant(const std::vector<KernelVariant<Params>>& table, const char* direction,
                                          int64_t hdim, DType dtype, MaskKind mask, bool packed = false) {
  const KernelVariant<Params>* found = nullptr;
  for (const auto& v : table) {
    if (v.hdim == hdim && v.dtype == dtype && v.mask == mask) found = &v;
  }
  TORCH_CHECK(found != nullptr, msg("dash_fa3: no ", direction, " kernel for hdim", hdim, "-",
                                    dtype == DType::kBF16 ? "bf16" : "fp16", "-", mask_kind_name(mask),
                                    " in this build (built: ", table.empty() ? std::string("none") : variant_list(table),
                                    "); rebuild with DASH_FA3_VARIANTS naming it",
                                    packed ? " and DASH_FA3_LAYOUTS unset or naming packed" : ""));
  return *found;
}

}  // namespace dash_fa3
