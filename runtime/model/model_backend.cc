#include "runtime/model/model_backend.h"

#include <algorithm>

#include "base/status.h"

namespace cpfill::runtime {

size_t ElemBytes(ElemType type) {
  switch (type) {
    case ElemType::kF8E4M3:
      return 1;
    case ElemType::kBf16:
      return 2;
    case ElemType::kF32:
    case ElemType::kI32:
      return 4;
  }
  return 4;
}

absl::Status ModelBackend::DrawTokens(const Tensor& logits, int slices,
                                      std::span<const int64_t> rows,
                                      std::span<const TokenDraw> draws, std::vector<int32_t>* ids) {
  std::vector<float> host(static_cast<size_t>(logits.numel()));
  CPFILL_RETURN_IF_ERROR(Download(logits, host.data()));
  const int64_t n = logits.rows / slices, part = logits.cols;
  std::vector<float> row(static_cast<size_t>(part * slices));
  ids->resize(draws.size());
  for (size_t i = 0; i < draws.size(); ++i) {
    for (int s = 0; s < slices; ++s) {
      const float* from = host.data() + (s * n + rows[i]) * part;
      std::copy(from, from + part, row.begin() + s * part);
    }
    (*ids)[i] = SampleToken(row, draws[i].params, draws[i].step).id;
  }
  return absl::OkStatus();
}

}  // namespace cpfill::runtime
