#include "runtime/model/safetensors.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace cpfill::runtime {
namespace {

std::string TempPath(const std::string& name) { return ::testing::TempDir() + "/" + name; }

std::string ReadBytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

void WriteBytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(out.good()) << path;
}

std::string LengthLe(uint64_t n) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return s;
}

// A file with the given header text (not padded) followed by `buffer_bytes` zero bytes.
std::string FileWithHeader(const std::string& header, size_t buffer_bytes) {
  return LengthLe(header.size()) + header + std::string(buffer_bytes, '\0');
}

TEST(DType, NamesSizesAndParsing) {
  const std::pair<DType, int64_t> all[] = {{DType::kF32, 4}, {DType::kF16, 2}, {DType::kBF16, 2},
                                           {DType::kF64, 8}, {DType::kI32, 4}, {DType::kI64, 8},
                                           {DType::kU8, 1},  {DType::kI8, 1},  {DType::kBool, 1}};
  for (const auto& [dtype, size] : all) {
    EXPECT_EQ(DTypeSize(dtype), size) << DTypeName(dtype);
    absl::StatusOr<DType> back = ParseDType(DTypeName(dtype));
    ASSERT_TRUE(back.ok());
    EXPECT_EQ(*back, dtype);
  }
  EXPECT_EQ(DTypeName(DType::kBF16), "BF16");
  EXPECT_EQ(DTypeName(DType::kBool), "BOOL");
  absl::StatusOr<DType> bad = ParseDType("F8_E5M2");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("F8_E5M2"), std::string::npos);
  EXPECT_FALSE(ParseDType("f32").ok());  // the format's names are upper case
}

