// cpfill/base/bfloat16.h — bf16 conversions on the host (the CUDA backend stores bf16; inputs
// are made on the host in fp32, and checks need to see the same rounded numbers).
//
//   uint16_t bits = FloatToBfloat16Bits(x);       // round to nearest, ties to even
//   RoundToBfloat16(values);                       // in place: what the GPU will see
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

namespace cpfill {

inline uint16_t FloatToBfloat16Bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest, ties to even
  return static_cast<uint16_t>(u >> 16);
}

inline float Bfloat16BitsToFloat(uint16_t bits) {
  const uint32_t u = static_cast<uint32_t>(bits) << 16;
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}

inline void RoundToBfloat16(std::vector<float>& values) {
  for (float& x : values) x = Bfloat16BitsToFloat(FloatToBfloat16Bits(x));
}

inline std::vector<uint16_t> ToBfloat16(const std::vector<float>& values) {
  std::vector<uint16_t> out(values.size());
  for (size_t i = 0; i < values.size(); ++i) out[i] = FloatToBfloat16Bits(values[i]);
  return out;
}

}  // namespace cpfill
