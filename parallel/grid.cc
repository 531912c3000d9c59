#include "parallel/grid.h"

#include <vector>

#include "absl/strings/str_cat.h"
#include "base/knobs.h"
#include "base/status.h"

namespace cpfill::parallel {

std::string ProcessGrid::Describe() const {
  return absl::StrCat("world ", world_size, " = ", num_nodes, " node(s) x ", ranks_per_node,
                      " rank(s); TP", tp_size, " x CP", cp_size, " (", tp_size, " CP ring(s) of ",
                      cp_size, " rank(s), one per TP rank)");
}

absl::StatusOr<ProcessGrid> CreateProcessGrid(MpiRuntime& mpi, GridOptions options) {
  ProcessGrid g;
  g.world = mpi.World();
  g.world_rank = g.world->rank();
  g.world_size = g.world->size();

  // Step 0: everyone is alive (a barrier with a deadline before any blocking split).
  CPFILL_RETURN_IF_ERROR(g.world->Barrier());

  // Step 1: the hosts. Every host must hold the same number of ranks.
  CPFILL_ASSIGN_OR_RETURN(std::unique_ptr<Communicator> host, mpi.SplitShared(*g.world, "host"));
  int64_t host_size[2] = {host->size(), -host->size()};
  CPFILL_RETURN_IF_ERROR(g.world->AllReduce(host_size, 2, DataType::kInt64, ReduceOp::kMax));
  CPFILL_CHECK_ARG(host_size[0] == -host_size[1], "hosts hold different numbers of ranks (",
                   -host_size[1], " to ", host_size[0], "); launch the same count per host");
  const int host_ranks = static_cast<int>(host_size[0]);

  // Step 2: emulated nodes of R ranks inside each host.
  int r = options.ranks_per_node;
  // A malformed CPFILL_RANKS_PER_NODE is refused at start-up (knobs::Validate in launch).
  if (r == 0) r = static_cast<int>(knobs::Int(knobs::kRanksPerNode));
  if (r == 0) r = host_ranks;
  CPFILL_CHECK_ARG(r > 0 && host_ranks % r == 0, "--ranks-per-node ", r, " does not divide the ",
                   host_ranks, " ranks on each host");
  CPFILL_CHECK_ARG(options.tp >= 1 && r % options.tp == 0, "--tp ", options.tp,
                   " does not divide the ", r,
                   " ranks per node; a TP group must sit inside one "
                   "node");
  // Hosts are numbered by their lowest world rank; nodes by (host, host_rank / R).
  int64_t host_leader = g.world_rank;
  CPFILL_RETURN_IF_ERROR(host->AllReduce(&host_leader, 1, DataType::kInt64, ReduceOp::kMin));
  const int host_rank = host->rank();
  g.host_rank = host_rank;
  const int node_color = static_cast<int>(host_leader) * (host_ranks / r) + host_rank / r;
  CPFILL_ASSIGN_OR_RETURN(g.node_comm, mpi.Split(*g.world, node_color, g.world_rank, "node"));
  g.local_rank = g.node_comm->rank();
  g.ranks_per_node = r;
  g.num_nodes = g.world_size / r;

  // Step 3: TP groups (tp consecutive local ranks) and CP rings (same tp_rank everywhere).
  g.tp_size = options.tp;
  g.tp_rank = g.local_rank % g.tp_size;
  const int tp_color = node_color * (r / g.tp_size) + g.local_rank / g.tp_size;
  CPFILL_ASSIGN_OR_RETURN(g.tp, mpi.Split(*g.world, tp_color, g.world_rank, "tp"));
  CPFILL_ASSIGN_OR_RETURN(g.cp, mpi.Split(*g.world, g.tp_rank, g.world_rank, "cp"));
  g.cp_rank = g.cp->rank();
  g.cp_size = g.cp->size();
  // Node numbers in CP order, so node 0 holds cp_rank 0.
  int64_t min_world_in_node = g.world_rank;
  CPFILL_RETURN_IF_ERROR(
      g.node_comm->AllReduce(&min_world_in_node, 1, DataType::kInt64, ReduceOp::kMin));
  g.node = static_cast<int>(min_world_in_node) / r;
  CPFILL_CHECK_INTERNAL(g.tp->size() == g.tp_size && g.cp_size * g.tp_size == g.world_size,
                        "grid sizes: tp ", g.tp->size(), " cp ", g.cp_size);
  return g;
}

}  // namespace cpfill::parallel
