// cpfill/runtime/model/sampling_draw.h — the random part of sampling, written once for the host
// (sampling.cc) and the device (cuda/token_draw.cu), so both draw the same token from the same
// logits.
//
// A draw is Gumbel-max: among the tokens sampling keeps, the one with the largest
//   logit / temperature + G,   G = -log(-log(u)),   u uniform in (0, 1) from (seed, step, id),
// which is a sample of the kept tokens' softmax at the temperature. Each token's score depends on
// its own logit and its own noise only, so a vocabulary split over ranks or threads draws the
// same token whatever the split, and no cumulative sum in a fixed order is needed (an inverse-CDF
// draw would be, and a device's parallel scan would not reproduce the host's).
//
//   const uint64_t key = DrawKey(seed, step);
//   double best = DrawScore(z[0], 1 / temperature, key, 0);   // ... the largest over the kept ids
#pragma once

#include <cmath>
#include <cstdint>

#include "base/random.h"

namespace cpfill::runtime {

// The counter of one draw: generation step `step` of a request seeded `seed`.
CPFILL_HD inline uint64_t DrawKey(uint64_t seed, uint64_t step) {
  return Mix64(Mix64(seed) ^ step);
}

// Token `id`'s Gumbel noise in draw `key`: u from 53 bits, centred in its interval (never 0 or 1).
CPFILL_HD inline double GumbelNoise(uint64_t key, int64_t id) {
  const double u =
      (static_cast<double>(Mix64(key ^ Mix64(static_cast<uint64_t>(id))) >> 11) + 0.5) * 0x1.0p-53;
#if defined(__CUDA_ARCH__)
  return -log(-log(u));
#else
  return -std::log(-std::log(u));
#endif
}

// The score a draw maximizes (ties: the lower id).
CPFILL_HD inline double DrawScore(float logit, double scale, uint64_t key, int64_t id) {
  return static_cast<double>(logit) * scale + GumbelNoise(key, id);
}

// A float as an unsigned integer of the same order (a larger float, a larger integer; -0 as +0),
// for radix selection of the most likely tokens.
CPFILL_HD inline uint32_t OrderedBits(float x) {
  if (x == 0.0f) x = 0.0f;
  uint32_t b;
#if defined(__CUDA_ARCH__)
  b = __float_as_uint(x);
#else
  __builtin_memcpy(&b, &x, sizeof b);
#endif
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

}  // namespace cpfill::runtime
