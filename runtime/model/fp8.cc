// cpfill/runtime/model/fp8.cc — E4M3 encoding and row-wise quantization on the host.
#include "runtime/model/fp8.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"

namespace cpfill::runtime {

uint8_t FloatToE4M3(float x) {
  const uint8_t sign = std::signbit(x) ? 0x80 : 0x00;
  if (std::isnan(x)) return sign | 0x7f;
  const float a = std::min(std::fabs(x), kE4M3Max);  // saturate (inf included)
  if (a == 0.0f) return sign;
  // Quantum of a's binade: 2^(e - 3) for normals (3 mantissa bits), 2^-9 below 2^-6. a / quantum
  // is exact (a power of two), so nearbyint rounds a itself to nearest even.
  const int e = std::max(std::ilogb(a), -6);
  const float q = std::nearbyint(std::ldexp(a, 3 - e));  // in [8, 16] (or [0, 8] subnormal)
  // Code = (biased exponent << 3) + mantissa; q == 16 carries into the next exponent with the
  // same formula, and subnormals (e == -6, q < 8) land on exponent field 0.
  const int code = (e + 6) * 8 + static_cast<int>(q);
  return sign | static_cast<uint8_t>(code);
}

float E4M3ToFloat(uint8_t code) {
  const float sign = (code & 0x80) ? -1.0f : 1.0f;
  const int exponent = (code >> 3) & 0xf;
  const int mantissa = code & 0x7;
  if (exponent == 0xf && mantissa == 0x7) return std::nanf("");
  if (exponent == 0) return sign * std::ldexp(static_cast<float>(mantissa), -9);
  return sign * std::ldexp(static_cast<float>(8 + mantissa), exponent - 10);
}

float QuantizeRowSlice(const float* whole_row, int64_t cols, int64_t col0, int64_t ncols,
                       uint8_t* codes) {
  float amax = 0.0f;
  for (int64_t c = 0; c < cols; ++c) amax = std::max(amax, std::fabs(whole_row[c]));
  const float scale = std::max(amax, kFp8MinRowMax) / kE4M3Max;
  for (int64_t c = 0; c < ncols; ++c) codes[c] = FloatToE4M3(whole_row[col0 + c] / scale);
  return scale;
}

Fp8Matrix QuantizeRowwise(const float* w, int64_t rows, int64_t cols) {
  Fp8Matrix m;
  m.codes.resize(static_cast<size_t>(rows * cols));
  m.row_scale.resize(static_cast<size_t>(rows));
  for (int64_t r = 0; r < rows; ++r) {
    m.row_scale[r] = QuantizeRowSlice(w + r * cols, cols, 0, cols, m.codes.data() + r * cols);
  }
  return m;
}

void QuantizeActivations(const float* x, int64_t tokens, int64_t in, float scale_ub, uint8_t* xq,
                         float* x_scale) {
  for (int64_t t = 0; t < tokens; ++t) {
    const float* row = x + t * in;
    float amax = 0.0f;
    for (int64_t i = 0; i < in; ++i) amax = std::max(amax, std::fabs(row[i]));
    if (scale_ub > 0) amax = std::min(amax, scale_ub);
    const float scale = std::max(amax, kFp8MinRowMax) / kE4M3Max;
    x_scale[t] = scale;
    for (int64_t i = 0; i < in; ++i) xq[t * in + i] = FloatToE4M3(row[i] / scale);
  }
}

bool Fp8Quantization::Quantizes(std::string_view module) const {
  if (modules == Fp8Modules::kNone) return false;
  for (const std::string& skip : modules_to_not_convert) {
    // fbgemm matches by name containment ("lm_head" skips "lm_head", a layer's full name skips it).
    if (!skip.empty() && module.find(skip) != std::string_view::npos) return false;
  }
  const bool ffn = module.find(".mlp.") != std::string_view::npos;
  const bool attention = module.find(".self_attn.") != std::string_view::npos;
  return ffn || (attention && modules == Fp8Modules::kAll);
}

absl::StatusOr<Fp8Modules> ParseQuantizeFlag(std::string_view flag) {
  if (flag == "none" || flag.empty()) return Fp8Modules::kNone;
  if (flag == "fp8-rowwise" || flag == "fp8-rowwise:ffn") return Fp8Modules::kFfn;
  if (flag == "fp8-rowwise:all") return Fp8Modules::kAll;
  return absl::InvalidArgumentError(
      absl::StrCat("--quantize '", std::string(flag),
                   "': expected fp8-rowwise, fp8-rowwise:ffn, fp8-rowwise:all or none"));
}

}  // namespace cpfill::runtime
