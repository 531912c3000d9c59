// cpfill/base/random.h — stable hashes and counter-based random numbers: any element of a synthetic tensor can be
// generated from (seed, stream, index) alone, so every rank makes exactly its own shard of a batch
// and a single-rank reference makes the whole batch, bit-identical, with no communication.
//
//   float x = UniformAt(seed, /*stream=*/kStreamQ, element_index);   // in [-1, 1)
#pragma once

#include <cstdint>
#include <string_view>

#include "base/host_device.h"  // Mix64: the device's token draw uses the host's generator

namespace cpfill {

// FNV-1a, 64 bits: a hash of bytes that every process and build agrees on (std::hash does not
// promise that): synthetic weights' tensor names, the KV hand-off's compatibility hash.
inline uint64_t Fnv1a64(std::string_view bytes) {
  uint64_t hash = 0xcbf29ce484222325ull;
  for (const char c : bytes) {
    hash ^= static_cast<unsigned char>(c);
    hash *= 0x100000001b3ull;
  }
  return hash;
}

// SplitMix64 finaliser: a bijective mix with full avalanche, the usual counter-based generator.
CPFILL_HD inline uint64_t Mix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// Uniform in [-1, 1) from 24 random bits (exact in fp32).
inline float UniformAt(uint64_t seed, uint64_t stream, uint64_t index) {
  const uint64_t r = Mix64(Mix64(seed ^ Mix64(stream)) ^ index);
  return static_cast<float>(static_cast<int64_t>(r >> 40) - (int64_t{1} << 23)) *
         (1.0f / static_cast<float>(int64_t{1} << 23));
}

}  // namespace cpfill