TEST(Safetensors, RoundTripsSeveralDtypesAndShapes) {
  const std::vector<float> f32 = {1.5f, -2, 3, 4, 5, 6};
  const std::vector<uint16_t> bf16 = {0x3f80, 0x4000, 0xbf80, 0x0000};
  const int64_t scalar = -1234567890123;
  const std::vector<double> f64 = {3.25};
  const std::vector<int32_t> i32 = {7, 8, 9};
  const std::vector<int8_t> i8 = {-1, 2};
  const std::vector<uint8_t> flags = {1, 0, 1};
  const std::vector<uint16_t> f16 = {0x3c00};

  SafetensorsWriter writer;
  ASSERT_TRUE(writer.Add("layers.0.w", DType::kF32, {2, 3}, f32.data()).ok());
  ASSERT_TRUE(writer.Add("layers.0.b", DType::kBF16, {4}, bf16.data()).ok());
  ASSERT_TRUE(writer.Add("step", DType::kI64, {}, &scalar).ok());
  ASSERT_TRUE(writer.Add("empty", DType::kU8, {0, 5}, nullptr).ok());
  ASSERT_TRUE(writer.Add("d", DType::kF64, {1, 1}, f64.data()).ok());
  ASSERT_TRUE(writer.Add("ids", DType::kI32, {3}, i32.data()).ok());
  ASSERT_TRUE(writer.Add("small", DType::kI8, {2}, i8.data()).ok());
  ASSERT_TRUE(writer.Add("mask", DType::kBool, {3, 1}, flags.data()).ok());
  ASSERT_TRUE(writer.Add("h", DType::kF16, {1}, f16.data()).ok());
  writer.SetMetadata("format", "pt");
  writer.SetMetadata("note", "quote \" and newline \n");
  writer.SetMetadata("format", "np");  // replaces
  const std::string path = TempPath("roundtrip.safetensors");
  ASSERT_TRUE(writer.Write(path).ok());
  EXPECT_NE(access((path + ".tmp").c_str(), F_OK), 0) << "temporary file left behind";

  absl::StatusOr<SafetensorsFile> opened = SafetensorsFile::Open(path);
  ASSERT_TRUE(opened.ok()) << opened.status();
  SafetensorsFile file = std::move(opened).value();  // the mapping survives moves
  EXPECT_EQ(file.names().size(), 9u);
  EXPECT_EQ(file.metadata().size(), 2u);
  EXPECT_EQ(file.metadata().at("format"), "np");
  EXPECT_EQ(file.metadata().at("note"), "quote \" and newline \n");

  auto expect_tensor = [&](const std::string& name, DType dtype, std::vector<int64_t> shape,
                           const void* data, size_t bytes) {
    absl::StatusOr<TensorView> v = file.Get(name, dtype, shape);
    ASSERT_TRUE(v.ok()) << v.status();
    EXPECT_EQ(v->dtype, dtype);
    EXPECT_EQ(v->shape, shape);
    EXPECT_EQ(v->bytes, bytes);
    if (bytes > 0) {
      EXPECT_EQ(std::memcmp(v->data, data, bytes), 0) << name;
    }
    // The reference layout aligns every tensor to its element size.
    EXPECT_EQ(reinterpret_cast<uintptr_t>(v->data) % DTypeSize(dtype), 0u) << name;
    const TensorInfo* info = file.Find(name);
    ASSERT_NE(info, nullptr);
    EXPECT_EQ(info->name, name);
    EXPECT_EQ(info->bytes, bytes);
  };
  expect_tensor("layers.0.w", DType::kF32, {2, 3}, f32.data(), 24);
  expect_tensor("layers.0.b", DType::kBF16, {4}, bf16.data(), 8);
  expect_tensor("step", DType::kI64, {}, &scalar, 8);
  expect_tensor("empty", DType::kU8, {0, 5}, nullptr, 0);
  expect_tensor("d", DType::kF64, {1, 1}, f64.data(), 8);
  expect_tensor("ids", DType::kI32, {3}, i32.data(), 12);
  expect_tensor("small", DType::kI8, {2}, i8.data(), 2);
  expect_tensor("mask", DType::kBool, {3, 1}, flags.data(), 3);
  expect_tensor("h", DType::kF16, {1}, f16.data(), 2);

  // An empty expected shape accepts any shape.
  absl::StatusOr<TensorView> any = file.Get("layers.0.w", DType::kF32);
  ASSERT_TRUE(any.ok());
  EXPECT_EQ(any->shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(static_cast<const float*>(any->data)[5], 6.0f);
  EXPECT_EQ(file.Find("nope"), nullptr);
}

TEST(Safetensors, WriterOrdersByAlignmentThenName) {
  const std::vector<uint16_t> two(1);
  const std::vector<float> four(1);
  const std::vector<int64_t> eight(1);
  const std::vector<uint8_t> one(1);
  SafetensorsWriter writer;
  ASSERT_TRUE(writer.Add("z_u8", DType::kU8, {1}, one.data()).ok());
  ASSERT_TRUE(writer.Add("b_f32", DType::kF32, {1}, four.data()).ok());
  ASSERT_TRUE(writer.Add("a_f32", DType::kF32, {1}, four.data()).ok());
  ASSERT_TRUE(writer.Add("c_bf16", DType::kBF16, {1}, two.data()).ok());
  ASSERT_TRUE(writer.Add("y_i64", DType::kI64, {1}, eight.data()).ok());
  const std::string path = TempPath("order.safetensors");
  ASSERT_TRUE(writer.Write(path).ok());
  absl::StatusOr<SafetensorsFile> file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ(file->names(), (std::vector<std::string>{"y_i64", "a_f32", "b_f32", "c_bf16", "z_u8"}));
  EXPECT_EQ(file->Find("y_i64")->offset, 0u);
  EXPECT_EQ(file->Find("a_f32")->offset, 8u);
  EXPECT_EQ(file->Find("b_f32")->offset, 12u);
  EXPECT_EQ(file->Find("c_bf16")->offset, 16u);
  EXPECT_EQ(file->Find("z_u8")->offset, 18u);
}

// Byte layouts produced by the reference implementation (the Python `safetensors` package is a
// binding of the Rust crate; these are the crate's own serialization test vectors, rebuilt here
// field by field): compact JSON header, "__metadata__" first, space padding to 8 bytes.
TEST(Safetensors, MatchesReferenceLayoutByteForByte) {
  const float values[] = {0, 1, 2, 3, 4, 5};
  std::string data(reinterpret_cast<const char*>(values), sizeof(values));
  ASSERT_EQ(data.substr(4, 4), std::string("\x00\x00\x80\x3f", 4));  // 1.0f little-endian

  struct Case {
    std::string name;
    std::vector<int64_t> shape;
    std::string expect;
  };
  const Case cases[] = {
      // 64-byte header: already a multiple of 8, no padding.
      {"attn.0",
       {1, 2, 3},
       std::string("\x40\0\0\0\0\0\0\0", 8) +
           R"({"attn.0":{"dtype":"F32","shape":[1,2,3],"data_offsets":[0,24]}})" + data},
      // 65 bytes of JSON + 7 spaces = 72.
      {"attn0",
       {1, 1, 2, 3},
       std::string("\x48\0\0\0\0\0\0\0", 8) +
           R"({"attn0":{"dtype":"F32","shape":[1,1,2,3],"data_offsets":[0,24]}})" + "       " +
           data},
  };
  for (const Case& c : cases) {
    const std::string by_hand = TempPath("by_hand.safetensors");
    WriteBytes(by_hand, c.expect);
    absl::StatusOr<SafetensorsFile> file = SafetensorsFile::Open(by_hand);
    ASSERT_TRUE(file.ok()) << file.status();
    absl::StatusOr<TensorView> v = file->Get(c.name, DType::kF32, c.shape);
    ASSERT_TRUE(v.ok()) << v.status();
    EXPECT_EQ(std::memcmp(v->data, values, sizeof(values)), 0);

    SafetensorsWriter writer;
    ASSERT_TRUE(writer.Add(c.name, DType::kF32, c.shape, values).ok());
    const std::string ours = TempPath("ours.safetensors");
    ASSERT_TRUE(writer.Write(ours).ok());
    EXPECT_EQ(ReadBytes(ours), c.expect) << c.name;
  }

  // No tensors, metadata {"framework": "pt"}: 35 bytes of JSON + 5 spaces = 40.
  const std::string expect =
      std::string("\x28\0\0\0\0\0\0\0", 8) + R"({"__metadata__":{"framework":"pt"}})" + "     ";
  SafetensorsWriter writer;
  writer.SetMetadata("framework", "pt");
  const std::string ours = TempPath("meta_only.safetensors");
  ASSERT_TRUE(writer.Write(ours).ok());
  EXPECT_EQ(ReadBytes(ours), expect);
  absl::StatusOr<SafetensorsFile> file = SafetensorsFile::Open(ours);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_TRUE(file->names().empty());
  EXPECT_EQ(file->metadata().at("framework"), "pt");
}

TEST(Safetensors, GetChecksNameDtypeAndShape) {
  const std::vector<float> x(6);
  SafetensorsWriter writer;
  ASSERT_TRUE(writer.Add("x", DType::kF32, {2, 3}, x.data()).ok());
  const std::string path = TempPath("get.safetensors");
  ASSERT_TRUE(writer.Write(path).ok());
  absl::StatusOr<SafetensorsFile> file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok());

  absl::StatusOr<TensorView> v = file->Get("y", DType::kF32);
  EXPECT_EQ(v.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(v.status().message().find(path), std::string::npos);
  EXPECT_NE(v.status().message().find("\"y\""), std::string::npos);

  v = file->Get("x", DType::kBF16);
  EXPECT_EQ(v.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(v.status().message().find("is F32, expected BF16"), std::string::npos) << v.status();

  v = file->Get("x", DType::kF32, {3, 2});
  EXPECT_EQ(v.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(v.status().message().find("has shape [2, 3], expected [3, 2]"), std::string::npos)
      << v.status();
}

TEST(Safetensors, WriterRejectsBadInputAndLeavesNothingOnFailure) {
  const std::vector<float> x(4);
  SafetensorsWriter writer;
  ASSERT_TRUE(writer.Add("x", DType::kF32, {4}, x.data()).ok());
  EXPECT_EQ(writer.Add("x", DType::kF32, {4}, x.data()).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(writer.Add("neg", DType::kF32, {-1, 4}, x.data()).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(writer.Add("null", DType::kF32, {4}, nullptr).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(writer.Add("__metadata__", DType::kF32, {4}, x.data()).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(writer.Add("", DType::kF32, {4}, x.data()).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(writer.Add("huge", DType::kF64, {int64_t{1} << 40, int64_t{1} << 40}, x.data()).code(),
            absl::StatusCode::kInvalidArgument);

  const std::string path = ::testing::TempDir() + "/no_such_dir/out.safetensors";
  absl::Status s = writer.Write(path);
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << s;
  EXPECT_NE(s.message().find(path), std::string::npos) << s;
  EXPECT_NE(s.message().find("No such file or directory"), std::string::npos) << s;
  EXPECT_NE(access((path + ".tmp").c_str(), F_OK), 0);

  // A failed rename (the target is a non-empty directory) removes the temporary file and leaves
  // the target untouched.
  const std::string dir = TempPath("target_is_dir.safetensors");
  ::mkdir(dir.c_str(), 0755);
  WriteBytes(dir + "/keep", "x");
  s = writer.Write(dir);
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find(dir), std::string::npos) << s;
  EXPECT_NE(access((dir + ".tmp").c_str(), F_OK), 0);
  EXPECT_EQ(ReadBytes(dir + "/keep"), "x");
}

struct Corruption {
  std::string label;
  std::string bytes;
  std::string message;  // expected substring
};

TEST(Safetensors, RejectsEveryCorruptionNamingFileAndProblem) {
  const std::string ok_entry = R"("w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]})";
  std::vector<Corruption> cases = {
      {"short file", std::string("\x05\0\0", 3), "3 bytes, shorter than the 8-byte header length"},
      {"empty file", "", "0 bytes, shorter than the 8-byte header length"},
      {"absurd header length", LengthLe(uint64_t{1} << 40) + "{}", "exceeds the 100000000-byte"},
      {"max header length", LengthLe(~uint64_t{0}) + "{}", "exceeds the 100000000-byte"},
      {"header past eof", LengthLe(100) + "{}", "header length 100 runs past the end"},
      {"not json", FileWithHeader("{\"w\": [1,}", 0), "header is not valid JSON: json: line 1"},
      {"not an object", FileWithHeader("[1, 2]", 0), "header is not a JSON object"},
      {"entry not object", FileWithHeader(R"({"w": 3})", 0),
       "tensor \"w\": entry is not an object"},
      {"unknown dtype",
       FileWithHeader(R"({"w":{"dtype":"F8_E5M2","shape":[2],"data_offsets":[0,2]}})", 2),
       "tensor \"w\": unknown dtype \"F8_E5M2\""},
      {"missing dtype", FileWithHeader(R"({"w":{"shape":[2],"data_offsets":[0,8]}})", 8),
       "tensor \"w\": missing string \"dtype\""},
      {"negative shape",
       FileWithHeader(R"({"w":{"dtype":"F32","shape":[-1,2],"data_offsets":[0,8]}})", 8),
       "tensor \"w\": shape -1 in [-1,2] is not a non-negative integer"},
      {"fractional shape",
       FileWithHeader(R"({"w":{"dtype":"F32","shape":[1.5],"data_offsets":[0,8]}})", 8),
       "is not a non-negative integer"},
      {"missing shape", FileWithHeader(R"({"w":{"dtype":"F32","data_offsets":[0,8]}})", 8),
       "tensor \"w\": missing array \"shape\""},
      {"one offset", FileWithHeader(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0]}})", 8),
       "tensor \"w\": \"data_offsets\" [0] is not two non-negative integers"},
      {"three offsets",
       FileWithHeader(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8,9]}})", 9),
       "\"data_offsets\" [0,8,9] is not two"},
      {"string offset",
       FileWithHeader(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":["0",8]}})", 8),
       "is not two non-negative integers"},
      {"missing offsets", FileWithHeader(R"({"w":{"dtype":"F32","shape":[2]}})", 8),
       "\"data_offsets\" missing"},
      {"begin after end",
       FileWithHeader(R"({"w":{"dtype":"F32","shape":[0],"data_offsets":[8,0]}})", 8),
       "tensor \"w\": data_offsets begin 8 > end 0"},
      {"end beyond buffer",
       FileWithHeader(R"({"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", 8),
       "tensor \"w\": data_offsets end 16 is beyond the data buffer (8 bytes"},
      {"size mismatch",
       FileWithHeader(R"({"w":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", 8),
       "tensor \"w\": data_offsets [0, 8] span 8 bytes but shape [3] of F32 needs 12"},
      {"bf16 size mismatch",
       FileWithHeader(R"({"w":{"dtype":"BF16","shape":[2],"data_offsets":[0,8]}})", 8),
       "shape [2] of BF16 needs 4"},
      {"shape overflow",
       FileWithHeader(
           R"({"w":{"dtype":"F64","shape":[4294967296,4294967296],"data_offsets":[0,8]}})", 8),
       "overflows 64-bit byte size"},
      {"overlap",
       FileWithHeader(absl::StrCat("{", ok_entry,
                                   R"(,"v":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})"),
                      12),
       "tensor \"v\" [4, 12) overlaps tensor \"w\" [0, 8)"},
      {"gap before a tensor",
       FileWithHeader(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})", 12),
       "bytes [0, 4) of the data buffer belong to no tensor"},
      {"bytes past the last tensor",
       FileWithHeader(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", 9),
       "the data buffer holds 9 bytes but the tensors cover 8"},
      {"metadata not strings", FileWithHeader(R"({"__metadata__":{"n":1}})", 0),
       "\"__metadata__\" value for \"n\" is not a string"},
      {"metadata not object", FileWithHeader(R"({"__metadata__":[]})", 0),
       "\"__metadata__\" is not an object"},
  };
  for (const Corruption& c : cases) {
    SCOPED_TRACE(c.label);
    const std::string path = TempPath("corrupt.safetensors");
    WriteBytes(path, c.bytes);
    absl::StatusOr<SafetensorsFile> file = SafetensorsFile::Open(path);
    ASSERT_FALSE(file.ok());
    EXPECT_EQ(file.status().code(), absl::StatusCode::kInvalidArgument) << file.status();
    EXPECT_NE(file.status().message().find(path), std::string::npos) << file.status();
    EXPECT_NE(file.status().message().find(c.message), std::string::npos) << file.status();
  }
}

