// cpfill/runtime/model/safetensors.cc — see safetensors.h for the format.
//
// Validation differs from the reference reader (safetensors/src/tensor.rs) in one way: the
// reference also insists that tensors tile the data buffer with no gaps and that the last one
// ends at EOF. Gaps harm nothing when reading in place, so they are accepted here; overlaps,
// which would alias two weights, are not.
#include "runtime/model/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <numeric>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/json_io.h"
#include "base/status.h"
#include "base/string_view.h"

namespace cpfill::runtime {

static_assert(std::endian::native == std::endian::little,
              "safetensors data is little-endian and is used in place");

namespace {

// The reference refuses headers above 100 MB; so do we (a corrupt length would otherwise make
// us parse the whole file as JSON).
constexpr uint64_t kMaxHeaderBytes = 100'000'000;

constexpr DType kAllDTypes[] = {DType::kF32,  DType::kF16,   DType::kBF16, DType::kF64,
                                DType::kI32,  DType::kI64,   DType::kU8,   DType::kI8,
                                DType::kBool, DType::kF8E4M3};

// Position in the reference library's Dtype enum, which is ordered by alignment. The writer
// sorts by it (descending), then by name, as the reference does, so that every tensor starts
// aligned to its element size and our files are byte-identical to the reference's.
int ReferenceRank(DType dtype) {
  switch (dtype) {
    case DType::kBool:
      return 0;
    case DType::kU8:
      return 1;
    case DType::kI8:
      return 2;
    case DType::kF8E4M3:
      return 4;
    case DType::kF16:
      return 7;
    case DType::kBF16:
      return 8;
    case DType::kI32:
      return 9;
    case DType::kF32:
      return 11;
    case DType::kF64:
      return 12;
    case DType::kI64:
      return 13;
  }
  return -1;
}

std::string ShapeString(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

// numel(shape) * elem_bytes, or false on overflow of uint64.
bool ByteSize(const std::vector<int64_t>& shape, int64_t elem_bytes, uint64_t& bytes) {
  uint64_t n = static_cast<uint64_t>(elem_bytes);
  for (const int64_t d : shape) {
    if (__builtin_mul_overflow(n, static_cast<uint64_t>(d), &n)) return false;
  }
  bytes = n;
  return true;
}

// A JSON integer >= 0 within int64 (dimensions and offsets; the reference reader takes usize).
bool AsIndex(const nlohmann::json& v, uint64_t& out) {
  const std::optional<int64_t> i = json::AsInt64(v);
  if (!i.has_value() || *i < 0) return false;
  out = static_cast<uint64_t>(*i);
  return true;
}

absl::Status WriteAll(int fd, const void* data, uint64_t bytes) {
  const char* p = static_cast<const char*>(data);
  while (bytes > 0) {
    // Linux writes at most ~2 GiB per call; loop over partial writes.
    const size_t chunk = static_cast<size_t>(std::min<uint64_t>(bytes, 1u << 30));
    const ssize_t n = ::write(fd, p, chunk);
    if (n < 0) {
      if (errno == EINTR) continue;
      return absl::ErrnoToStatus(errno, "write");
    }
    p += n;
    bytes -= static_cast<uint64_t>(n);
  }
  return absl::OkStatus();
}

}  // namespace

std::string_view DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return "F32";
    case DType::kF16:
      return "F16";
    case DType::kBF16:
      return "BF16";
    case DType::kF64:
      return "F64";
    case DType::kI32:
      return "I32";
    case DType::kI64:
      return "I64";
    case DType::kU8:
      return "U8";
    case DType::kI8:
      return "I8";
    case DType::kBool:
      return "BOOL";
    case DType::kF8E4M3:
      return "F8_E4M3";
  }
  return "?";
}

int64_t DTypeSize(DType dtype) {
  switch (dtype) {
    case DType::kF64:
    case DType::kI64:
      return 8;
    case DType::kF32:
    case DType::kI32:
      return 4;
    case DType::kF16:
    case DType::kBF16:
      return 2;
    case DType::kU8:
    case DType::kI8:
    case DType::kBool:
    case DType::kF8E4M3:
      return 1;
  }
  return 0;
}

absl::StatusOr<DType> ParseDType(std::string_view name) {
  for (const DType d : kAllDTypes) {
    if (DTypeName(d) == name) return d;
  }
  std::vector<std::string> valid;
  for (const DType d : kAllDTypes) valid.emplace_back(DTypeName(d));
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown dtype \"", Sv(name), "\" (supported: ", absl::StrJoin(valid, ", "), ")"));
}

// ---------------------------------------------------------------------------------------------
// SafetensorsWriter

