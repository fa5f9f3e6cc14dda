// launch: runs N local processes of one program, like torchrun --standalone.
//   bazel run //rpc:launch -- --nprocs=4 -- /path/to/binary --flag=value
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "absl/strings/numbers.h"
#include "rpc/rendezvous/launch.h"

namespace {

void usage() {
  std::fprintf(stderr,
               "usage: launch --nprocs=N [--master_port=P] [--timeout_s=S] -- PROGRAM [ARGS...]\n"
               "  Runs N copies of PROGRAM with RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR=127.0.0.1\n"
               "  and MASTER_PORT set; prefixes their output with [rank N]; if one fails, stops\n"
               "  the others and exits with its code.\n"
               "  --nprocs       number of processes (default 1)\n"
               "  --master_port  rendezvous port (default: a free port)\n"
               "  --timeout_s    stop everything after S seconds (default: no limit)\n");
}

}  // namespace

int main(int argc, char** argv) {
  ddprpc::rpc::LaunchOptions options;
  int i = 1;
  for (; i < argc; ++i) {
    std::string arg = argv[i];
    auto value = [&](const char* flag) -> const char* {
      size_t n = std::strlen(flag);
      return arg.compare(0, n, flag) == 0 ? argv[i] + n : nullptr;
    };
    double seconds = 0;
    if (arg == "--") {
      ++i;
      break;
    } else if (arg == "--help" || arg == "-h") {
      usage();
      return 0;
    } else if (const char* v = value("--nprocs=")) {
      if (!absl::SimpleAtoi(v, &options.nprocs)) return usage(), 2;
    } else if (const char* v = value("--master_port=")) {
      if (!absl::SimpleAtoi(v, &options.master_port)) return usage(), 2;
    } else if (const char* v = value("--timeout_s=")) {
      if (!absl::SimpleAtod(v, &seconds)) return usage(), 2;
      options.timeout = absl::Seconds(seconds);
    } else {
      break;
    }
  }
  for (; i < argc; ++i) options.argv.push_back(argv[i]);
  if (options.argv.empty()) {
    usage();
    return 2;
  }
  return ddprpc::rpc::launch(options).exit_code;
}
