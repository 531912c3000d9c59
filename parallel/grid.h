// cpfill/parallel/grid.h — the process grid: TP groups inside a node, CP rings across nodes.
//
//   world = nodes x ranks_per_node        one rank = one GPU (or one CPU process)
//   TP group = tp consecutive ranks of one node (tp divides ranks_per_node)
//   CP group = the ranks with the same tp_rank on every TP group: one ring per TP rank, all
//              running at once (the paper's "8-way SendRecv")
//
// A node is a set of ranks sharing memory (MPI_Comm_split_type SHARED). --ranks-per-node R (or
// CPFILL_RANKS_PER_NODE) cuts each host into emulated nodes of R ranks, so CP across "nodes" is
// testable on one machine.
//
//   CPFILL_ASSIGN_OR_RETURN(ProcessGrid grid, CreateProcessGrid(*mpi, {.tp = 2}));
//   grid.cp->StartRingExchange(...);   // this rank's CP ring
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "parallel/communicator.h"
#include "parallel/mpi_communicator.h"

namespace cpfill::parallel {

struct GridOptions {
  int tp = 1;              // TP group size; must divide the ranks per node
  int ranks_per_node = 0;  // 0: CPFILL_RANKS_PER_NODE if set, else the shared-memory host size
};

struct ProcessGrid {
  int world_rank = 0, world_size = 1;
  int node = 0, num_nodes = 1;  // emulated or real
  int local_rank = 0, ranks_per_node = 1;
  int host_rank = 0;  // rank among the processes of this host (real, not emulated): picks the GPU
  int tp_rank = 0, tp_size = 1;
  int cp_rank = 0, cp_size = 1;
  std::unique_ptr<Communicator> world, node_comm, tp, cp;

  std::string Describe() const;  // "world 4 = 2 nodes x 2 ranks; TP2 x CP2; this: ..."
};

// Collective over the world. InvalidArgument, the same on every rank, when tp does not divide
// the ranks per node, R does not divide the host's ranks, or hosts differ in rank count.
absl::StatusOr<ProcessGrid> CreateProcessGrid(MpiRuntime& mpi, GridOptions options);

}  // namespace cpfill::parallel
