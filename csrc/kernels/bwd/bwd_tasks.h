// Which task rows of the schedule this CTA runs. Static dispatch only: CTA c
// runs rows [cta_offsets[c], cta_offsets[c + 1]) in order. Every role (producer,
// MMA, dQ writer) walks the same rows independently and decodes each step
// itself, so no task index is passed between warps. The launcher rejects
// dynamic-dispatch schedules (header[dispatch] == 1).
#pragma once

#include <cute/config.hpp>

#include "schedules/schedule_metadata.h"

namespace dash_fa3::bwd {

struct CtaTasks {
  int begin;
  int end;
  CUTE_DEVICE static CtaTasks of(int32_t const* meta) {
    int32_t const* offsets = schedule::offsets_of(meta);
    return {offsets[blockIdx.x], offsets[blockIdx.x + 1]};
  }
};

}  // namespace dash_fa3::bwd
