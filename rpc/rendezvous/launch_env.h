// What a launcher told this process about its place in the job, read from
// the environment: torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK,
// MASTER_ADDR, MASTER_PORT; also what rpc::launch sets), else those of a
// Slurm task started by srun (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, the
// first host of SLURM_STEP_NODELIST or SLURM_JOB_NODELIST). Slurm names no
// port: MASTER_PORT if set, else one derived from SLURM_JOB_ID (the same on
// every task of the job). Each variable is taken on its own, so a Slurm job
// may set MASTER_PORT alone. Values that are present but malformed throw
// std::invalid_argument naming the variable.
#pragma once

#include <string>

namespace ddprpc::rpc {

struct LaunchEnv {
  int rank = -1;        // -1: none given
  int world_size = -1;  // -1: none given
  int local_rank = -1;
  std::string master_addr;  // "": none given
  int master_port = 0;      // 0: none given
  std::string source;       // "torchrun", "slurm" or "" (nothing found)
};

LaunchEnv launch_env();

// The first host of a Slurm host list: "node[07-09,12],gpu1" -> "node07".
std::string first_slurm_host(const std::string& nodelist);

}  // namespace ddprpc::rpc