absl::Status SafetensorsWriter::Add(std::string name, DType dtype, std::vector<int64_t> shape,
                                    const void* data) {
  CPFILL_CHECK_ARG(!name.empty(), "safetensors: tensor name is empty");
  CPFILL_CHECK_ARG(name != "__metadata__", "safetensors: \"__metadata__\" is reserved");
  for (const Entry& e : entries_) {
    CPFILL_CHECK_ARG(e.name != name, "safetensors: tensor \"", name, "\" added twice");
  }
  for (const int64_t d : shape) {
    CPFILL_CHECK_ARG(d >= 0, "safetensors: tensor \"", name, "\" has negative dimension in shape ",
                     ShapeString(shape));
  }
  uint64_t bytes = 0;
  CPFILL_CHECK_ARG(ByteSize(shape, DTypeSize(dtype), bytes), "safetensors: tensor \"", name,
                   "\" of shape ", ShapeString(shape), " overflows 64-bit byte size");
  CPFILL_CHECK_ARG(data != nullptr || bytes == 0, "safetensors: tensor \"", name,
                   "\" has null data for ", bytes, " bytes");
  entries_.push_back({std::move(name), dtype, std::move(shape), data, bytes});
  return absl::OkStatus();
}

void SafetensorsWriter::SetMetadata(std::string key, std::string value) {
  metadata_[std::move(key)] = std::move(value);
}

absl::Status SafetensorsWriter::Write(const std::string& path) const {
  // Step 1: lay out as the reference does: descending alignment, then name (byte order).
  std::vector<const Entry*> order;
  for (const Entry& e : entries_) order.push_back(&e);
  std::sort(order.begin(), order.end(), [](const Entry* l, const Entry* r) {
    if (ReferenceRank(l->dtype) != ReferenceRank(r->dtype)) {
      return ReferenceRank(l->dtype) > ReferenceRank(r->dtype);
    }
    return l->name < r->name;
  });

  // Step 2: the header, compact (as serde_json writes it), "__metadata__" first when present,
  // padded with spaces to a multiple of 8 so the data buffer starts aligned.
  // The entries are built in a vector and moved in whole: ordered_json's insertion by key scans
  // the keys, which would make a header of thousands of tensors quadratic.
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  auto& members = header.get_ref<nlohmann::ordered_json::object_t&>();
  members.reserve(order.size() + 1);
  if (!metadata_.empty()) {
    members.emplace_back("__metadata__", nlohmann::ordered_json(metadata_));
  }
  uint64_t offset = 0;
  for (const Entry* e : order) {
    nlohmann::ordered_json info = {{"dtype", DTypeName(e->dtype)},
                                   {"shape", e->shape},
                                   {"data_offsets", {offset, offset + e->bytes}}};
    members.emplace_back(e->name, std::move(info));
    offset += e->bytes;
  }
  absl::StatusOr<std::string> dumped = json::Dump(header);
  if (!dumped.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("safetensors: header for '", path, "': ", dumped.status().message()));
  }
  std::string header_text = *std::move(dumped);
  header_text.append((8 - header_text.size() % 8) % 8, ' ');
  unsigned char length_le[8];
  const uint64_t n = header_text.size();
  std::memcpy(length_le, &n, 8);  // little-endian host (static_assert above)

  // Step 3: stream to path.tmp, fsync, rename. Any failure removes the temporary file.
  const std::string tmp = path + ".tmp";
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) {
    return absl::ErrnoToStatus(errno, absl::StrCat("safetensors: cannot create '", tmp, "'"));
  }
  auto fail = [&](const absl::Status& s, std::string_view what) {
    ::close(fd);
    ::unlink(tmp.c_str());
    return absl::Status(s.code(), absl::StrCat("safetensors: ", Sv(what), " '", tmp, "' (for '",
                                               path, "'): ", s.message()));
  };
  if (absl::Status s = WriteAll(fd, length_le, 8); !s.ok()) return fail(s, "writing");
  if (absl::Status s = WriteAll(fd, header_text.data(), n); !s.ok()) return fail(s, "writing");
  for (const Entry* e : order) {
    if (absl::Status s = WriteAll(fd, e->data, e->bytes); !s.ok()) {
      return fail(s, absl::StrCat("writing tensor \"", e->name, "\" to"));
    }
  }
  if (::fsync(fd) != 0) return fail(absl::ErrnoToStatus(errno, "fsync"), "flushing");
  if (::close(fd) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    return absl::ErrnoToStatus(err, absl::StrCat("safetensors: closing '", tmp, "'"));
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    return absl::ErrnoToStatus(err,
                               absl::StrCat("safetensors: renaming '", tmp, "' to '", path, "'"));
  }
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------------------------
// SafetensorsFile

