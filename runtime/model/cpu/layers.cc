// The Llama layer primitives on the CPU, fp32, matching Hugging Face's LlamaForCausalLM.
//
// Linear goes through OpenBLAS's cblas_sgemm. OpenBLAS threads are not set here: several MPI
// ranks share a host's cores, so the launcher sets OPENBLAS_NUM_THREADS in each rank's
// environment (read by OpenBLAS once, when the library loads); nothing in this file calls
// openblas_set_num_threads.
//
// The header's functions return void, so a broken precondition that the caller should have
// caught (a dimension past BLAS's 32-bit int, an odd head_dim, a head_dim that does not match the
// table) stops the process with a message naming the sizes instead of computing garbage.

#include "runtime/model/cpu/layers.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <numbers>

// Stops the process: the header functions return void (see the file comment).
#define CPFILL_LAYERS_CHECK(cond, fmt, ...)                                                  \
  do {                                                                                       \
    if (!(cond)) {                                                                           \
      std::fprintf(stderr, "%s:%d: check '%s' failed: " fmt "\n", __FILE__, __LINE__, #cond, \
                   __VA_ARGS__);                                                             \
      std::abort();                                                                          \
    }                                                                                        \
  } while (0)

namespace cpfill::runtime::cpu {
namespace {

// Debian's OpenBLAS is built with 32-bit blasint: every dimension and leading dimension passed to
// cblas_sgemm must fit an int. Rows (tokens) are split into blocks below this bound, so only `in`
// and `out` are limited.
constexpr int64_t kMaxBlasDim = std::numeric_limits<int>::max();

// RmsNorm hands the pool blocks of rows of about this many elements, so that the per-item
// overhead (an atomic and a std::function call) stays small against the work.
constexpr int64_t kRmsNormElementsPerItem = 1 << 16;

}  // namespace

void SetBlasThreads(int threads) { openblas_set_num_threads(threads > 0 ? threads : 1); }

void Linear(const float* x, int64_t tokens, int64_t in, const float* w, int64_t out, float* y,
            bool accumulate) {
  CPFILL_LAYERS_CHECK(tokens >= 0 && in >= 0 && out >= 0, "Linear: tokens %lld in %lld out %lld",
                      static_cast<long long>(tokens), static_cast<long long>(in),
                      static_cast<long long>(out));
  CPFILL_LAYERS_CHECK(in <= kMaxBlasDim && out <= kMaxBlasDim,
                      "Linear: in %lld or out %lld exceeds the BLAS int range",
                      static_cast<long long>(in), static_cast<long long>(out));
  if (tokens == 0 || out == 0) return;
  if (in == 0) {
    // An empty sum. BLAS would also reject lda = 0, so handle it here.
    if (!accumulate) std::fill(y, y + tokens * out, 0.0f);
    return;
  }
  // beta = 0 makes OpenBLAS overwrite C without reading it (NaN in an unwritten y is harmless).
  const float beta = accumulate ? 1.0f : 0.0f;
  for (int64_t row = 0; row < tokens; row += kMaxBlasDim) {
    const int64_t rows = std::min(tokens - row, kMaxBlasDim);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(rows),
                static_cast<int>(out), static_cast<int>(in), 1.0f, x + row * in,
                static_cast<int>(in), w, static_cast<int>(in), beta, y + row * out,
                static_cast<int>(out));
  }
}

void LinearPerRow(const float* x, int64_t tokens, int64_t in, const float* w, int64_t out,
                  float* y) {
  CPFILL_LAYERS_CHECK(tokens >= 0 && in > 0 && out >= 0 && in <= kMaxBlasDim && out <= kMaxBlasDim,
                      "LinearPerRow: tokens %lld in %lld out %lld", static_cast<long long>(tokens),
                      static_cast<long long>(in), static_cast<long long>(out));
  for (int64_t t = 0; t < tokens; ++t) {
    cblas_sgemv(CblasRowMajor, CblasNoTrans, static_cast<int>(out), static_cast<int>(in), 1.0f, w,
                static_cast<int>(in), x + t * in, 1, 0.0f, y + t * out, 1);
  }
}

void RmsNorm(const float* x, const float* weight, int64_t tokens, int64_t hidden, double eps,
             float* y, ThreadPool* pool) {
  if (tokens <= 0 || hidden <= 0) return;
  const float eps_f = static_cast<float>(eps);
  const int64_t rows_per_item = std::max<int64_t>(1, kRmsNormElementsPerItem / hidden);
  const int64_t items = (tokens + rows_per_item - 1) / rows_per_item;
  auto run_item = [&](int64_t item) {
    const int64_t row_end = std::min(tokens, (item + 1) * rows_per_item);
    for (int64_t t = item * rows_per_item; t < row_end; ++t) {
      const float* xr = x + t * hidden;
      float* yr = y + t * hidden;
      // HF: variance = x.pow(2).mean(-1) in fp32; we accumulate the sum in double (at least as
      // accurate as torch's pairwise fp32 sum), then continue in fp32 as HF does.
      double sum_sq = 0.0;
      for (int64_t i = 0; i < hidden; ++i) sum_sq += static_cast<double>(xr[i]) * xr[i];
      const float variance = static_cast<float>(sum_sq / static_cast<double>(hidden));
      const float inv_rms = 1.0f / std::sqrt(variance + eps_f);
      // HF order: weight * (x * rsqrt(variance + eps)). Element-wise, so y may alias x.
      for (int64_t i = 0; i < hidden; ++i) yr[i] = weight[i] * (xr[i] * inv_rms);
    }
  };
  if (pool == nullptr || items == 1) {
    for (int64_t item = 0; item < items; ++item) run_item(item);
  } else {
    pool->ParallelFor(items, run_item);
  }
}

