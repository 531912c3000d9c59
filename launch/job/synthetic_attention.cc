#include "launch/job/synthetic_attention.h"

#include "base/random.h"

namespace cpfill::launch {
namespace {

enum Stream : uint64_t { kStreamQ = 1, kStreamK = 2, kStreamV = 3 };

inline float Element(uint64_t seed, Stream stream, int seq, int64_t pos, int head, int dim, int d) {
  const uint64_t token = (static_cast<uint64_t>(seq) << 32) | static_cast<uint64_t>(pos);
  return UniformAt(seed, stream,
                   Mix64(token) + static_cast<uint64_t>(head) * static_cast<uint64_t>(dim) + d);
}

// Fills rows of one sequence: rows[i] holds position positions[i].
template <typename Fn>
void FillRows(Fn element, const int32_t* positions, int64_t rows, int head_begin, int heads,
              int dim, float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int h = 0; h < heads; ++h) {
      float* dst = out + (r * heads + h) * dim;
      for (int d = 0; d < dim; ++d) dst[d] = element(positions[r], head_begin + h, d);
    }
  }
}

}  // namespace

float SyntheticAttention::Q(int seq, int64_t pos, int head, int d) const {
  return Element(seed, kStreamQ, seq, pos, head, head_dim, d);
}
float SyntheticAttention::K(int seq, int64_t pos, int kv_head, int d) const {
  return Element(seed, kStreamK, seq, pos, kv_head, head_dim, d);
}
float SyntheticAttention::V(int seq, int64_t pos, int kv_head, int d) const {
  return Element(seed, kStreamV, seq, pos, kv_head, head_dim, d);
}

int64_t SyntheticAttention::total_new_tokens() const {
  int64_t n = 0;
  for (const auto& s : sequences) n += s.new_tokens;
  return n;
}

int64_t SyntheticAttention::total_kv_tokens() const {
  int64_t n = 0;
  for (const auto& s : sequences) n += s.new_tokens + s.cached_tokens;
  return n;
}

void SyntheticAttention::FillLocal(const sharding::LocalLayout& layout, const HeadSlice& slice,
                                   float* q, float* k, float* v) const {
  const int dim = head_dim;
  const std::vector<int32_t> kv_positions = sharding::ExpandPositions(layout.kv_runs);
  for (int s = 0; s < static_cast<int>(sequences.size()); ++s) {
    auto eq = [&](int64_t p, int h, int d) { return Q(s, p, h, d); };
    auto ek = [&](int64_t p, int h, int d) { return K(s, p, h, d); };
    auto ev = [&](int64_t p, int h, int d) { return V(s, p, h, d); };
    const int64_t qo = layout.q_offset[s], ko = layout.kv_offset[s];
    FillRows(eq, layout.q_positions.data() + qo, layout.q_len[s], slice.q_begin, slice.q_count, dim,
             q + qo * slice.q_count * dim);
    FillRows(ek, kv_positions.data() + ko, layout.kv_len[s], slice.kv_begin, slice.kv_count, dim,
             k + ko * slice.kv_count * dim);
    FillRows(ev, kv_positions.data() + ko, layout.kv_len[s], slice.kv_begin, slice.kv_count, dim,
             v + ko * slice.kv_count * dim);
  }
}

void SyntheticAttention::FillGlobal(float* q, float* k, float* v) const {
  const int dim = head_dim;
  int64_t q_row = 0, kv_row = 0;
  for (int s = 0; s < static_cast<int>(sequences.size()); ++s) {
    const auto& req = sequences[s];
    std::vector<int32_t> qpos(req.new_tokens), kpos(req.cached_tokens + req.new_tokens);
    for (int64_t i = 0; i < req.new_tokens; ++i)
      qpos[i] = static_cast<int32_t>(req.cached_tokens + i);
    for (int64_t i = 0; i < static_cast<int64_t>(kpos.size()); ++i)
      kpos[i] = static_cast<int32_t>(i);
    auto eq = [&](int64_t p, int h, int d) { return Q(s, p, h, d); };
    auto ek = [&](int64_t p, int h, int d) { return K(s, p, h, d); };
    auto ev = [&](int64_t p, int h, int d) { return V(s, p, h, d); };
    FillRows(eq, qpos.data(), req.new_tokens, 0, num_heads, dim, q + q_row * num_heads * dim);
    FillRows(ek, kpos.data(), kpos.size(), 0, num_kv_heads, dim, k + kv_row * num_kv_heads * dim);
    FillRows(ev, kpos.data(), kpos.size(), 0, num_kv_heads, dim, v + kv_row * num_kv_heads * dim);
    q_row += req.new_tokens;
    kv_row += kpos.size();
  }
}

}  // namespace cpfill::launch
