// cpfill/base/secure.h — what capabilities and secrets need: random bytes from the operating
// system's CSPRNG, SHA-256, and comparison in constant time.
//
//   std::array<uint8_t, 16> id;  CPFILL_RETURN_IF_ERROR(SecureRandom(id.data(), id.size()));
//   Sha256Digest d = Sha256("what a rank published");
//   if (!ConstantTimeEqual(given, expected)) return absl::UnauthenticatedError("...");
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "absl/status/status.h"

namespace cpfill {

// `n` bytes from getrandom(2) (the kernel's CSPRNG), retried on EINTR; Internal when the kernel
// cannot give them (never a weaker fallback).
absl::Status SecureRandom(void* out, size_t n);
// SecureRandom for a capability: aborts the process if the CSPRNG fails, since no capability may
// be made without it.
void SecureRandomOrDie(void* out, size_t n);
// A value of `bytes` random bytes (SecureRandomOrDie) as lowercase hex.
std::string RandomHex(size_t bytes);

using Sha256Digest = std::array<uint8_t, 32>;
Sha256Digest Sha256(std::string_view bytes);

// Whether `a` equals `b`, in time that depends on their lengths only (no early exit at the first
// difference): for nonces, keys and tokens a client presents.
bool ConstantTimeEqual(std::string_view a, std::string_view b);

}  // namespace cpfill
