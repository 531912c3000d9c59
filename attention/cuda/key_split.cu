#include <algorithm>
#include <numeric>

#include "attention/cuda/hopper_params.h"
#include "attention/cuda/key_split.h"
#include "base/knobs.h"

namespace cpfill::attention::cuda::internal {
namespace {

// Key tiles a part holds at least: one tile would be mostly its prologue and epilogue.
constexpr int64_t kMinPartTiles = 2;

// The keys a part's share is counted in: 128-key tiles, or with paged K/V runs of whole tiles
// that are also whole blocks, so that every part starts on a block (its first table entry) and
// the kernel's tiles keep their place in the blocks. (Parts of a call without the causal mask
// may run 176-key tiles, attention_hopper.h's HopperKeyTile: each part then ends in a partial
// tile, which the kernel masks like any slice's last.)
int64_t UnitKeys(const CudaAttentionArgs& a) {
  return a.paged == nullptr ? kHopperBlockN
                            : std::lcm<int64_t>(kHopperBlockN, a.paged->block_tokens);
}
int64_t Units(int64_t kv_len, int64_t unit_keys) { return (kv_len + unit_keys - 1) / unit_keys; }

// Work items, the fewest key units of a working slice and the working slices of `a`;
// covers_every_row is false when some query row is in no slice with keys.
struct CallWork {
  int64_t items = 0, fewest_units = 0, slices = 0;
  bool covers_every_row = false;
};

CallWork WorkOf(const CudaAttentionArgs& a) {
  const int64_t unit_keys = UnitKeys(a);
  CallWork w;
  int64_t covered = 0;
  for (int64_t i = 0; i < a.num_slices; ++i) {
    const SequenceSlice& s = a.slices[i];
    if (s.q_len <= 0 || s.kv_len <= 0) continue;
    covered += s.q_len;
    w.items += (s.q_len * a.shape.group_size() + kHopperBlockM - 1) / kHopperBlockM;
    const int64_t units = Units(s.kv_len, unit_keys);
    w.fewest_units = w.slices == 0 ? units : std::min(w.fewest_units, units);
    ++w.slices;
  }
  w.items *= a.shape.num_kv_heads;
  w.covers_every_row = covered == a.q_tokens;
  return w;
}

int Parts(const CudaAttentionArgs& a, int sms) {
  static const bool enabled = knobs::Choice(knobs::kAttentionKeySplit) != "off";
  if (!enabled || a.output == OutputMode::kMergeIntoFloat32) return 1;
  const CallWork w = WorkOf(a);
  if (!w.covers_every_row || w.slices == 0 || 2 * w.items > sms) return 1;
  const int64_t min_part_units = std::max<int64_t>(1, kMinPartTiles * kHopperBlockN / UnitKeys(a));
  const int64_t parts =
      std::min<int64_t>({kMaxMergeParts, sms / w.items, w.fewest_units / min_part_units,
                         kMaxHopperSlices / w.slices});
  return parts >= 2 ? static_cast<int>(parts) : 1;
}

}  // namespace

KeySplit PlanKeySplit(const CudaAttentionArgs& a, int sms) {
  KeySplit split;
  split.parts = Parts(a, sms);
  if (split.parts == 1) return split;
  const int64_t unit_keys = UnitKeys(a);
  for (int p = 0; p < split.parts; ++p) {
    for (int64_t i = 0; i < a.num_slices; ++i) {
      const SequenceSlice& s = a.slices[i];
      if (s.q_len <= 0 || s.kv_len <= 0) continue;
      // Units [p U / parts, (p + 1) U / parts): every part at least one whole unit.
      const int64_t units = Units(s.kv_len, unit_keys);
      const int64_t begin = p * units / split.parts * unit_keys;
      const int64_t end = std::min(s.kv_len, (p + 1) * units / split.parts * unit_keys);
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
