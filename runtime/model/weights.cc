// cpfill/runtime/model/weights.cc — loading, synthesising and saving a rank's Llama weights.
//
// Every tensor is described once (TensorSpec: HF name, whole shape, how tensor parallelism
// splits it); loading, synthesis and saving all walk the same list, so the three cannot
// disagree about names, shapes or slices.
#include "runtime/model/weights.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <system_error>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/bfloat16.h"
#include "base/json_io.h"
#include "base/knobs.h"
#include "base/random.h"
#include "base/status.h"
#include "base/string_view.h"
#include "base/thread_pool.h"
#include "runtime/model/safetensors.h"

namespace cpfill::runtime {
namespace {

// How a [rows, cols] tensor is split over tp ranks.
enum class Split {
  kReplicated,  // every rank holds it whole (embedding, norms)
  kRows,        // rank r holds rows [r * rows / tp, (r + 1) * rows / tp): column-parallel
                // projections and the LM head
  kColumns,     // rank r holds, for every row, columns [r * cols / tp, ...): row-parallel
};

enum class Init { kMatrix, kNorm };

// One tensor of the model. A 1-D tensor ([D] norms) has rows == 1 and `is_vector` set, so
// its HF shape is [cols]. Its data in ModelWeights is `model_field`, or `layer_field` of
// layers[layer] when layer >= 0.
struct TensorSpec {
  std::string name;  // HF name, e.g. "model.layers.3.self_attn.q_proj.weight"
  int64_t rows = 1;
  int64_t cols = 0;
  bool is_vector = false;
  Split split = Split::kReplicated;
  Init init = Init::kMatrix;
  int layer = -1;
  std::vector<float> ModelWeights::*model_field = nullptr;
  std::vector<float> LayerWeights::*layer_field = nullptr;
  Fp8Matrix LayerWeights::*fp8_field = nullptr;  // the projections' FP8 twin; else nullptr