absl::StatusOr<SafetensorsFile> SafetensorsFile::Open(const std::string& path) {
  const std::string where = absl::StrCat("safetensors: '", path, "': ");
  auto invalid = [&](auto&&... parts) {
    return absl::InvalidArgumentError(absl::StrCat(where, parts...));
  };

  SafetensorsFile file;
  file.path_ = path;
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {  // the user named this file: NotFound, or InvalidArgument with the reason
    const int err = errno;
    const std::string message =
        absl::StrCat("safetensors: cannot open '", path, "': ", std::strerror(err));
    return err == ENOENT ? absl::NotFoundError(message) : absl::InvalidArgumentError(message);
  }
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    return absl::ErrnoToStatus(err, absl::StrCat("safetensors: cannot stat '", path, "'"));
  }
  const uint64_t file_bytes = static_cast<uint64_t>(st.st_size);
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    return invalid("not a regular file");
  }
  if (file_bytes < 8) {
    ::close(fd);
    return invalid("file is ", file_bytes, " bytes, shorter than the 8-byte header length");
  }
  void* map = ::mmap(nullptr, file_bytes, PROT_READ, MAP_PRIVATE, fd, 0);
  const int map_err = errno;
  ::close(fd);  // the mapping keeps the file alive
  if (map == MAP_FAILED) {
    return absl::ErrnoToStatus(map_err, absl::StrCat("safetensors: cannot map '", path, "'"));
  }
  file.map_ = map;
  file.map_bytes_ = file_bytes;
  const auto* bytes = static_cast<const unsigned char*>(map);

  // Step 1: the header length.
  uint64_t header_bytes;
  std::memcpy(&header_bytes, bytes, 8);
  if (header_bytes > kMaxHeaderBytes) {
    return invalid("header length ", header_bytes, " exceeds the ", kMaxHeaderBytes,
                   "-byte limit (corrupt or not a safetensors file)");
  }
  if (header_bytes > file_bytes - 8) {
    return invalid("header length ", header_bytes, " runs past the end of the file (", file_bytes,
                   " bytes; truncated?)");
  }
  const uint64_t buffer_bytes = file_bytes - 8 - header_bytes;
  file.data_ = bytes + 8 + header_bytes;

  // Step 2: the header JSON.
  // The parsed object is sorted by key; names() keeps the header's order, so take it too.
  std::vector<std::string> header_order;
  absl::StatusOr<nlohmann::json> header = json::Parse(
      std::string_view(reinterpret_cast<const char*>(bytes + 8), header_bytes), &header_order);
  if (!header.ok()) return invalid("header is not valid JSON: ", header.status().message());
  if (!header->is_object()) return invalid("header is not a JSON object");

  // Step 3: every entry.
  for (const std::string& name : header_order) {
    const nlohmann::json& entry = *json::Find(*header, name);
    if (name == "__metadata__") {
      if (!entry.is_object()) return invalid("\"__metadata__\" is not an object");
      for (const auto& [k, v] : entry.items()) {
        if (!v.is_string())
          return invalid("\"__metadata__\" value for \"", k, "\" is not a string");
        file.metadata_[k] = v.get<std::string>();
      }
      continue;
    }
    const std::string tensor = absl::StrCat("tensor \"", name, "\": ");
    if (!entry.is_object()) return invalid(tensor, "entry is not an object");
    TensorInfo info;
    info.name = name;

    const nlohmann::json* dtype = json::Find(entry, "dtype");
    if (dtype == nullptr || !dtype->is_string()) return invalid(tensor, "missing string \"dtype\"");
    absl::StatusOr<DType> parsed = ParseDType(dtype->get_ref<const std::string&>());
    if (!parsed.ok()) return invalid(tensor, parsed.status().message());
    info.dtype = *parsed;

    const nlohmann::json* shape = json::Find(entry, "shape");
    if (shape == nullptr || !shape->is_array()) return invalid(tensor, "missing array \"shape\"");
    for (const nlohmann::json& d : *shape) {
      uint64_t dim;
      if (!AsIndex(d, dim)) {
        return invalid(tensor, "shape ", json::Show(d), " in ", json::Show(*shape),
                       " is not a non-negative integer");
      }
      info.shape.push_back(static_cast<int64_t>(dim));
    }

    const nlohmann::json* offsets = json::Find(entry, "data_offsets");
    uint64_t begin, end;
    if (offsets == nullptr || !offsets->is_array() || offsets->size() != 2 ||
        !AsIndex((*offsets)[0], begin) || !AsIndex((*offsets)[1], end)) {
      return invalid(tensor, "\"data_offsets\" ",
                     offsets == nullptr ? std::string("missing") : json::Show(*offsets),
                     " is not two non-negative integers [begin, end]");
    }
    if (begin > end) return invalid(tensor, "data_offsets begin ", begin, " > end ", end);
    if (end > buffer_bytes) {
      return invalid(tensor, "data_offsets end ", end, " is beyond the data buffer (", buffer_bytes,
                     " bytes; truncated file or lying header)");
    }
    uint64_t expect_bytes;
    if (!ByteSize(info.shape, DTypeSize(info.dtype), expect_bytes)) {
      return invalid(tensor, "shape ", ShapeString(info.shape), " overflows 64-bit byte size");
    }
    if (end - begin != expect_bytes) {
      return invalid(tensor, "data_offsets [", begin, ", ", end, "] span ", end - begin,
                     " bytes but shape ", ShapeString(info.shape), " of ",
                     Sv(DTypeName(info.dtype)), " needs ", expect_bytes);
    }
    info.offset = begin;
    info.bytes = expect_bytes;
    file.index_.emplace(name, file.tensors_.size());
    file.names_.push_back(name);
    file.tensors_.push_back(std::move(info));
  }

  // Step 4: as the reference library requires, the tensors tile the data buffer: sorted by
  // offset, each begins where the one before ends, and the last ends with the file. A gap or
  // bytes past the last tensor mean a header length that is off (every tensor would be read
  // shifted) or bytes appended; an overlap means two tensors share bytes.
  std::vector<size_t> by_offset(file.tensors_.size());
  std::iota(by_offset.begin(), by_offset.end(), 0);
  std::sort(by_offset.begin(), by_offset.end(), [&](size_t l, size_t r) {
    const TensorInfo &a = file.tensors_[l], &b = file.tensors_[r];
    return a.offset != b.offset ? a.offset < b.offset : a.bytes < b.bytes;
  });
  uint64_t covered = 0;
  const TensorInfo* prev = nullptr;
  for (const size_t i : by_offset) {
    const TensorInfo& t = file.tensors_[i];
    if (t.offset < covered) {
      return invalid("tensor \"", t.name, "\" [", t.offset, ", ", t.offset + t.bytes,
                     ") overlaps tensor \"", prev->name, "\" [", prev->offset, ", ",
                     prev->offset + prev->bytes, ")");
    }
    if (t.offset > covered) {
      return invalid("bytes [", covered, ", ", t.offset,
                     ") of the data buffer belong to no "
                     "tensor (before tensor \"",
                     t.name, "\"; a wrong header length or offsets)");
    }
    covered = t.offset + t.bytes;
    prev = &t;
  }
  if (covered != buffer_bytes) {
    return invalid("the data buffer holds ", buffer_bytes, " bytes but the tensors cover ", covered,
                   " (header length ", header_bytes, " wrong, or bytes appended)");
  }
  return file;
}

