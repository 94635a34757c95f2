// Which task rows of the schedule this CTA runs. Static dispatch only: CTA c
// runs rows [cta_offsets[c], cta_offsets[c + 1]) in order. Every role (producer,
// MMA, dQ writer) walks the same rows independently and decodes each step
// itself, so no task index is passed between warps. The launcher rejects
// dynamic-dispatch schedules (header[dispatch] == 1).
#pragma once

#include <cute/config.hpp>

#include <cstdint>

namespace dash_fa3::bwd {

struct CtaTasks {
  int begin;
  int end;
  CUTE_DEVICE static CtaTasks of(int32_t const* cta_offsets) {
    return {cta_offsets[blockIdx.x], cta_offsets[blockIdx.x + 1]};
  }
};

}  // namespace dash_fa3::bwd
