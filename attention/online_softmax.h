// cpfill/attention/online_softmax.h — the one definition of softmax by parts: the merge of
// partial results by their log-sum-exp, and the online-softmax state update.
//
// Two ways of computing softmax(S) V over a key set split into parts meet here:
//   LseMerge        parts already finished, each as (O_s, LSE_s): the exact merge of App. B eq. 4
//                   (the CPU merges, the CUDA merge kernel, the fp64 reference's softmax, which is
//                   the same merge with one key per part).
//   OnlineSoftmax   a running (m, l) folded one key tile at a time (FlashAttention): the running
//                   max grows, the old accumulator is rescaled by alpha = exp(m_old - m_new).
// Both are -inf safe: a part or tile that sees no key weighs exactly 0 and never makes a NaN.
// Functions are __host__ __device__ under nvcc (CPFILL_HD) and plain inline C++ elsewhere;
// templated on float and double.
//
//   LseMerge<float> m;
//   for (int s = 0; s < n; ++s) m.Add(lse[s], s);
//   if (m.empty()) { /* O = 0, LSE = -inf */ }
//   float rest = 0;                                  // sum of the other parts' weights
//   for (int s = 0; s < n; ++s) { w[s] = m.Weight(lse[s], s); if (s != m.arg_max()) rest += w[s]; }
//   // O = sum_s w[s] * O_s * m.Normalizer(rest), LSE = m.Lse(rest)
#pragma once

#include <cmath>

#include "base/host_device.h"

namespace cpfill::attention {
namespace softmax_internal {

// exp, exp2 and log1p in the type's precision, from host and device code alike.
CPFILL_HD inline float Exp(float x) {
#if defined(__CUDA_ARCH__)
  return expf(x);
#else
  return std::exp(x);
#endif
}
CPFILL_HD inline double Exp(double x) {
#if defined(__CUDA_ARCH__)
  return ::exp(x);
#else
  return std::exp(x);
#endif
}
CPFILL_HD inline float Log1p(float x) {
#if defined(__CUDA_ARCH__)
  return log1pf(x);
#else
  return std::log1p(x);
#endif
}
CPFILL_HD inline double Log1p(double x) {
#if defined(__CUDA_ARCH__)
  return ::log1p(x);
#else
  return std::log1p(x);
#endif
}

template <typename T>
CPFILL_HD inline T NegInf() {
  return -static_cast<T>(INFINITY);
}

}  // namespace softmax_internal

// Exact merge of partials by their LSE (natural log), for one (row, head):
//   LSE = log(sum_s exp(LSE_s)),  O = sum_s exp(LSE_s - LSE) O_s.
// Weights are taken relative to the largest LSE, so they lie in [0, 1] and exp never overflows;
// parts with LSE = -inf weigh exactly 0 (their O need not be read). The total is 1 + rest (the
// largest part weighs 1), hence log1p for precision when the others are far below it.
template <typename T>
class LseMerge {
 public:
  // Pass 1: every part's LSE. The first of equal maxima is the largest.
  CPFILL_HD void Add(T lse, int part) {
    if (lse > max_) {
      max_ = lse;
      arg_max_ = part;
    }
  }
  // No part saw a key (or there are none): the merged row is O = 0, LSE = -inf.
  CPFILL_HD bool empty() const { return arg_max_ < 0; }
  CPFILL_HD int arg_max() const { return arg_max_; }
  CPFILL_HD T max() const { return max_; }

  // Pass 2: a part's weight before normalization: 1 for the largest, exp(lse - max) otherwise.
  CPFILL_HD T Weight(T lse, int part) const {
    return part == arg_max_ ? T(1) : softmax_internal::Exp(lse - max_);
  }
  // `rest`: the sum of Weight() over every part but the largest.
  CPFILL_HD static T Normalizer(T rest) { return T(1) / (T(1) + rest); }
  CPFILL_HD T Lse(T rest) const { return max_ + softmax_internal::Log1p(rest); }

 private:
  T max_ = softmax_internal::NegInf<T>();
  int arg_max_ = -1;
};

// One step of the online softmax over score tiles. The caller keeps, per row, the running max m
// of the scores seen so far, the running sum l of exp(score - m) and an accumulator of
// exp(score - m) V. For a new tile with maximum `tile_max`:
//   Step s = OnlineSoftmax<T>::Step(m, tile_max, exp);
//   p_i = exp(score_i - s.offset);   l = l * s.alpha + sum p_i;   acc = acc * s.alpha + P V;
//   m = s.m;
// `exp` is the exponential the caller's scores are in (exp, or exp2 for base-2 scores). While no
// key is visible m stays -inf; the offset is then 0, so exp(-inf - offset) = 0, not NaN.
template <typename T>
struct OnlineSoftmax {
  struct Step {
    T m;       // the new running max
    T offset;  // subtracted from this tile's scores before exp
    T alpha;   // rescales the old l and accumulator
  };
  template <typename ExpFn>
  CPFILL_HD static Step Next(T m_old, T tile_max, ExpFn exp) {
    const T m_new = m_old < tile_max ? tile_max : m_old;  // std::max, usable on the device
    const T offset = m_new == softmax_internal::NegInf<T>() ? T(0) : m_new;
    return {m_new, offset, exp(m_old - offset)};
  }
};

}  // namespace cpfill::attention