SafetensorsFile::SafetensorsFile(SafetensorsFile&& other) noexcept { *this = std::move(other); }

SafetensorsFile& SafetensorsFile::operator=(SafetensorsFile&& other) noexcept {
  if (this != &other) {
    Unmap();
    path_ = std::move(other.path_);
    map_ = std::exchange(other.map_, nullptr);
    map_bytes_ = std::exchange(other.map_bytes_, 0);
    data_ = std::exchange(other.data_, nullptr);
    names_ = std::move(other.names_);
    tensors_ = std::move(other.tensors_);
    index_ = std::move(other.index_);
    metadata_ = std::move(other.metadata_);
  }
  return *this;
}

SafetensorsFile::~SafetensorsFile() { Unmap(); }

void SafetensorsFile::Unmap() {
  if (map_ != nullptr) ::munmap(map_, map_bytes_);
  map_ = nullptr;
  map_bytes_ = 0;
  data_ = nullptr;
}

const TensorInfo* SafetensorsFile::Find(std::string_view name) const {
  const auto it = index_.find(std::string(name));
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

absl::StatusOr<TensorView> SafetensorsFile::Get(std::string_view name, DType expected_dtype,
                                                std::vector<int64_t> expected_shape) const {
  const TensorInfo* info = Find(name);
  if (info == nullptr) {
    return absl::NotFoundError(
        absl::StrCat("safetensors: '", path_, "': no tensor \"", Sv(name), "\""));
  }
  if (info->dtype != expected_dtype) {
    return absl::InvalidArgumentError(absl::StrCat("safetensors: '", path_, "': tensor \"",
                                                   Sv(name), "\" is ", Sv(DTypeName(info->dtype)),
                                                   ", expected ", Sv(DTypeName(expected_dtype))));
  }
  if (!expected_shape.empty() && expected_shape != info->shape) {
    return absl::InvalidArgumentError(
        absl::StrCat("safetensors: '", path_, "': tensor \"", Sv(name), "\" has shape ",
                     ShapeString(info->shape), ", expected ", ShapeString(expected_shape)));
  }
  return TensorView{data_ + info->offset, info->dtype, info->shape, info->bytes};
}

}  // namespace cpfill::runtime
