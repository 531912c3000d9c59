#include "runtime/model/cuda/cublaslt_library.h"

#include <dlfcn.h>

#include <string>

#include "absl/strings/str_cat.h"

namespace cpfill::runtime::cuda {
namespace {

// Resolves `name` into `*fn`; false when the library lacks it.
template <typename Fn>
bool Resolve(void* library, const char* name, Fn* fn) {
  *fn = reinterpret_cast<Fn>(dlsym(library, name));
  return *fn != nullptr;
}

absl::StatusOr<CublasLt> Open() {
  const std::string soname = absl::StrCat("libcublasLt.so.", CUBLAS_VER_MAJOR);
  std::string errors;
  void* library = nullptr;
  for (const std::string& path : {soname, std::string(CPFILL_CUBLASLT_PATH)}) {
    library = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (library != nullptr) break;
    const char* why = dlerror();
    absl::StrAppend(&errors, errors.empty() ? "" : "; ", why != nullptr ? why : path);
  }
  if (library == nullptr) {
    return absl::UnavailableError(absl::StrCat(
        "cannot open cuBLASLt (", soname, ", needed by the CUDA backend's GEMMs): ", errors,
        ". Install the CUDA toolkit's cuBLAS or add its lib/ to the "
        "loader's path"));
  }
  CublasLt lt{};
  const bool all =
      Resolve(library, "cublasLtGetVersion", &lt.GetVersion) &&
      Resolve(library, "cublasLtCreate", &lt.Create) &&
      Resolve(library, "cublasLtDestroy", &lt.Destroy) &&
      Resolve(library, "cublasLtMatmul", &lt.Matmul) &&
      Resolve(library, "cublasLtMatmulAlgoGetHeuristic", &lt.MatmulAlgoGetHeuristic) &&
      Resolve(library, "cublasLtMatmulDescCreate", &lt.MatmulDescCreate) &&
      Resolve(library, "cublasLtMatmulDescDestroy", &lt.MatmulDescDestroy) &&
      Resolve(library, "cublasLtMatmulDescSetAttribute", &lt.MatmulDescSetAttribute) &&
      Resolve(library, "cublasLtMatmulPreferenceCreate", &lt.MatmulPreferenceCreate) &&
      Resolve(library, "cublasLtMatmulPreferenceDestroy", &lt.MatmulPreferenceDestroy) &&
      Resolve(library, "cublasLtMatmulPreferenceSetAttribute", &lt.MatmulPreferenceSetAttribute) &&
      Resolve(library, "cublasLtMatrixLayoutCreate", &lt.MatrixLayoutCreate) &&
      Resolve(library, "cublasLtMatrixLayoutDestroy", &lt.MatrixLayoutDestroy);
  if (!all) {
    return absl::UnavailableError(absl::StrCat("the cuBLASLt opened (", soname,
                                               ") lacks an entry point cpfill calls: ", dlerror()));
  }
  return lt;  // the library stays open for the life of the process
}

}  // namespace

absl::StatusOr<const CublasLt*> OpenCublasLt() {
  static const absl::StatusOr<CublasLt>* const opened = new absl::StatusOr<CublasLt>(Open());
  if (!opened->ok()) return opened->status();
  return &**opened;
}

}  // namespace cpfill::runtime::cuda
