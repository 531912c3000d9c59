// cpfill/runtime/model/cpu/layers.h — the Llama layer primitives on the CPU, fp32, exactly as
// Hugging Face's LlamaForCausalLM computes them.
//
//   SetBlasThreads(threads);                       // once per process: this rank's cores
//   Linear(x, tokens, in, w, out, y);              // y[t, o] = sum_i x[t, i] w[o, i]
//   RmsNorm(x, weight, tokens, hidden, eps, y, pool);
//   RopeTable rope = RopeTable::Make(config);
//   rope.Apply(q, positions, tokens, heads, head_dim);   // in place, rotate-half
//   SwiGlu(gate, up, n, out);                            // silu(gate) * up
#pragma once

#include <cstdint>
#include <vector>

#include "base/thread_pool.h"
#include "runtime/model/model_config.h"

namespace cpfill::runtime::cpu {

// Threads the CPU BLAS may use in this process. Several MPI ranks share a host's cores, so each
// rank sets its share; left alone, OpenBLAS takes every core in every rank.
void SetBlasThreads(int threads);

// y [tokens, out] = x [tokens, in] * w^T, w [out, in] row-major (a Hugging Face Linear, no
// bias). `accumulate`: y += instead of y =. Through the CPU BLAS (sgemm).
void Linear(const float* x, int64_t tokens, int64_t in, const float* w, int64_t out, float* y,
            bool accumulate = false);

// The same, one row at a time (sgemv): a row's sums run in one order whatever the other rows, so
// a token's result does not depend on its batch. sgemm's does: where M blocking puts a row
// changes its rounding (about 1e-6), so a prompt's suffix prefilled alone, after a cached prefix,
// differs from the same rows in the whole prompt. Reads w once per row: for exact checks, not
// speed (StepOptions::batch_invariant).
void LinearPerRow(const float* x, int64_t tokens, int64_t in, const float* w, int64_t out,
                  float* y);

// y = x / sqrt(mean(x^2) + eps) * weight, per row; fp32 throughout (HF computes the variance in
// fp32 too). y may alias x.
void RmsNorm(const float* x, const float* weight, int64_t tokens, int64_t hidden, double eps,
             float* y, ThreadPool* pool);

// out[i] = silu(gate[i]) * up[i], silu(g) = g / (1 + exp(-g)). out may alias gate or up.
void SwiGlu(const float* gate, const float* up, int64_t n, float* out);

// out [tokens, hidden] = table [vocab, hidden] rows of the token ids. InvalidArgument-worthy
// ids are the caller's to check (CheckTokenIds).
void Embed(const int32_t* token_ids, int64_t tokens, const float* table, int64_t hidden,
           float* out);

// RoPE as Hugging Face applies it: rotate_half over the two halves of each head (not
// interleaved pairs), inverse frequencies theta^(-2i/d), with Llama 3.1's frequency-dependent
// scaling when the config has rope_scaling. Positions are global positions in the sequence.
class RopeTable {
 public:
  static RopeTable Make(const ModelConfig& config);
  // x [tokens, heads, head_dim], in place; angles computed in double, applied in fp32.
  void Apply(float* x, const int32_t* positions, int64_t tokens, int heads, int head_dim) const;
  const std::vector<double>& inv_freq() const { return inv_freq_; }

 private:
  std::vector<double> inv_freq_;  // [head_dim / 2]
};

}  // namespace cpfill::runtime::cpu