void SwiGlu(const float* gate, const float* up, int64_t n, float* out) {
  // silu(g) = g / (1 + exp(-g)); for g very negative exp(-g) = inf and the result is -0, which
  // is the limit. Element-wise, so out may alias gate or up.
  for (int64_t i = 0; i < n; ++i) {
    const float g = gate[i];
    out[i] = g / (1.0f + std::exp(-g)) * up[i];
  }
}

void Embed(const int32_t* token_ids, int64_t tokens, const float* table, int64_t hidden,
           float* out) {
  const size_t row_bytes = static_cast<size_t>(hidden) * sizeof(float);
  for (int64_t t = 0; t < tokens; ++t) {
    std::memcpy(out + t * hidden, table + static_cast<int64_t>(token_ids[t]) * hidden, row_bytes);
  }
}

RopeTable RopeTable::Make(const ModelConfig& config) {
  const int head_dim = config.head_dim;
  CPFILL_LAYERS_CHECK(head_dim > 0 && head_dim % 2 == 0,
                      "RopeTable::Make: head_dim %d must be positive and even", head_dim);
  const int half = head_dim / 2;
  RopeTable table;
  table.inv_freq_.resize(half);
  // HF _compute_default_rope_parameters: inv_freq[i] = 1 / theta^(2i / d).
  for (int i = 0; i < half; ++i) {
    table.inv_freq_[i] = 1.0 / std::pow(config.rope_theta,
                                        static_cast<double>(2 * i) / static_cast<double>(head_dim));
  }
  if (config.rope_scaling.has_value()) {
    // HF _compute_llama3_parameters: long wavelengths (low frequencies) are divided by `factor`,
    // short ones kept, and the band between interpolated linearly in original_max / wavelen.
    const Llama3RopeScaling& s = *config.rope_scaling;
    const double original_max = static_cast<double>(s.original_max_position_embeddings);
    const double low_freq_wavelen = original_max / s.low_freq_factor;
    const double high_freq_wavelen = original_max / s.high_freq_factor;
    for (double& f : table.inv_freq_) {
      const double wavelen = 2.0 * std::numbers::pi / f;
      if (wavelen > low_freq_wavelen) {
        f = f / s.factor;
      } else if (wavelen < high_freq_wavelen) {
        // unchanged
      } else {
        const double smooth =
            (original_max / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
        f = (1.0 - smooth) * f / s.factor + smooth * f;
      }
    }
  }
  return table;
}

void RopeTable::Apply(float* x, const int32_t* positions, int64_t tokens, int heads,
                      int head_dim) const {
  const int half = static_cast<int>(inv_freq_.size());
  CPFILL_LAYERS_CHECK(head_dim == 2 * half, "RopeTable::Apply: head_dim %d, table built for %d",
                      head_dim, 2 * half);
  // cos/sin of one token's angles, shared by all its heads. Positions may come in any order
  // (a context-parallel shard holds non-contiguous chunks), so each token computes its own.
  // Callers never pass negative (padding) positions: padding rows are not rotated, their
  // contents are never read as keys.
  std::vector<float> cos_sin(2 * static_cast<size_t>(half));
  float* cos_t = cos_sin.data();
  float* sin_t = cos_t + half;
  for (int64_t t = 0; t < tokens; ++t) {
    const double pos = static_cast<double>(positions[t]);
    for (int i = 0; i < half; ++i) {
      const double angle = pos * inv_freq_[i];
      cos_t[i] = static_cast<float>(std::cos(angle));
      sin_t[i] = static_cast<float>(std::sin(angle));
    }
    float* xt = x + t * heads * static_cast<int64_t>(head_dim);
    for (int h = 0; h < heads; ++h) {
      float* xh = xt + static_cast<int64_t>(h) * head_dim;
      // rotate_half: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), cos[i] == cos[i + d/2].
      for (int i = 0; i < half; ++i) {
        const float x1 = xh[i];
        const float x2 = xh[i + half];
        xh[i] = x1 * cos_t[i] - x2 * sin_t[i];
        xh[i + half] = x2 * cos_t[i] + x1 * sin_t[i];
      }
    }
  }
}

}  // namespace cpfill::runtime::cpu