  std::vector<int64_t> HfShape() const {
    return is_vector ? std::vector<int64_t>{cols} : std::vector<int64_t>{rows, cols};
  }
  // HF module name: "model.layers.3.mlp.down_proj" for "model.layers.3.mlp.down_proj.weight".
  std::string Module() const { return name.substr(0, name.rfind('.')); }
  // The tensor's storage in `w` (ModelWeights or const ModelWeights).
  template <typename W>
  auto& In(W& w) const {
    return layer < 0 ? w.*model_field : w.layers[static_cast<size_t>(layer)].*layer_field;
  }
};

// This rank's block of a spec: rows [row0, row0 + nrows) x columns [col0, col0 + ncols).
struct Block {
  int64_t row0, nrows, col0, ncols;
};

Block SliceOf(const TensorSpec& t, int tp_rank, int tp_size) {
  switch (t.split) {
    case Split::kRows:
      return {tp_rank * (t.rows / tp_size), t.rows / tp_size, 0, t.cols};
    case Split::kColumns:
      return {0, t.rows, tp_rank * (t.cols / tp_size), t.cols / tp_size};
    case Split::kReplicated:
      break;
  }
  return {0, t.rows, 0, t.cols};
}

// The FP8 twin of a projection's fp32 field (nullptr for norms).
Fp8Matrix LayerWeights::*Fp8TwinOf(std::vector<float> LayerWeights::*field) {
  using L = LayerWeights;
  const std::pair<std::vector<float> L::*, Fp8Matrix L::*> twins[] = {
      {&L::wq, &L::wq_fp8},        {&L::wk, &L::wk_fp8},         {&L::wv, &L::wv_fp8},
      {&L::wo, &L::wo_fp8},        {&L::w_gate, &L::w_gate_fp8}, {&L::w_up, &L::w_up_fp8},
      {&L::w_down, &L::w_down_fp8}};
  for (const auto& [f, twin] : twins) {
    if (f == field) return twin;
  }
  return nullptr;
}

// The model's tensors in HF order. The LM head is listed only when untied: a tied model's head
// is the embedding.
std::vector<TensorSpec> ModelTensors(const ModelConfig& c) {
  const int64_t d = c.hidden_size;
  const int64_t q = int64_t{c.num_heads} * c.head_dim;
  const int64_t kv = int64_t{c.num_kv_heads} * c.head_dim;
  const int64_t inter = c.intermediate_size;
  std::vector<TensorSpec> specs;
  auto model = [&](std::string name, int64_t rows, int64_t cols, bool is_vector, Split split,
                   Init init, std::vector<float> ModelWeights::*field) {
    specs.push_back({std::move(name), rows, cols, is_vector, split, init, -1, field, nullptr});
  };
  auto layer = [&](int i, const char* suffix, int64_t rows, int64_t cols, bool is_vector,
                   Split split, Init init, std::vector<float> LayerWeights::*field) {
    specs.push_back({absl::StrCat("model.layers.", i, ".", suffix), rows, cols, is_vector, split,
                     init, i, nullptr, field, Fp8TwinOf(field)});
  };
  model("model.embed_tokens.weight", c.vocab_size, d, false, Split::kReplicated, Init::kMatrix,
        &ModelWeights::embedding);
  for (int i = 0; i < c.num_layers; ++i) {
    layer(i, "input_layernorm.weight", 1, d, true, Split::kReplicated, Init::kNorm,
          &LayerWeights::input_norm);
    layer(i, "self_attn.q_proj.weight", q, d, false, Split::kRows, Init::kMatrix,
          &LayerWeights::wq);
    layer(i, "self_attn.k_proj.weight", kv, d, false, Split::kRows, Init::kMatrix,
          &LayerWeights::wk);
    layer(i, "self_attn.v_proj.weight", kv, d, false, Split::kRows, Init::kMatrix,
          &LayerWeights::wv);
    layer(i, "self_attn.o_proj.weight", d, q, false, Split::kColumns, Init::kMatrix,
          &LayerWeights::wo);
    layer(i, "post_attention_layernorm.weight", 1, d, true, Split::kReplicated, Init::kNorm,
          &LayerWeights::post_norm);
    layer(i, "mlp.gate_proj.weight", inter, d, false, Split::kRows, Init::kMatrix,
          &LayerWeights::w_gate);
    layer(i, "mlp.up_proj.weight", inter, d, false, Split::kRows, Init::kMatrix,
          &LayerWeights::w_up);
    layer(i, "mlp.down_proj.weight", d, inter, false, Split::kColumns, Init::kMatrix,
          &LayerWeights::w_down);
  }
  model("model.norm.weight", 1, d, true, Split::kReplicated, Init::kNorm,
        &ModelWeights::final_norm);
  if (!c.tie_word_embeddings) {
    model("lm_head.weight", c.vocab_size, d, false, Split::kRows, Init::kMatrix,
          &ModelWeights::lm_head);
  }
  return specs;
}

std::string ShapeString(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

// IEEE binary16 -> binary32, exact for every input (subnormals, infinities, NaN payloads).
float HalfBitsToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exponent = (h >> 10) & 0x1fu;
  uint32_t mantissa = h & 0x3ffu;
  uint32_t bits;
  if (exponent == 0x1f) {
    bits = sign | 0x7f800000u | (mantissa << 13);  // inf or NaN
  } else if (exponent != 0) {
    bits = sign | ((exponent + (127 - 15)) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {
    bits = sign;  // +-0
  } else {
    // Subnormal: mantissa * 2^-24. Shift the leading 1 up to the implicit-bit position; each
    // shift lowers the exponent by one from that of 2^-14 (the smallest normal).
    exponent = 127 - 14;
    while ((mantissa & 0x400u) == 0) {
      mantissa <<= 1;
      --exponent;
    }
    bits = sign | (exponent << 23) | ((mantissa & 0x3ffu) << 13);
  }
  float x;
  std::memcpy(&x, &bits, 4);
  return x;
}

// Converts `n` consecutive elements of `dtype` at `src` (any alignment) to fp32.
void ConvertToFloat(const unsigned char* src, DType dtype, int64_t n, float* dst) {
  switch (dtype) {
    case DType::kF32:
      std::memcpy(dst, src, static_cast<size_t>(n) * 4);
      return;
    case DType::kBF16:
      for (int64_t i = 0; i < n; ++i) {
        uint16_t b;
        std::memcpy(&b, src + 2 * i, 2);
        dst[i] = Bfloat16BitsToFloat(b);
      }
      return;
    case DType::kF16:
      for (int64_t i = 0; i < n; ++i) {
        uint16_t b;
        std::memcpy(&b, src + 2 * i, 2);
        dst[i] = HalfBitsToFloat(b);
      }
      return;
    default:
      return;  // rejected before we get here
  }
}

// The checkpoint's files: one model.safetensors, or shards named by the index's weight_map.
// Shards are opened (mapped) on first use and stay mapped until loading ends.
class Checkpoint {
 public:
  static absl::StatusOr<Checkpoint> Open(const std::string& dir) {
    Checkpoint ckpt;
    ckpt.dir_ = dir;
    const std::filesystem::path root(dir);
    const std::filesystem::path index = root / "model.safetensors.index.json";
    const std::filesystem::path single = root / "model.safetensors";
    std::error_code ec;
    if (std::filesystem::exists(index, ec)) {
      ckpt.index_path_ = index.string();
      CPFILL_ASSIGN_OR_RETURN(nlohmann::json v, json::ReadFile(ckpt.index_path_));
      const nlohmann::json* map = json::Find(v, "weight_map");
      if (map == nullptr || !map->is_object()) {
        return absl::InvalidArgumentError(
            absl::StrCat("weights: '", ckpt.index_path_, "': no \"weight_map\" object"));
      }
      for (const auto& [tensor, file] : map->items()) {
        if (!file.is_string() || file.get_ref<const std::string&>().empty()) {
          return absl::InvalidArgumentError(
              absl::StrCat("weights: '", ckpt.index_path_, "': weight_map entry for tensor \"",
                           tensor, "\" is ", json::Show(file), ", expected a file name"));
        }
        ckpt.weight_map_[tensor] = file.get<std::string>();
      }
      return ckpt;
    }
    if (std::filesystem::exists(single, ec)) {
      ckpt.single_ = "model.safetensors";
      return ckpt;
    }
    return absl::NotFoundError(absl::StrCat("weights: '", dir,
                                            "' has neither model.safetensors nor "
                                            "model.safetensors.index.json"));
  }

  // The tensor `name` checked against `shape` and a float dtype (or F8_E4M3 if `allow_fp8`).
  absl::StatusOr<TensorView> Get(const std::string& name, const std::vector<int64_t>& shape,
                                 bool allow_fp8 = false) {
    CPFILL_ASSIGN_OR_RETURN(const Found found, Lookup(name));
    const auto& [file, info] = found;
    const bool fp8 = allow_fp8 && info->dtype == DType::kF8E4M3;
    if (!fp8 && info->dtype != DType::kF32 && info->dtype != DType::kBF16 &&
        info->dtype != DType::kF16) {
      return absl::InvalidArgumentError(
          absl::StrCat("weights: '", file->path(), "': tensor \"", name, "\" has dtype ",
                       Sv(DTypeName(info->dtype)), "; weights must be F32, BF16 or F16",
                       allow_fp8 ? " (or F8_E4M3 with a weight_scale)" : ""));
    }
    if (info->shape != shape) {
      return absl::InvalidArgumentError(absl::StrCat(
          "weights: '", file->path(), "': tensor \"", name, "\" has shape ",
          ShapeString(info->shape), ", expected ", ShapeString(shape), " from the model config"));
    }
    return file->Get(name, info->dtype, shape);
  }

  // A row-wise FP8 weight's scales, whole: `name` F32 or BF16 of shape [rows, 1] or [rows].
  absl::StatusOr<std::vector<float>> RowScales(const std::string& name, int64_t rows) {
    CPFILL_ASSIGN_OR_RETURN(const Found found, Lookup(name));
    const auto& [file, info] = found;
    const bool shape_ok =
        info->shape == std::vector<int64_t>{rows, 1} || info->shape == std::vector<int64_t>{rows};
    if (!shape_ok || (info->dtype != DType::kF32 && info->dtype != DType::kBF16)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "weights: '", file->path(), "': FP8 scale \"", name, "\" is ", Sv(DTypeName(info->dtype)),
          " ", ShapeString(info->shape), ", expected F32 or BF16 [", rows, ", 1] or [", rows, "]"));
    }
    CPFILL_ASSIGN_OR_RETURN(const TensorView view, file->Get(name, info->dtype, info->shape));
    std::vector<float> scales(static_cast<size_t>(rows));
    ConvertToFloat(static_cast<const unsigned char*>(view.data), view.dtype, rows, scales.data());
    return scales;
  }

 private:
  using Found = std::pair<const SafetensorsFile*, const TensorInfo*>;
  absl::StatusOr<Found> Lookup(const std::string& name) {
    std::string file_name = single_;
    if (file_name.empty()) {
      const auto it = weight_map_.find(name);
      if (it == weight_map_.end()) {
        return absl::NotFoundError(
            absl::StrCat("weights: '", index_path_, "': weight_map has no tensor \"", name, "\""));
      }
      file_name = it->second;
    }
    CPFILL_ASSIGN_OR_RETURN(const SafetensorsFile* file, File(file_name));
    const TensorInfo* info = file->Find(name);
    if (info == nullptr) {
      return absl::NotFoundError(
          absl::StrCat("weights: '", file->path(), "': no tensor \"", name, "\""));
    }
    return Found{file, info};
  }

  absl::StatusOr<const SafetensorsFile*> File(const std::string& file_name) {
    auto it = files_.find(file_name);
    if (it == files_.end()) {
      const std::string path = (std::filesystem::path(dir_) / file_name).string();
      CPFILL_ASSIGN_OR_RETURN(SafetensorsFile file, SafetensorsFile::Open(path));
      it = files_.emplace(file_name, std::make_unique<SafetensorsFile>(std::move(file))).first;
    }
    return it->second.get();
  }

  std::string dir_;
  std::string single_;      // "model.safetensors" when not sharded
  std::string index_path_;  // the index when sharded
  std::map<std::string, std::string> weight_map_;
  std::map<std::string, std::unique_ptr<SafetensorsFile>> files_;
};

absl::Status CheckRank(const ModelConfig& config, int tp_rank, int tp_size) {
  CPFILL_RETURN_IF_ERROR(config.ValidateForTp(tp_size));
  CPFILL_CHECK_ARG(tp_rank >= 0 && tp_rank < tp_size, "weights: tp_rank ", tp_rank,
                   " is outside [0, ", tp_size, ")");
  return absl::OkStatus();
}

ModelWeights EmptyWeights(const ModelConfig& config, int tp_rank, int tp_size) {
  ModelWeights w;
  w.tp_rank = tp_rank;
  w.tp_size = tp_size;
  w.layers.resize(static_cast<size_t>(config.num_layers));
  return w;
}

// A tied LM head is the embedding rows of this rank's vocab slice.
void TieLmHead(const ModelConfig& config, ModelWeights& w) {
  const int64_t rows = config.vocab_size / w.tp_size;
  const int64_t d = config.hidden_size;
  const auto begin = w.embedding.begin() + w.tp_rank * rows * d;
  w.lm_head.assign(begin, begin + rows * d);
}

// Runs fn(row) for every row on this rank's share of the host's cores: making or converting the
// weights of a large model row by row on one thread takes minutes (8B: about 80 s).
void ParallelRows(int64_t rows, const std::function<void(int64_t)>& fn) {
  static ThreadPool* pool = [] {
    const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    const int64_t ranks = knobs::LocalRanks();
    return new ThreadPool(static_cast<int>(std::max<int64_t>(1, cores / ranks)));
  }();
  constexpr int64_t kRowsPerItem = 64;
  pool->ParallelFor((rows + kRowsPerItem - 1) / kRowsPerItem, [&](int64_t item) {
    for (int64_t r = item * kRowsPerItem; r < std::min(rows, (item + 1) * kRowsPerItem); ++r) {
      fn(r);
    }
  });
}

// Row-wise FP8 of this rank's block of `t`; `whole_row(row, dst)` writes row `row` of the whole
// tensor (all t.cols values: the scale is the whole row's, whatever the column slice).
void QuantizeBlock(const TensorSpec& t, const Block& b,
                   const std::function<void(int64_t, float*)>& whole_row, Fp8Matrix* m) {
  m->codes.resize(static_cast<size_t>(b.nrows * b.ncols));
  m->row_scale.resize(static_cast<size_t>(b.nrows));
  ParallelRows(b.nrows, [&](int64_t r) {
    thread_local std::vector<float> row;
    row.resize(static_cast<size_t>(t.cols));
    whole_row(b.row0 + r, row.data());
    m->row_scale[r] =
        QuantizeRowSlice(row.data(), t.cols, b.col0, b.ncols, m->codes.data() + r * b.ncols);
  });
}

// Whether the load-time --quantize applies to `t` (a checkpoint's own quantization_config
// leaves its fp32/bf16 tensors as stored).
bool QuantizeAtLoad(const ModelConfig& c, const TensorSpec& t) {
  return t.fp8_field != nullptr && !c.fp8.from_checkpoint && c.fp8.Quantizes(t.Module());
}

// An F8_E4M3 projection as stored, or a float one quantized at load. False: load it as floats.
absl::StatusOr<bool> LoadFp8(Checkpoint& ckpt, const ModelConfig& c, const TensorSpec& t,
                             const Block& b, ModelWeights& w) {
  CPFILL_ASSIGN_OR_RETURN(const TensorView view, ckpt.Get(t.name, t.HfShape(), true));
  const bool stored_fp8 = view.dtype == DType::kF8E4M3;
  if (!stored_fp8 && !QuantizeAtLoad(c, t)) return false;
  Fp8Matrix& m = w.layers[static_cast<size_t>(t.layer)].*t.fp8_field;
  const auto* base = static_cast<const unsigned char*>(view.data);
  if (!stored_fp8) {
    QuantizeBlock(
        t, b,
        [&](int64_t row, float* dst) {
          ConvertToFloat(base + row * t.cols * DTypeSize(view.dtype), view.dtype, t.cols, dst);
        },
        &m);
    return true;
  }
  CPFILL_ASSIGN_OR_RETURN(std::vector<float> scales,
                          ckpt.RowScales(t.Module() + ".weight_scale", t.rows));
  m.row_scale.assign(scales.begin() + b.row0, scales.begin() + b.row0 + b.nrows);
  m.codes.resize(static_cast<size_t>(b.nrows * b.ncols));
  ParallelRows(b.nrows, [&](int64_t r) {
    std::memcpy(m.codes.data() + r * b.ncols, base + (b.row0 + r) * t.cols + b.col0,
                static_cast<size_t>(b.ncols));
  });
  return true;
}

// The FP8 twin of `t` in `w` when it is filled; nullptr otherwise.
const Fp8Matrix* Fp8Of(const TensorSpec& t, const ModelWeights& w) {
  if (t.fp8_field == nullptr) return nullptr;
  const Fp8Matrix& m = w.layers[static_cast<size_t>(t.layer)].*t.fp8_field;
  return m.empty() ? nullptr : &m;
}

// fbgemm_fp8's quantization_config as transformers reads it (FbgemmFp8Config): the projections
// kept in high precision by name, and the LM head. Null when nothing is FP8.
nlohmann::ordered_json Fp8QuantizationConfig(const ModelConfig& c, const ModelWeights& w,
                                             const std::vector<TensorSpec>& specs) {
  nlohmann::ordered_json skip = nlohmann::ordered_json::array();
  bool any = false;
  for (const TensorSpec& t : specs) {
    if (t.fp8_field == nullptr) continue;
    if (Fp8Of(t, w) != nullptr) {
      any = true;
    } else {
      skip.push_back(t.Module());
    }
  }
  if (!any) return nullptr;
  skip.push_back("lm_head");
  return {{"quant_method", "fbgemm_fp8"},
          {"activation_scale_ub", c.fp8.activation_scale_ub},
          {"modules_to_not_convert", std::move(skip)}};
}

}  // namespace

absl::StatusOr<ModelWeights> LoadWeights(const ModelConfig& config, const std::string& dir,
                                         int tp_rank, int tp_size) {
  CPFILL_RETURN_IF_ERROR(CheckRank(config, tp_rank, tp_size));
  CPFILL_ASSIGN_OR_RETURN(Checkpoint ckpt, Checkpoint::Open(dir));
  ModelWeights w = EmptyWeights(config, tp_rank, tp_size);
  for (const TensorSpec& t : ModelTensors(config)) {
    const Block b = SliceOf(t, tp_rank, tp_size);
    if (t.fp8_field != nullptr) {
      CPFILL_ASSIGN_OR_RETURN(const bool fp8, LoadFp8(ckpt, config, t, b, w));
      if (fp8) continue;
    }
    CPFILL_ASSIGN_OR_RETURN(const TensorView view, ckpt.Get(t.name, t.HfShape()));
    const int64_t elem = DTypeSize(view.dtype);
    const auto* base = static_cast<const unsigned char*>(view.data);
    std::vector<float>& out = t.In(w);
    out.resize(static_cast<size_t>(b.nrows * b.ncols));
    // Row by row out of the mapping: only this rank's pages are touched (for a column split,
    // only its part of every row).
    ParallelRows(b.nrows, [&](int64_t r) {
      const unsigned char* src = base + ((b.row0 + r) * t.cols + b.col0) * elem;
      ConvertToFloat(src, view.dtype, b.ncols, out.data() + r * b.ncols);
    });
  }
  if (config.tie_word_embeddings) TieLmHead(config, w);
  return w;
}

absl::StatusOr<ModelWeights> SyntheticWeights(const ModelConfig& config, uint64_t seed, int tp_rank,
                                              int tp_size) {
  CPFILL_RETURN_IF_ERROR(CheckRank(config, tp_rank, tp_size));
  ModelWeights w = EmptyWeights(config, tp_rank, tp_size);
  // Uniform on [-a, a] has standard deviation a / sqrt(3).
  const float matrix_scale = static_cast<float>(0.02 * std::sqrt(3.0));
  for (const TensorSpec& t : ModelTensors(config)) {
    const uint64_t stream = Mix64(Fnv1a64(t.name));
    const Block b = SliceOf(t, tp_rank, tp_size);
    if (QuantizeAtLoad(config, t)) {
      QuantizeBlock(
          t, b,
          [&](int64_t row, float* dst) {
            const uint64_t row_base = static_cast<uint64_t>(row * t.cols);
            for (int64_t c = 0; c < t.cols; ++c) {
              dst[c] = matrix_scale * UniformAt(seed, stream, row_base + static_cast<uint64_t>(c));
            }
          },
          &(w.layers[static_cast<size_t>(t.layer)].*t.fp8_field));
      continue;
    }
    std::vector<float>& out = t.In(w);
    out.resize(static_cast<size_t>(b.nrows * b.ncols));
    ParallelRows(b.nrows, [&](int64_t r) {
      // The element index is in the whole tensor, so any slice matches the whole one.
      const uint64_t row_base = static_cast<uint64_t>((b.row0 + r) * t.cols + b.col0);
      float* dst = out.data() + r * b.ncols;
      if (t.init == Init::kNorm) {
        for (int64_t c = 0; c < b.ncols; ++c) {
          dst[c] = 1.0f + 0.1f * UniformAt(seed, stream, row_base + static_cast<uint64_t>(c));
        }
      } else {
        for (int64_t c = 0; c < b.ncols; ++c) {
          dst[c] = matrix_scale * UniformAt(seed, stream, row_base + static_cast<uint64_t>(c));
        }
      }
    });
  }
  if (config.tie_word_embeddings) TieLmHead(config, w);
  return w;
}

absl::Status SaveHfCheckpoint(const ModelConfig& config, const ModelWeights& weights,
                              const std::string& dir, bool bf16) {
  CPFILL_CHECK_ARG(weights.tp_size == 1, "SaveHfCheckpoint: weights are tp rank ", weights.tp_rank,
                   " of ", weights.tp_size, "; only a whole (tp_size 1) model can be saved");
  CPFILL_RETURN_IF_ERROR(config.ValidateForTp(1));
  CPFILL_CHECK_ARG(weights.layers.size() == static_cast<size_t>(config.num_layers),
                   "SaveHfCheckpoint: weights have ", weights.layers.size(), " layers, the config ",
                   config.num_layers);
  const std::vector<TensorSpec> specs = ModelTensors(config);
  for (const TensorSpec& t : specs) {
    if (const Fp8Matrix* q = Fp8Of(t, weights)) {
      CPFILL_CHECK_ARG(q->codes.size() == static_cast<size_t>(t.rows * t.cols) &&
                           q->row_scale.size() == static_cast<size_t>(t.rows),
                       "SaveHfCheckpoint: ", t.name, " holds ", q->codes.size(), " FP8 codes and ",
                       q->row_scale.size(), " scales, expected ", ShapeString(t.HfShape()));
      continue;
    }
    CPFILL_CHECK_ARG(t.In(weights).size() == static_cast<size_t>(t.rows * t.cols),
                     "SaveHfCheckpoint: ", t.name, " holds ", t.In(weights).size(),
                     " values, expected ", ShapeString(t.HfShape()));
  }

  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) {
    return absl::ErrnoToStatus(ec.value(),
                               absl::StrCat("SaveHfCheckpoint: cannot create '", dir, "'"));
  }

