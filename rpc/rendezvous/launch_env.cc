#include "rpc/rendezvous/launch_env.h"

#include <cstdlib>
#include <stdexcept>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace ddprpc::rpc {
namespace {

const char* get(const char* name) {
  const char* v = std::getenv(name);
  return v && *v ? v : nullptr;
}

// The integer variable `name`, or `fallback` when unset.
int get_int(const char* name, int fallback) {
  const char* v = get(name);
  if (!v) return fallback;
  int out;
  if (!absl::SimpleAtoi(v, &out) || out < 0) {
    throw std::invalid_argument(absl::StrCat(name, "='", v, "' is not a non-negative integer"));
  }
  return out;
}

}  // namespace

std::string first_slurm_host(const std::string& nodelist) {
  // The first entry ends at a comma outside brackets.
  size_t end = 0;
  int depth = 0;
  for (; end < nodelist.size(); ++end) {
    const char c = nodelist[end];
    if (c == '[') ++depth;
    if (c == ']') --depth;
    if (c == ',' && depth == 0) break;
  }
  const std::string first = nodelist.substr(0, end);
  const size_t open = first.find('[');
  if (open == std::string::npos) return first;
  // prefix[a-b,c]suffix -> prefix + a + suffix (a keeps its leading zeros).
  const size_t close = first.find(']', open);
  if (close == std::string::npos) {
    throw std::invalid_argument("malformed Slurm host list '" + nodelist + "'");
  }
  const std::string range = first.substr(open + 1, close - open - 1);
  const size_t stop = range.find_first_of("-,");
  return first.substr(0, open) + range.substr(0, stop) + first.substr(close + 1);
}

LaunchEnv launch_env() {
  LaunchEnv env;
  const bool torchrun = get("RANK") != nullptr;
  // srun sets SLURM_STEP_NUM_TASKS for the tasks of a step; a batch script
  // (SLURM_PROCID=0, not started by srun) is not a rank.
  const bool slurm = !torchrun && get("SLURM_PROCID") && get("SLURM_STEP_NUM_TASKS");
  if (torchrun) {
    env.source = "torchrun";
    env.rank = get_int("RANK", -1);
    env.world_size = get_int("WORLD_SIZE", -1);
    env.local_rank = get_int("LOCAL_RANK", -1);
  } else if (slurm) {
    env.source = "slurm";
    env.rank = get_int("SLURM_PROCID", -1);
    env.world_size = get_int("SLURM_NTASKS", get_int("SLURM_STEP_NUM_TASKS", -1));
    env.local_rank = get_int("SLURM_LOCALID", -1);
  }
  if (const char* addr = get("MASTER_ADDR")) {
    env.master_addr = addr;
  } else if (slurm) {
    const char* nodes = get("SLURM_STEP_NODELIST");
    if (!nodes) nodes = get("SLURM_JOB_NODELIST");
    if (nodes) env.master_addr = first_slurm_host(nodes);
  }
  env.master_port = get_int("MASTER_PORT", 0);
  if (env.master_port > 65535) {
    throw std::invalid_argument(absl::StrCat("MASTER_PORT=", env.master_port, " is not a port"));
  }
  if (env.master_port == 0 && slurm) {
    const char* job = get("SLURM_JOB_ID");
    long long id = 0;
    if (job && absl::SimpleAtoi(job, &id) && id >= 0) {
      env.master_port = static_cast<int>(20000 + id % 20000);
    }
  }
  return env;
}

}  // namespace ddprpc::rpc
