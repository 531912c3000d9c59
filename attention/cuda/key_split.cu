#include <algorithm>

#include "attention/cuda/hopper_params.h"
#include "attention/cuda/key_split.h"
#include "base/knobs.h"

namespace cpfill::attention::cuda::internal {
namespace {

// Key tiles a part holds at least: one tile would be mostly its prologue and epilogue.
constexpr int64_t kMinPartTiles = 2;

int64_t KeyTiles128(int64_t kv_len) { return (kv_len + kHopperBlockN - 1) / kHopperBlockN; }

// Work items, the fewest key tiles of a working slice and the working slices of `a`;
// covers_every_row is false when some query row is in no slice with keys.
struct CallWork {
  int64_t items = 0, fewest_tiles = 0, slices = 0;
  bool covers_every_row = false;
};

CallWork WorkOf(const CudaAttentionArgs& a) {
  CallWork w;
  int64_t covered = 0;
  for (int64_t i = 0; i < a.num_slices; ++i) {
    const SequenceSlice& s = a.slices[i];
    if (s.q_len <= 0 || s.kv_len <= 0) continue;
    covered += s.q_len;
    w.items += (s.q_len * a.shape.group_size() + kHopperBlockM - 1) / kHopperBlockM;
    const int64_t tiles = KeyTiles128(s.kv_len);
    w.fewest_tiles = w.slices == 0 ? tiles : std::min(w.fewest_tiles, tiles);
    ++w.slices;
  }
  w.items *= a.shape.num_kv_heads;
  w.covers_every_row = covered == a.q_tokens;
  return w;
}

int Parts(const CudaAttentionArgs& a, int sms) {
  static const bool enabled = knobs::Choice(knobs::kAttentionKeySplit) != "off";
  if (!enabled || a.output == OutputMode::kMergeIntoFloat32 || a.paged != nullptr) return 1;
  const CallWork w = WorkOf(a);
  if (!w.covers_every_row || w.slices == 0 || 2 * w.items > sms) return 1;
  const int64_t parts = std::min<int64_t>(
      {kMaxMergeParts, sms / w.items, w.fewest_tiles / kMinPartTiles, kMaxHopperSlices / w.slices});
  return parts >= 2 ? static_cast<int>(parts) : 1;
}

}  // namespace

KeySplit PlanKeySplit(const CudaAttentionArgs& a, int sms) {
  KeySplit split;
  split.parts = Parts(a, sms);
  if (split.parts == 1) return split;
  for (int p = 0; p < split.parts; ++p) {
    for (int64_t i = 0; i < a.num_slices; ++i) {
      const SequenceSlice& s = a.slices[i];
      if (s.q_len <= 0 || s.kv_len <= 0) continue;
      // Tiles [p T / parts, (p + 1) T / parts): every part at least one whole tile.
      const int64_t tiles = KeyTiles128(s.kv_len);
      const int64_t begin = p * tiles / split.parts * kHopperBlockN;
      const int64_t end = std::min(s.kv_len, (p + 1) * tiles / split.parts * kHopperBlockN);
      split.slices.push_back({.q_begin = s.q_begin,
                              .q_len = s.q_len,
                              .kv_begin = s.kv_begin + begin,
                              .kv_len = end - begin});
      split.out_rows.push_back(p * a.q_tokens + s.q_begin);
    }
  }
  return split;
}

}  // namespace cpfill::attention::cuda::internal
