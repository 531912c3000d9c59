// cpfill/runtime/model/safetensors.h — read and write Hugging Face safetensors files.
//
// File layout (https://github.com/huggingface/safetensors):
//   bytes [0, 8)        N, the header length, uint64 little-endian
//   bytes [8, 8+N)      JSON header: {"__metadata__": {str: str},          (optional)
//                                     "name": {"dtype": "F32", "shape": [2, 3],
//                                              "data_offsets": [begin, end]}, ...}
//                       padded with spaces so the data buffer starts 8-byte aligned
//   bytes [8+N, EOF)    data buffer; [begin, end) is relative to its start; tensors are
//                       row-major (C order), little-endian, end - begin = numel * dtype size.
//
// SafetensorsFile maps a file read-only and validates the whole header once in Open, so every
// later access is a lookup. Tensor data is never copied: a TensorView points into the mapping
// and is valid while the SafetensorsFile lives. SafetensorsWriter lays a file out exactly as the
// reference Python/Rust library does (tensors sorted by dtype alignment, then name).
//
//   CPFILL_ASSIGN_OR_RETURN(SafetensorsFile file, SafetensorsFile::Open(path));
//   CPFILL_ASSIGN_OR_RETURN(TensorView w, file.Get("lm_head.weight", DType::kBF16,
//                                                  {vocab, hidden}));
//
//   SafetensorsWriter writer;
//   CPFILL_RETURN_IF_ERROR(writer.Add("x", DType::kF32, {2, 3}, x.data()));
//   writer.SetMetadata("format", "pt");
//   CPFILL_RETURN_IF_ERROR(writer.Write(path));
//
// Only little-endian hosts are supported (the data is used in place).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace cpfill::runtime {

// The dtypes cpfill reads and writes; the format's other F8_*, I16, U16, U32, U64 are rejected
// as unknown rather than misread. kF8E4M3: OCP E4M3 ("e4m3fn"), row-wise FP8 weights (fp8.h).
enum class DType { kF32, kF16, kBF16, kF64, kI32, kI64, kU8, kI8, kBool, kF8E4M3 };

std::string_view DTypeName(DType dtype);  // the format's spelling: "F32", "BF16", "BOOL", ...
int64_t DTypeSize(DType dtype);           // bytes per element
// InvalidArgument naming the string and the accepted names.
absl::StatusOr<DType> ParseDType(std::string_view name);

// One tensor of a file. `offset` is from the start of the data buffer (as in the header);
// bytes == numel(shape) * DTypeSize(dtype). An empty shape is a scalar (numel 1).
struct TensorInfo {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  uint64_t offset = 0;
  uint64_t bytes = 0;
};

// A tensor's data inside a mapped file. `data` is aligned to the dtype when the file was
// written by the reference layout (SafetensorsWriter or the Python library); hand-made files
// may not be, so kernels that need alignment must check.
struct TensorView {
  const void* data = nullptr;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  uint64_t bytes = 0;
};

class SafetensorsWriter {
 public:
  // Registers a tensor; `data` is not copied and must stay valid until Write returns. It holds
  // numel(shape) * DTypeSize(dtype) bytes in row-major order. InvalidArgument for an empty,
  // duplicate or reserved ("__metadata__") name, a negative dimension, or null data with a
  // non-zero size.
  absl::Status Add(std::string name, DType dtype, std::vector<int64_t> shape, const void* data);

  // Free-form string metadata stored under "__metadata__"; a repeated key replaces its value.
  void SetMetadata(std::string key, std::string value);

  // Streams the header and every tensor to `path`.tmp, flushes it to disk, then renames it over
  // `path`, so readers never see a half-written file. On failure the temporary file is removed
  // and the error (errno mapped to a status code) names the path and the system's reason.
  absl::Status Write(const std::string& path) const;

 private:
  struct Entry {
    std::string name;
    DType dtype;
    std::vector<int64_t> shape;
    const void* data;
    uint64_t bytes;
  };
  std::vector<Entry> entries_;
  std::map<std::string, std::string> metadata_;
};

class SafetensorsFile {
 public:
  // Maps `path` and validates the header: size fields, JSON syntax, dtypes, shapes, offsets
  // (inside the buffer, consistent with shape and dtype, no two tensors overlapping). NotFound
  // when the file does not exist; InvalidArgument naming the file (and the tensor) for anything
  // wrong inside it; other open/map failures map errno to a status code.
  static absl::StatusOr<SafetensorsFile> Open(const std::string& path);

  SafetensorsFile(SafetensorsFile&& other) noexcept;
  SafetensorsFile& operator=(SafetensorsFile&& other) noexcept;
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;
  ~SafetensorsFile();

  const std::string& path() const { return path_; }
  // Tensor names in header order.
  const std::vector<std::string>& names() const { return names_; }
  // nullptr when absent.
  const TensorInfo* Find(std::string_view name) const;
  // The tensor's data, checked against what the caller expects. An empty `expected_shape`
  // accepts any shape (a scalar cannot be asked for explicitly; check view.shape instead).
  // NotFound naming file and tensor when absent; InvalidArgument naming both the expected and
  // the stored dtype/shape on a mismatch.
  absl::StatusOr<TensorView> Get(std::string_view name, DType expected_dtype,
                                 std::vector<int64_t> expected_shape = {}) const;
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

 private:
  SafetensorsFile() = default;
  void Unmap();

  std::string path_;
  void* map_ = nullptr;  // the whole file, PROT_READ; nullptr when moved from
  size_t map_bytes_ = 0;
  const unsigned char* data_ = nullptr;  // start of the data buffer inside map_
  std::vector<std::string> names_;
  std::vector<TensorInfo> tensors_;                // in header order
  std::unordered_map<std::string, size_t> index_;  // name -> tensors_ index
  std::map<std::string, std::string> metadata_;
};

}  // namespace cpfill::runtime
