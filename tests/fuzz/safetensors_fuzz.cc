// libFuzzer target: any bytes as a safetensors file. SafetensorsFile::Open must refuse what is
// malformed with a status (never crash, read out of bounds or allocate without bound), and every
// tensor of a file it accepts must be readable with the dtype and shape it declares.
//
//   tests/fuzz/run_libfuzzer.sh (CI) builds it with clang -fsanitize=fuzzer,address,undefined.
#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "runtime/model/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // Open() maps a path: the bytes go into an anonymous in-memory file.
  static const int fd = memfd_create("safetensors-fuzz", MFD_CLOEXEC);
  if (fd < 0 || ftruncate(fd, 0) != 0 || pwrite(fd, data, size, 0) != static_cast<ssize_t>(size)) {
    return 0;
  }
  const std::string path = "/proc/self/fd/" + std::to_string(fd);
  auto file = cpfill::runtime::SafetensorsFile::Open(path);
  if (!file.ok()) return 0;
  for (const std::string& name : file->names()) {
    const cpfill::runtime::TensorInfo* info = file->Find(name);
    if (info == nullptr) __builtin_trap();  // a listed name must be found
    auto view = file->Get(name, info->dtype, info->shape);
    if (!view.ok() || view->bytes != info->bytes) __builtin_trap();
    // Touch the first and last byte: both must lie inside the mapping.
    if (view->bytes > 0) {
      const auto* p = static_cast<const volatile uint8_t*>(view->data);
      (void)p[0];
      (void)p[view->bytes - 1];
    }
  }
  return 0;
}
