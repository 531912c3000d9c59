#include "runtime/model/cuda/cublaslt_library.h"

#include "gtest/gtest.h"

namespace cpfill::runtime::cuda {
namespace {

// The library opens, every entry point resolves, and it is the version compiled against: no GPU
// is needed for any of it.
TEST(CublasLtLibrary, OpensOnceWithEveryEntryPoint) {
  absl::StatusOr<const CublasLt*> lt = OpenCublasLt();
  ASSERT_TRUE(lt.ok()) << lt.status();
  const CublasLt& f = **lt;
  for (const void* fn :
       {reinterpret_cast<const void*>(f.GetVersion), reinterpret_cast<const void*>(f.Create),
        reinterpret_cast<const void*>(f.Destroy), reinterpret_cast<const void*>(f.Matmul),
        reinterpret_cast<const void*>(f.MatmulAlgoGetHeuristic),
        reinterpret_cast<const void*>(f.MatmulDescCreate),
        reinterpret_cast<const void*>(f.MatmulDescDestroy),
        reinterpret_cast<const void*>(f.MatmulDescSetAttribute),
        reinterpret_cast<const void*>(f.MatmulPreferenceCreate),
        reinterpret_cast<const void*>(f.MatmulPreferenceDestroy),
        reinterpret_cast<const void*>(f.MatmulPreferenceSetAttribute),
        reinterpret_cast<const void*>(f.MatrixLayoutCreate),
        reinterpret_cast<const void*>(f.MatrixLayoutDestroy)}) {
    EXPECT_NE(fn, nullptr);
  }
  EXPECT_EQ(f.GetVersion() / 10000, CUBLAS_VER_MAJOR);
  EXPECT_EQ(*OpenCublasLt(), &f);  // once per process
}

}  // namespace
}  // namespace cpfill::runtime::cuda
