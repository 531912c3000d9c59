// cpfill/parallel/sparq_cp.h — SparQ decode attention (attention/sparq/sparq.h) over a CP group
// whose ranks each hold a shard of every sequence's KV (the 2N-chunk sharding: rank i holds
// chunks i and 2N-1-i), with every rank seeing each sequence's query (as pass-Q decode does).
//
// Two selections:
//   kGlobalTopK  equal to one-rank SparQ: the same k positions, output within fp32 rounding.
//   kLocalTopK   each rank keeps its own top ceil(k/N) by its local softmax; no exchange before
//                the attention, only a larger final merge. Not SparQ's selection; its own
//                definition is checked (tests/sparq_cp_mpi_test.cc).
// Exchange of kGlobalTopK, per layer, with B sequences, H_kv KV heads, G = group size (every
// exchange an AllGather on the CP communicator; sizes sent per rank):
//   step 1: per head, the local approximate softmax normaliser (max, sum): B*H_kv*G*8 bytes.
//           Needed because the ranking key sum_g s_hat_gj depends on each head's GLOBAL
//           normaliser when G > 1: a local top-k by local normalisers could miss global winners.
//   step 2: the local top-k candidates (position int32, key fp32), padded to k: B*H_kv*k*8 bytes.
//           The global top-k is in their union (no rank holds more than k winners); every rank
//           selects it from the same data in the same total order, so all agree.
//   step 3: each rank attends to its own selected rows; the partial records (sparq_cpu.h's
//           PartialLayout: O and LSE per head, alpha's numerator and denominator, V sum and
//           count): B*H_kv*(G*(d+4)+d+2)*4 bytes, merged by LSE (App. B), alpha and v_bar by
//           normalisers and counts. Pass-Q decode sends its partial O/LSE anyway; this adds
//           B*H_kv*(3G+d+2)*4 bytes to it.
// Llama-3-8B per sequence and layer (32:8, d 128, k 128): 256 B + 8 KiB + 21 KiB.
// kLocalTopK runs step 3 only.
//
//   CPFILL_RETURN_IF_ERROR(SparqAttentionCp(cp_comm, shard_batch, SparqCpSelection::kGlobalTopK,
//                                           o.data(), &selection, &pool));
#pragma once

#include "absl/status/status.h"
#include "attention/sparq/sparq_cpu.h"
#include "base/thread_pool.h"
#include "parallel/communicator.h"

namespace cpfill::parallel {

enum class SparqCpSelection { kGlobalTopK, kLocalTopK };

// `b`: this rank's rows of each sequence, k_pos their global positions and seq_len the global
// lengths (set even on one rank); every rank passes the same sequences, shape and config.
// o [num_seqs, num_heads, head_dim]: the merged output, identical on every rank. `selection`
// (optional): every position attended, over all ranks, ascending (kLocalTopK gathers it in one
// more exchange, for reporting).
absl::Status SparqAttentionCp(Communicator& cp, const attention::sparq::SparqBatch& b,
                              SparqCpSelection mode, float* o,
                              attention::sparq::SparqSelection* selection, ThreadPool* pool);

}  // namespace cpfill::parallel
