#include "base/secure.h"

#include <openssl/evp.h>
#include <sys/random.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "absl/strings/str_cat.h"

namespace cpfill {

absl::Status SecureRandom(void* out, size_t n) {
  auto* p = static_cast<unsigned char*>(out);
  while (n > 0) {
    const ssize_t got = getrandom(p, n, 0);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) {
      return absl::InternalError(absl::StrCat("getrandom failed (errno ", errno, ")"));
    }
    p += got;
    n -= static_cast<size_t>(got);
  }
  return absl::OkStatus();
}

void SecureRandomOrDie(void* out, size_t n) {
  if (absl::Status s = SecureRandom(out, n); !s.ok()) {
    std::fprintf(stderr, "cpfill: fatal: no random bytes for a capability: %s\n",
                 s.ToString().c_str());
    std::abort();
  }
}

std::string RandomHex(size_t bytes) {
  std::vector<unsigned char> raw(bytes);
  SecureRandomOrDie(raw.data(), raw.size());
  static constexpr char kHex[] = "0123456789abcdef";
  std::string hex;
  hex.reserve(2 * bytes);
  for (unsigned char c : raw) {
    hex.push_back(kHex[c >> 4]);
    hex.push_back(kHex[c & 15]);
  }
  return hex;
}

Sha256Digest Sha256(std::string_view bytes) {
  Sha256Digest d{};
  unsigned int n = 0;
  EVP_Digest(bytes.data(), bytes.size(), d.data(), &n, EVP_sha256(), nullptr);
  return d;
}

bool ConstantTimeEqual(std::string_view a, std::string_view b) {
  const size_t n = a.size() > b.size() ? a.size() : b.size();
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  for (size_t i = 0; i < n; ++i) {
    const unsigned char x = i < a.size() ? static_cast<unsigned char>(a[i]) : 0;
    const unsigned char y = i < b.size() ? static_cast<unsigned char>(b[i]) : 0;
    diff |= static_cast<unsigned char>(x ^ y);
  }
  // The loop's result must not be cut short by the optimizer: read it through a volatile.
  volatile unsigned char result = diff;
  return result == 0;
}

}  // namespace cpfill
