#include "benchmarks/harness.h"

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <fstream>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "gflags/gflags.h"
#include "rpc/rendezvous/launch.h"

namespace ddprpc::benchmarks {
namespace {

// Where the ranks of run_roles put their result.
constexpr char kResultFileEnv[] = "DDPRPC_BENCHMARK_RESULT_FILE";

const char* result_path() {
  const char* path = std::getenv(kResultFileEnv);
  return path != nullptr && *path ? path : nullptr;
}

// Writes `text` to the result file whole or not at all (a rank stopped
// mid-write leaves no half document).
bool write_text(const std::string& text, std::string* error) {
  const char* path = result_path();
  if (path == nullptr) {
    if (error != nullptr) *error = "not a rank started by run_roles";
    return false;
  }
  const std::string partial = absl::StrCat(path, ".partial");
  {
    std::ofstream out(partial, std::ios::trunc);
    out << text << "\n";
    if (!out.flush()) {
      if (error != nullptr) *error = absl::StrCat("cannot write ", partial);
      return false;
    }
  }
  if (std::rename(partial.c_str(), path) != 0) {
    if (error != nullptr) *error = absl::StrCat("cannot rename ", partial, " to ", path);
    std::remove(partial.c_str());
    return false;
  }
  return true;
}

// Where forked ranks start (run_main).
int (*g_rank_main)(int, char**) = nullptr;

// The launch of `options`' ranks: how many, where, and for how long.
rpc::LaunchOptions placed(const RolesOptions& options) {
  rpc::LaunchOptions launch;
  launch.nprocs = options.nprocs;
  launch.master_addr = options.master_addr;
  launch.master_port = options.master_port;
  launch.timeout = options.timeout;
  launch.grace_period = options.grace_period;
  launch.network_namespaces = options.network_namespaces;
  return launch;
}

}  // namespace

int run_main(int argc, char** argv, int (*rank_main)(int argc, char** argv)) {
  g_rank_main = rank_main;
  return rank_main(argc, argv);
}

RolesResult run_roles(int argc, char** argv, const RolesOptions& options) {
  static std::atomic<int> runs{0};
  const std::string path =
      temp_path(absl::StrCat("ddprpc_result.", runs.fetch_add(1))) + ".json";
  std::remove(path.c_str());
  // This binary again, with its arguments and then the options' ones.
  rpc::LaunchOptions launch = placed(options);
  launch.argv = {self_exe()};
  for (int i = 1; i < argc; ++i) launch.argv.push_back(argv[i]);
  launch.argv.insert(launch.argv.end(), options.args.begin(), options.args.end());
  // The ranks' stderr is a pipe to the launcher: tell them what it shows.
  launch.env.push_back(progress_terminal_env());
  launch.env.insert(launch.env.end(), options.env.begin(), options.env.end());
  launch.env.emplace_back(kResultFileEnv, path);
  if (int (*entry)(int, char**) = options.entry ? options.entry : g_rank_main) {
    launch.entry = [entry](const std::vector<std::string>& args) {
      // As in a new process: every flag at its default before parsing.
      std::vector<gflags::CommandLineFlagInfo> flags;
      gflags::GetAllFlags(&flags);
      for (const auto& f : flags) {
        if (!f.is_default) gflags::SetCommandLineOption(f.name.c_str(), f.default_value.c_str());
      }
      std::vector<std::string> owned = args;
      std::vector<char*> argv;
      for (auto& a : owned) argv.push_back(a.data());
      argv.push_back(nullptr);
      return entry(static_cast<int>(owned.size()), argv.data());
    };
  }
  const rpc::LaunchResult launched = rpc::launch(launch);

  RolesResult out;
  out.exit_code = launched.exit_code;
  out.timed_out = launched.timed_out;
  out.failed_rank = launched.failed_rank;
  out.message = launched.message;
  out.result.set_null_value(google::protobuf::NULL_VALUE);
  std::ifstream in(path);
  if (!in) {
    out.result_error = "no rank wrote a result";
  } else {
    const std::string text = read_file(path);
    std::string why;
    if (parse_json(text, &out.result, &why)) {
      out.has_result = true;
    } else {
      out.result.set_null_value(google::protobuf::NULL_VALUE);
      out.result_error = absl::StrCat("the result is not JSON (", why, ")");
    }
  }
  std::remove(path.c_str());
  std::remove(absl::StrCat(path, ".partial").c_str());
  return out;
}

bool started_by_run_roles() { return result_path() != nullptr; }

bool write_result(const JsonValue& result, std::string* error) {
  return write_text(to_json(result), error);
}

bool write_result(const Json& result, std::string* error) { return write_text(result.str(), error); }

ReferenceRun run_reference_ranks(const std::string& script, const std::vector<std::string>& args,
                                 const RolesOptions& options, const std::string& report_flag) {
  static std::atomic<int> runs{0};
  const std::string path =
      temp_path(absl::StrCat("pytorch_ranks_report.", runs.fetch_add(1))) + ".json";
  std::remove(path.c_str());
  rpc::LaunchOptions launch = placed(options);
  launch.argv = {reference_python(), script};
  launch.argv.insert(launch.argv.end(), args.begin(), args.end());
  if (!report_flag.empty()) launch.argv.push_back(report_flag);
  launch.argv.push_back(path);
  launch.env = options.env;
  // execv takes a path: find the interpreter on PATH as a shell would.
  if (launch.argv[0].find('/') == std::string::npos) {
    std::string found;
    if (run_command({"sh", "-c", "command -v \"$0\"", launch.argv[0]}, &found) == 0) {
      launch.argv[0] = std::string(absl::StripAsciiWhitespace(found));
    }
  }
  ReferenceRun run;
  launch.output = &run.output;
  run.exit_code = rpc::launch(launch).exit_code;
  take_report(path, &run);
  return run;
}

}  // namespace ddprpc::benchmarks