TEST(Safetensors, TruncatedFileAndLyingHeaderAreRejected) {
  std::vector<float> x(16, 1.0f);
  SafetensorsWriter writer;
  ASSERT_TRUE(writer.Add("a", DType::kF32, {8}, x.data()).ok());
  ASSERT_TRUE(writer.Add("b", DType::kF32, {8}, x.data() + 8).ok());
  const std::string path = TempPath("truncated.safetensors");
  ASSERT_TRUE(writer.Write(path).ok());
  const std::string full = ReadBytes(path);
  ASSERT_TRUE(SafetensorsFile::Open(path).ok());

  // Cut the last 4 bytes: the last tensor now ends beyond the buffer.
  ASSERT_EQ(::truncate(path.c_str(), static_cast<off_t>(full.size() - 4)), 0);
  absl::StatusOr<SafetensorsFile> file = SafetensorsFile::Open(path);
  EXPECT_EQ(file.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(file.status().message().find("tensor \"b\": data_offsets end 64 is beyond the data "
                                         "buffer (60 bytes"),
            std::string::npos)
      << file.status();

  // Cut inside the header.
  ASSERT_EQ(::truncate(path.c_str(), 20), 0);
  file = SafetensorsFile::Open(path);
  EXPECT_EQ(file.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(file.status().message().find("runs past the end of the file (20 bytes"),
            std::string::npos)
      << file.status();

  // A header that lies: "b" claims the bytes of "a" (same header length, so only the offsets
  // are wrong).
  std::string lying = full;
  const size_t at = lying.find("[32,64]");
  ASSERT_NE(at, std::string::npos) << lying.substr(8, 120);
  lying.replace(at, 7, "[0,32] ");
  WriteBytes(path, lying);
  file = SafetensorsFile::Open(path);
  EXPECT_EQ(file.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(file.status().message().find("overlaps"), std::string::npos) << file.status();
}

TEST(Safetensors, MissingFileIsNotFound) {
  const std::string path = TempPath("does_not_exist.safetensors");
  absl::StatusOr<SafetensorsFile> file = SafetensorsFile::Open(path);
  EXPECT_EQ(file.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(file.status().message().find(path), std::string::npos);
}

TEST(Safetensors, MoveAssignmentKeepsDataValid) {
  const std::vector<int32_t> a = {1, 2}, b = {3};
  SafetensorsWriter wa, wb;
  ASSERT_TRUE(wa.Add("a", DType::kI32, {2}, a.data()).ok());
  ASSERT_TRUE(wb.Add("b", DType::kI32, {1}, b.data()).ok());
  ASSERT_TRUE(wa.Write(TempPath("ma.safetensors")).ok());
  ASSERT_TRUE(wb.Write(TempPath("mb.safetensors")).ok());
  absl::StatusOr<SafetensorsFile> fa = SafetensorsFile::Open(TempPath("ma.safetensors"));
  absl::StatusOr<SafetensorsFile> fb = SafetensorsFile::Open(TempPath("mb.safetensors"));
  ASSERT_TRUE(fa.ok() && fb.ok());
  SafetensorsFile x = std::move(*fa);
  x = std::move(*fb);  // unmaps a's file, takes b's
  absl::StatusOr<TensorView> v = x.Get("b", DType::kI32, {1});
  ASSERT_TRUE(v.ok());
  EXPECT_EQ(*static_cast<const int32_t*>(v->data), 3);
  EXPECT_EQ(x.Find("a"), nullptr);
  EXPECT_NE(x.path().find("mb.safetensors"), std::string::npos);
}

}  // namespace
}  // namespace cpfill::runtime
