// cpfill/runtime/model/cpu/fp8_linear.h — the row-wise FP8 linear layer on the CPU, emulating
// the GPU's arithmetic exactly (fp8.h): activations quantized per token, E4M3 products summed in
// fp32 (exact products; only the sums round), then times x_scale[t] * w_scale[o].
//
//   Fp8LinearScratch scratch;
//   LinearFp8Rowwise(x, tokens, in, w.codes.data(), w.row_scale.data(), out, /*ub=*/1200.0f,
//                    /*per_row=*/false, y, &scratch);
#pragma once

#include <cstdint>
#include <vector>

namespace cpfill::runtime::cpu {

// Buffers kept between calls: decoded E4M3 values of the activations and the weight, the
// activations' codes and scales.
struct Fp8LinearScratch {
  std::vector<float> x_values, w_values, x_scale;
  std::vector<uint8_t> x_codes;
};

// y [tokens, out] = Q(x) [tokens, in] * W^T with W [out, in] given as E4M3 `w_codes` and
// `w_scale` [out]. `per_row`: one row at a time (batch invariant, as LinearPerRow).
void LinearFp8Rowwise(const float* x, int64_t tokens, int64_t in, const uint8_t* w_codes,
                      const float* w_scale, int64_t out, float activation_scale_ub, bool per_row,
                      float* y, Fp8LinearScratch* scratch);

}  // namespace cpfill::runtime::cpu
