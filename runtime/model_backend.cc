#include "runtime/model_backend.h"

namespace cpfill::runtime {

size_t ElemBytes(ElemType type) {
  switch (type) {
    case ElemType::kBf16:
      return 2;
    case ElemType::kF32:
    case ElemType::kI32:
      return 4;
  }
  return 4;
}

}  // namespace cpfill::runtime
