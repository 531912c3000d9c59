// cpfill/runtime/model/weights.h — one rank's share of a Llama model's weights, in fp32 host
// memory.
//
// Tensor parallelism over `tp` ranks as Megatron splits a Llama layer: q/k/v/gate/up projections
// column-parallel (each rank the rows of W[out, in] for its heads / its part of the intermediate
// size), o/down projections row-parallel (each rank the columns that meet its heads /
// intermediate part), norms replicated, embedding replicated, LM head split over the vocab.
// Weights come from Hugging Face safetensors (one file or shards with
// model.safetensors.index.json; bf16, fp16 or fp32; HF tensor names), where each rank reads only
// its slice, or are synthetic: seeded, deterministic per (tensor, element), so every rank's slice
// matches the whole tensor a single-rank reference makes.
//
//   CPFILL_ASSIGN_OR_RETURN(ModelWeights w, LoadWeights(config, "/models/llama3", tp_rank, tp));
//   CPFILL_ASSIGN_OR_RETURN(ModelWeights w, SyntheticWeights(config, /*seed=*/1, tp_rank, tp));
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "runtime/model/fp8.h"
#include "runtime/model/model_config.h"

namespace cpfill::runtime {

// Row-major fp32. Shapes use this rank's sizes: hq = num_heads / tp, hkv = num_kv_heads / tp,
// I = intermediate_size / tp, V = vocab_size / tp, hd = head_dim, D = hidden_size.
struct LayerWeights {
  std::vector<float> input_norm;  // [D]                 input_layernorm.weight
  std::vector<float> wq;          // [hq * hd, D]        self_attn.q_proj.weight rows
  std::vector<float> wk;          // [hkv * hd, D]       self_attn.k_proj.weight rows
  std::vector<float> wv;          // [hkv * hd, D]       self_attn.v_proj.weight rows
  std::vector<float> wo;          // [D, hq * hd]        self_attn.o_proj.weight columns
  std::vector<float> post_norm;   // [D]                 post_attention_layernorm.weight
  std::vector<float> w_gate;      // [I, D]              mlp.gate_proj.weight rows
  std::vector<float> w_up;        // [I, D]              mlp.up_proj.weight rows
  std::vector<float> w_down;      // [D, I]              mlp.down_proj.weight columns
  // Row-wise FP8 twins of the projections (fp8.h), same shapes and slices: filled, and the fp32
  // matrix left empty, when the checkpoint stores the projection as F8_E4M3 with a weight_scale
  // or config.fp8 quantizes it at load. A column (row-parallel) slice keeps its whole row's scale.
  Fp8Matrix wq_fp8, wk_fp8, wv_fp8, wo_fp8, w_gate_fp8, w_up_fp8, w_down_fp8;
};

struct ModelWeights {
  int tp_rank = 0, tp_size = 1;
  std::vector<float> embedding;      // [vocab, D]          model.embed_tokens.weight (whole)
  std::vector<LayerWeights> layers;  // config.num_layers of them
  std::vector<float> final_norm;     // [D]                 model.norm.weight
  std::vector<float> lm_head;        // [V, D]              lm_head.weight rows (or the
                                     //                     embedding's, when tied)
};

// Reads `dir`'s safetensors (model.safetensors, or the shards model.safetensors.index.json
// names), only this rank's slices. Errors name the file and the tensor: NotFound for a missing
// file or tensor; InvalidArgument for a corrupt file, a header that lies about offsets, a dtype
// that is not a float, or a shape that does not match the config.
absl::StatusOr<ModelWeights> LoadWeights(const ModelConfig& config, const std::string& dir,
                                         int tp_rank, int tp_size);

// Both quantize the projections config.fp8 selects (not those a checkpoint stores in fp32/bf16
// when its own quantization_config is the source: there the tensors' dtypes decide).
// Seeded synthetic weights with the scale of a trained model (uniform, std 0.02 for matrices;
// norms near 1), deterministic per (seed, tensor name, element of the whole tensor).
absl::StatusOr<ModelWeights> SyntheticWeights(const ModelConfig& config, uint64_t seed, int tp_rank,
                                              int tp_size);

// Writes `weights` (which must be a tp_size == 1 set) as a Hugging Face checkpoint: config.json
// and model.safetensors with HF names, fp32 or bf16. For tests and for handing synthetic
// models to other tools. FP8 projections are written as fbgemm_fp8 checkpoints are (F8_E4M3
// weight, F32 weight_scale [out, 1], quantization_config naming the modules left unconverted).
absl::Status SaveHfCheckpoint(const ModelConfig& config, const ModelWeights& weights,
                              const std::string& dir, bool bf16);

}  // namespace cpfill::runtime
