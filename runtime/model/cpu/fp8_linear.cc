#include "runtime/model/cpu/fp8_linear.h"

#include "runtime/model/cpu/layers.h"
#include "runtime/model/fp8.h"

namespace cpfill::runtime::cpu {
namespace {

void Decode(const uint8_t* codes, int64_t n, std::vector<float>* values) {
  values->resize(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) (*values)[i] = E4M3ToFloat(codes[i]);
}

}  // namespace

void LinearFp8Rowwise(const float* x, int64_t tokens, int64_t in, const uint8_t* w_codes,
                      const float* w_scale, int64_t out, float activation_scale_ub, bool per_row,
                      float* y, Fp8LinearScratch* s) {
  if (tokens == 0 || out == 0) return;
  s->x_codes.resize(static_cast<size_t>(tokens * in));
  s->x_scale.resize(static_cast<size_t>(tokens));
  QuantizeActivations(x, tokens, in, activation_scale_ub, s->x_codes.data(), s->x_scale.data());
  Decode(s->x_codes.data(), tokens * in, &s->x_values);
  // Decoded per call rather than kept: an fp32 copy would cost the host 4x the FP8 weights.
  Decode(w_codes, out * in, &s->w_values);
  if (per_row) {
    LinearPerRow(s->x_values.data(), tokens, in, s->w_values.data(), out, y);
  } else {
    Linear(s->x_values.data(), tokens, in, s->w_values.data(), out, y);
  }
  // The scales after the sum, as the GPU's epilogue applies them: (acc) * (x_scale * w_scale).
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t o = 0; o < out; ++o) y[t * out + o] *= s->x_scale[t] * w_scale[o];
  }
}

}  // namespace cpfill::runtime::cpu