  // Step 1: config.json with the keys transformers' LlamaConfig reads.
  nlohmann::ordered_json cfg = {
      {"architectures", nlohmann::ordered_json::array({"LlamaForCausalLM"})},
      {"model_type", "llama"},
      {"hidden_act", "silu"},
      {"attention_bias", false},
      {"mlp_bias", false},
      {"hidden_size", config.hidden_size},
      {"num_attention_heads", config.num_heads},
      {"num_key_value_heads", config.num_kv_heads},
      {"head_dim", config.head_dim},
      {"intermediate_size", config.intermediate_size},
      {"num_hidden_layers", config.num_layers},
      {"vocab_size", config.vocab_size},
      {"max_position_embeddings", config.max_position_embeddings},
      {"rms_norm_eps", config.rms_norm_eps},
      {"rope_theta", config.rope_theta},
      {"rope_scaling", nullptr}};
  if (config.rope_scaling.has_value()) {
    const Llama3RopeScaling& s = *config.rope_scaling;
    cfg["rope_scaling"] = {
        {"rope_type", "llama3"},
        {"factor", s.factor},
        {"low_freq_factor", s.low_freq_factor},
        {"high_freq_factor", s.high_freq_factor},
        {"original_max_position_embeddings", s.original_max_position_embeddings}};
  }
  cfg["tie_word_embeddings"] = config.tie_word_embeddings;
  if (nlohmann::ordered_json q = Fp8QuantizationConfig(config, weights, specs); !q.is_null()) {
    cfg["quantization_config"] = std::move(q);
  }
  cfg["torch_dtype"] = bf16 ? "bfloat16" : "float32";
  const std::string config_path = (std::filesystem::path(dir) / "config.json").string();
  if (absl::Status s = json::WriteFile(config_path, cfg); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat("SaveHfCheckpoint: ", s.message()));
  }

  // Step 2: model.safetensors. bf16 copies live until Write returns.
  SafetensorsWriter writer;
  writer.SetMetadata("format", "pt");
  std::vector<std::vector<uint16_t>> bf16_copies;
  bf16_copies.reserve(specs.size());
  for (const TensorSpec& t : specs) {
    if (const Fp8Matrix* q = Fp8Of(t, weights)) {
      CPFILL_RETURN_IF_ERROR(writer.Add(t.name, DType::kF8E4M3, t.HfShape(), q->codes.data()));
      CPFILL_RETURN_IF_ERROR(
          writer.Add(t.Module() + ".weight_scale", DType::kF32, {t.rows, 1}, q->row_scale.data()));
      continue;
    }
    if (bf16) {
      bf16_copies.push_back(ToBfloat16(t.In(weights)));
      CPFILL_RETURN_IF_ERROR(
          writer.Add(t.name, DType::kBF16, t.HfShape(), bf16_copies.back().data()));
    } else {
      CPFILL_RETURN_IF_ERROR(writer.Add(t.name, DType::kF32, t.HfShape(), t.In(weights).data()));
    }
  }
  return writer.Write((std::filesystem::path(dir) / "model.safetensors").string());
}

}  // namespace cpfill::runtime
