// cpfill/runtime/model/fp8.h — row-wise FP8 (E4M3) linear layers as fbgemm's `fbgemm_fp8`
// checkpoints define them, emulated exactly on the host.
//
// A weight W [out, in] is stored as E4M3 codes with one fp32 scale per output row:
//   w_scale[o] = max_i |W[o, i]| / 448,   code[o, i] = E4M3(W[o, i] / w_scale[o])  (RNE,
//   saturating)
// Activations are quantized per token (row) at run time, with the checkpoint's upper bound:
//   x_scale[t] = min(max_i |x[t, i]|, activation_scale_ub) / 448,  xq[t, i] = E4M3(x / x_scale[t])
// and y[t, o] = (sum_i xq[t, i] * code[o, i]) * (x_scale[t] * w_scale[o]), summed in fp32.
// (fbgemm's quantize_fp8_per_row multiplies by 448 / max instead of dividing by the scale: the
// two can pick neighbouring codes where x / scale is within an ulp of a tie.) Under tensor
// parallelism a row-parallel projection's (o, down) ranks each quantize the slice of a token's
// row they hold, with its own scale, as vLLM does: TP ranks give slightly different codes than
// one rank, each exact for its slice.
// The products of two E4M3 values are exact in fp32, so the CPU backend's result differs from an
// fp64 evaluation of the same codes only by the fp32 rounding of the sums.
//
//   Fp8Matrix q = QuantizeRowwise(w.data(), out, in);                 // at load
//   std::vector<uint8_t> xq(T * in);  std::vector<float> xs(T);
//   QuantizeActivations(x, T, in, /*ub=*/1200.0f, xq.data(), xs.data());
//   float v = E4M3ToFloat(FloatToE4M3(3.3f));                           // 3.25
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace cpfill::runtime {

// OCP E4M3 ("e4m3fn"): sign, 4 exponent bits (bias 7), 3 mantissa bits, no infinities;
// S.1111.111 is NaN, the largest finite value is 448 (0x7e).
inline constexpr float kE4M3Max = 448.0f;
// fbgemm's floor on a row's max |x| (quantize_fp8_per_row): an all-zero row gets a tiny scale
// rather than a division by zero.
inline constexpr float kFp8MinRowMax = 1e-12f;

// Round to nearest even; |x| > 448 and +-inf saturate to +-448 (as CUDA's __NV_SATFINITE);
// NaN maps to 0x7f with x's sign.
uint8_t FloatToE4M3(float x);
float E4M3ToFloat(uint8_t code);

// A matrix [rows, cols] in row-wise FP8. Row r of the real matrix is
// E4M3ToFloat(codes[r, :]) * row_scale[r].
struct Fp8Matrix {
  std::vector<uint8_t> codes;    // [rows, cols] row-major E4M3
  std::vector<float> row_scale;  // [rows]
  bool empty() const { return codes.empty(); }
};

// scale = max(max|v|, kFp8MinRowMax) / 448 over `whole_row` (all `cols` values: a row-parallel
// TP slice must use its whole row's scale), then codes of columns [col0, col0 + ncols).
float QuantizeRowSlice(const float* whole_row, int64_t cols, int64_t col0, int64_t ncols,
                       uint8_t* codes);
Fp8Matrix QuantizeRowwise(const float* w, int64_t rows, int64_t cols);

// Per-token quantization of x [tokens, in] with the upper bound `scale_ub` (<= 0: none).
void QuantizeActivations(const float* x, int64_t tokens, int64_t in, float scale_ub, uint8_t* xq,
                         float* x_scale);

// Which projections are row-wise FP8. A checkpoint's quantization_config names the method and
// the modules left in high precision; --quantize chooses ffn (gate/up/down) or all (also q/k/v/o).
enum class Fp8Modules { kNone, kFfn, kAll };
struct Fp8Quantization {
  Fp8Modules modules = Fp8Modules::kNone;
  float activation_scale_ub = 1200.0f;  // fbgemm's default
  // HF module names ("model.layers.0.self_attn.q_proj", "lm_head") that stay in bf16/fp32.
  std::vector<std::string> modules_to_not_convert;
  bool from_checkpoint = false;  // config.json had quantization_config

  bool enabled() const { return modules != Fp8Modules::kNone; }
  // `module` is an HF module name, e.g. "model.layers.3.mlp.down_proj".
  bool Quantizes(std::string_view module) const;
};

// "fp8-rowwise" (= ffn), "fp8-rowwise:ffn", "fp8-rowwise:all", "none"; InvalidArgument otherwise.
absl::StatusOr<Fp8Modules> ParseQuantizeFlag(std::string_view flag);

}  // namespace cpfill::runtime
