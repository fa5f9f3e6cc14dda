#include "benchmarks/common.h"

#include <google/protobuf/util/json_util.h>

#include <dlfcn.h>
#include <gflags/gflags.h>
#include <malloc.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "ddprpc_libtorch_info.h"
#include "rpc/rpc.h"
#include "rpc/core/security.h"

DEFINE_string(python, "",
              "the Python that runs PyTorch's side (default: the one whose libtorch this build "
              "uses, ./bazelw's .venv)");
DEFINE_string(auth_token_file, "",
              "file holding the job's secret, the same for every rank (or DDPRPC_AUTH_TOKEN, "
              "DDPRPC_AUTH_TOKEN_FILE); when this binary starts every rank itself, it makes one");
DEFINE_string(tls_cert, "",
              "this host's TLS certificate (PEM; with --tls_key and --tls_ca every connection of "
              "the job is mutual TLS; or DDPRPC_TLS_CERT; see tools/make_certs.sh)");
DEFINE_string(tls_key, "", "the private key of --tls_cert (or DDPRPC_TLS_KEY)");
DEFINE_string(tls_ca, "", "the CA that signed every rank's certificate (or DDPRPC_TLS_CA)");
DEFINE_bool(sched_batch, true,
            "run the runtime's threads as SCHED_BATCH (RpcBackendOptions::batch_scheduling; the "
            "library's default is off)");
DEFINE_int32(spin_us, 50,
             "microseconds a wait for a peer's message may spin before it sleeps (same-host "
             "transport, gRPC streams, same-host allreduce), 0..10000 (RpcBackendOptions::max_spin, "
             "ProcessGroupOptions::max_spin; the library's default is 0)");
DEFINE_bool(same_host_transport, true,
            "reach peers on this host through the same-host transport (false: gRPC for every "
            "peer, the path of workers on other hosts)");
DEFINE_uint64(bulk_min_bytes, 256 << 10,
              "tensors at least this large between hosts leave gRPC for the bulk path, pulled "
              "over --bulk_streams TCP connections (RpcBackendOptions::bulk_min_bytes; 0: off)");
DEFINE_int32(bulk_streams, 3, "connections a bulk pull or push is spread over (1..16)");
DEFINE_bool(bulk_push, true,
            "senders with --bulk_push_min_cpus CPUs or more start pushing bulk tensors as they "
            "lend them, the receiver pulling what does not come (RpcBackendOptions::bulk_push; "
            "false: every bulk tensor is pulled)");
DEFINE_int32(bulk_push_min_cpus, 4,
             "CPUs a sender needs to push (RpcBackendOptions::bulk_push_min_cpus; 0: always)");
DEFINE_int64(bulk_receive_cache_mb, 128,
             "MiB of idle buffers kept resident for pulled tensors "
             "(RpcBackendOptions::bulk_receive_cache_bytes; 0: the CPU allocator's memory)");
DEFINE_bool(same_host_allreduce, true,
            "let Gloo groups on one host reduce through shared memory and cross-process reads "
            "(false: Gloo's TCP algorithms)");
DEFINE_bool(tcp_ring, true,
            "between hosts, run Gloo groups' allreduces from 256 KiB as a streaming ring over "
            "TCP connections of the group's own (ProcessGroupOptions::tcp_ring; false: "
            "halving-doubling up to 1 MiB, Gloo's ring above)");
DEFINE_int32(tcp_ring_streams, 0,
             "rings a TCP ring allreduce is striped over (ProcessGroupOptions::tcp_ring_streams; "
             "0: 3 where a process may use 8 CPUs or more, else 1; at most 8)");
DEFINE_bool(mutex_deadlock_detection, false,
            "keep abseil's mutex deadlock detection (Debian's abseil has it on; it costs ~5% "
            "of ddp_rpc's CPU)");
DEFINE_string(capture_frames, "",
              "write every frame a worker reads into this directory (fuzzer seeds)");
DEFINE_bool(allow_insecure, false,
            "let a rank started on its own listen on an address other than loopback with "
            "neither a token nor TLS (anyone who reaches its ports can then call it)");

namespace ddprpc::benchmarks {

void parse_flags(int* argc, char*** argv, const char* flag_file_filter) {
  // gRPC's fastest settings for the transport (rpc.h), before anything here
  // uses gRPC; the ranks this process starts inherit them. Values already in
  // the environment win.
  for (const auto& s : rpc::kLowLatencyGrpcEnvironment) ::setenv(s.name, s.value, /*overwrite=*/0);
  gflags::ParseCommandLineNonHelpFlags(argc, argv, /*remove_flags=*/false);
  if (!FLAGS_mutex_deadlock_detection) {
    absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  }
  std::string help;
  if (gflags::GetCommandLineOption("help", &help) && help == "true") {
    // This binary's own flags and the shared ones (common.cc).
    (void)flag_file_filter;
    gflags::ShowUsageWithFlagsRestrict((*argv)[0], "benchmarks/");
    std::exit(0);
  }
  gflags::HandleCommandLineHelpFlags();
  // Every part of the runtime (agent, stores, process groups) reads the
  // job's security from the environment (rpc/security.h), as do the ranks
  // this process starts.
  auto set = [](const char* name, const std::string& value) {
    if (!value.empty()) ::setenv(name, value.c_str(), 1);
  };
  set(rpc::kAuthTokenFileEnv, FLAGS_auth_token_file);
  set(rpc::kTlsCertEnv, FLAGS_tls_cert);
  set(rpc::kTlsKeyEnv, FLAGS_tls_key);
  set(rpc::kTlsCaEnv, FLAGS_tls_ca);
}

bool allow_insecure() { return FLAGS_allow_insecure; }

rpc::RpcBackendOptions backend_options() {
  rpc::RpcBackendOptions options;
  options.batch_scheduling = FLAGS_sched_batch;
  options.max_spin = absl::Microseconds(FLAGS_spin_us);
  options.same_host_transport = FLAGS_same_host_transport;
  options.bulk_min_bytes = FLAGS_bulk_min_bytes;
  options.bulk_streams = std::clamp(FLAGS_bulk_streams, 1, 16);
  options.bulk_push = FLAGS_bulk_push;
  options.bulk_push_min_cpus = std::max(0, FLAGS_bulk_push_min_cpus);
  options.bulk_receive_cache_bytes = std::max<int64_t>(0, FLAGS_bulk_receive_cache_mb) << 20;
  options.capture_frames_dir = FLAGS_capture_frames;
  options.allow_insecure = FLAGS_allow_insecure;
  return options;
}

ddp::ProcessGroupOptions group_options() {
  ddp::ProcessGroupOptions options;
  options.same_host_allreduce = FLAGS_same_host_allreduce;
  options.max_spin = absl::Microseconds(FLAGS_spin_us);
  options.tcp_ring = FLAGS_tcp_ring;
  options.tcp_ring_streams = std::clamp(FLAGS_tcp_ring_streams, 0, 8);
  return options;
}

namespace {
// A gRPC setting from the environment, "(gRPC's default)" if none.
std::string grpc_setting(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? v : "(gRPC's default)";
}
}  // namespace

std::string runtime_settings() {
  return absl::StrCat(
      "runtime: threads ", FLAGS_sched_batch ? "SCHED_BATCH" : "as started", ", spin ",
      FLAGS_spin_us, " us, same-host transport ", FLAGS_same_host_transport ? "on" : "off",
      ", bulk path ",
      FLAGS_bulk_min_bytes > 0
          ? absl::StrCat("from ", FLAGS_bulk_min_bytes >> 10, " KiB over ",
                         std::clamp(FLAGS_bulk_streams, 1, 16), " connections, ",
                         FLAGS_bulk_push ? absl::StrCat("pushed from ", FLAGS_bulk_push_min_cpus,
                                                        " CPUs (else pulled)")
                                         : std::string("pulled"))
          : std::string("off"),
      ", same-host allreduce ", FLAGS_same_host_allreduce ? "on" : "off", ", TCP ring ",
      FLAGS_tcp_ring ? (FLAGS_tcp_ring_streams > 0
                            ? absl::StrCat("on, ", FLAGS_tcp_ring_streams, " ring(s)")
                            : std::string("on, 3 rings from 8 CPUs (else 1)"))
                     : std::string("off"),
      ", gRPC poll engine '", grpc_setting("GRPC_POLL_STRATEGY"), "', gRPC experiments '",
      grpc_setting("GRPC_EXPERIMENTS"), "', abseil deadlock detection ",
      FLAGS_mutex_deadlock_detection ? "on" : "off");
}

int env_rank() {
  const char* r = std::getenv("RANK");
  return r ? std::atoi(r) : -1;
}

void keep_freed_memory() {
  mallopt(M_MMAP_THRESHOLD, 32 << 20);  // the largest glibc accepts
  mallopt(M_TRIM_THRESHOLD, INT_MAX);
  mallopt(M_TOP_PAD, 64 << 20);
}

int cpu_count() { return static_cast<int>(std::thread::hardware_concurrency()); }

std::string reference_python() {
  if (!FLAGS_python.empty()) return FLAGS_python;
  if (ddprpc_build::kPython[0] != '\0') return ddprpc_build::kPython;
  return "python3";
}

std::string libtorch_version() {
  return absl::StrCat("libtorch ", ddprpc_build::kLibtorchVersion,
                      ddprpc_build::kLibtorchCuda ? " (CUDA)" : " (CPU)");
}

std::string pytorch_version() {
  static const std::string* version = [] {
    std::string out;
    const int rc = run_command(
        {reference_python(), "-W", "ignore", "-c", "import torch; print(torch.__version__)"}, &out);
    while (!out.empty() && (out.back() == '\n' || out.back() == ' ')) out.pop_back();
    const size_t nl = out.rfind('\n');
    if (nl != std::string::npos) out = out.substr(nl + 1);
    return new std::string(rc == 0 && !out.empty() ? out : "none");
  }();
  return *version;
}

std::string versions() {
  return absl::StrCat(libtorch_version(), "; PyTorch's side: torch ", pytorch_version(), " (",
                      reference_python(), "); ", runtime_settings());
}

std::string allocator_name() {
  // gperftools' tc_version(&major, &minor, &patch), looked up so that a
  // binary without tcmalloc links and says so.
  using TcVersion = const char* (*)(int*, int*, const char**);
  auto tc_version = reinterpret_cast<TcVersion>(dlsym(RTLD_DEFAULT, "tc_version"));
  if (tc_version == nullptr) return "glibc malloc";
  int major = 0;
  int minor = 0;
  const char* patch = nullptr;
  tc_version(&major, &minor, &patch);
  return absl::StrFormat("tcmalloc %d.%d%s", major, minor, patch != nullptr ? patch : "");
}

double percentile(std::vector<double> samples, double p) {
  if (samples.empty()) return 0;
  std::sort(samples.begin(), samples.end());
  const double pos = std::clamp(p, 0.0, 1.0) * static_cast<double>(samples.size() - 1);
  const size_t lo = static_cast<size_t>(pos);
  const size_t hi = std::min(lo + 1, samples.size() - 1);
  return samples[lo] + (samples[hi] - samples[lo]) * (pos - static_cast<double>(lo));
}

std::string self_exe() {
  char buf[4096];
  ssize_t n = ::readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  return n > 0 ? std::string(buf, n) : std::string();
}

namespace {

constexpr char kProgressTerminalEnv[] = "DDPRPC_PROGRESS_TTY";

bool progress_on_terminal() {
  const char* inherited = std::getenv(kProgressTerminalEnv);
  if (inherited != nullptr && *inherited) return std::string(inherited) == "1";
  return ::isatty(STDERR_FILENO) == 1;
}

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

}  // namespace

std::pair<std::string, std::string> progress_terminal_env() {
  return {kProgressTerminalEnv, progress_on_terminal() ? "1" : "0"};
}

Progress::Progress(std::string what, int64_t total, int max_lines)
    : what_(std::move(what)),
      total_(std::max<int64_t>(total, 1)),
      every_(std::max<int64_t>(1, (total_ + std::max(max_lines, 1) - 1) / std::max(max_lines, 1))),
      terminal_(progress_on_terminal()),
      start_s_(now_s()) {}

void Progress::update(int64_t done, const std::string& detail) {
  const bool last = done >= total_;
  if (!terminal_ && !last && done % every_ != 0) return;
  const double elapsed = now_s() - start_s_;
  std::string line = absl::StrFormat("%s %d/%d, %.1f s", what_, done, total_, elapsed);
  if (!last && done > 0) absl::StrAppendFormat(&line, ", ETA %.1f s", elapsed / done * (total_ - done));
  if (!detail.empty()) absl::StrAppend(&line, ", ", detail);
  // On a terminal: clear to the end of the line, and stay on it until the last.
  if (terminal_) line += last ? "\033[K\n" : "\033[K\r";
  else line += "\n";
  std::fputs(line.c_str(), stderr);
  std::fflush(stderr);
}

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

std::string temp_path(const std::string& stem) {
  const char* dir = std::getenv("TMPDIR");
  return absl::StrCat(dir && *dir ? dir : "/tmp", "/", stem, ".", ::getpid());
}

std::string source_path(const std::string& relative) {
  std::vector<std::string> roots;
  if (const char* ws = std::getenv("BUILD_WORKSPACE_DIRECTORY")) roots.push_back(ws);
  if (const char* src = std::getenv("TEST_SRCDIR")) roots.push_back(absl::StrCat(src, "/ddprpc"));
  // The binary's own runfiles (a data dependency), wherever it is started from.
  char exe[4096];
  const ssize_t n = ::readlink("/proc/self/exe", exe, sizeof(exe) - 1);
  if (n > 0) roots.push_back(absl::StrCat(std::string(exe, n), ".runfiles/ddprpc"));
  char cwd[4096];
  if (::getcwd(cwd, sizeof(cwd))) roots.push_back(cwd);
  for (const auto& root : roots) {
    std::string candidate = absl::StrCat(root, "/", relative);
    if (::access(candidate.c_str(), R_OK) == 0) return candidate;
  }
  return "";
}

std::string output_path(const std::string& path) {
  if (path.empty() || path[0] == '/') return path;
  if (const char* wd = std::getenv("BUILD_WORKING_DIRECTORY")) return absl::StrCat(wd, "/", path);
  return path;
}

int run_command(const std::vector<std::string>& argv, std::string* output) {
  std::string cmd;
  for (const auto& a : argv) {
    std::string quoted = "'";
    for (char c : a) quoted += c == '\'' ? std::string("'\\''") : std::string(1, c);
    absl::StrAppend(&cmd, quoted, "' ");
  }
  absl::StrAppend(&cmd, "2>&1");
  FILE* pipe = ::popen(cmd.c_str(), "r");
  if (!pipe) return -1;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof(buf), pipe)) > 0) output->append(buf, n);
  int status = ::pclose(pipe);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 1;
}

std::string Table::str() const {
  std::vector<size_t> width;
  for (const auto& row : rows_) {
    if (width.size() < row.size()) width.resize(row.size(), 0);
    for (size_t i = 0; i < row.size(); ++i) width[i] = std::max(width[i], row[i].size());
  }
  std::string out;
  for (size_t r = 0; r < rows_.size(); ++r) {
    for (size_t i = 0; i < rows_[r].size(); ++i) {
      // First column left-aligned, figures right-aligned.
      out += i == 0 ? absl::StrFormat("%-*s", width[i], rows_[r][i])
                    : absl::StrFormat("  %*s", width[i], rows_[r][i]);
    }
    out += "\n";
    if (r == 0) {
      size_t total = 0;
      for (size_t w : width) total += w + 2;
      out += std::string(total - 2, '-') + "\n";
    }
  }
  return out;
}

JsonValue* Json::next() {
  if (open_.empty()) {
    root_.Clear();
    return &root_;
  }
  JsonValue* at = open_.back();
  if (at->has_list_value()) return at->mutable_list_value()->add_values();
  return &(*at->mutable_struct_value()->mutable_fields())[key_];
}

Json& Json::begin_object() {
  JsonValue* v = next();
  v->mutable_struct_value();
  open_.push_back(v);
  return *this;
}

Json& Json::end_object() {
  if (!open_.empty()) open_.pop_back();
  return *this;
}

Json& Json::begin_array() {
  JsonValue* v = next();
  v->mutable_list_value();
  open_.push_back(v);
  return *this;
}

Json& Json::end_array() { return end_object(); }

Json& Json::key(const std::string& k) {
  key_ = k;
  return *this;
}

Json& Json::value(double v) {
  JsonValue* at = next();
  if (std::isfinite(v)) {
    at->set_number_value(v);
  } else {
    at->set_null_value(google::protobuf::NULL_VALUE);
  }
  return *this;
}

Json& Json::value(const std::string& s) {
  next()->set_string_value(s);
  return *this;
}

Json& Json::value(bool b) {
  next()->set_bool_value(b);
  return *this;
}

Json& Json::value(const JsonValue& v) {
  *next() = v;
  return *this;
}

Json& Json::versions() {
  return key("libtorch").value(libtorch_version()).key("pytorch").value(pytorch_version())
      .key("python").value(reference_python()).key("runtime").value(runtime_settings());
}

std::string Json::str() const { return to_json(root_); }

bool Json::write(const std::string& path) const { return write_json(root_, path); }

bool write_json(const JsonValue& v, const std::string& path) {
  std::ofstream f(path);
  f << to_json(v) << "\n";
  f.close();
  if (!f) std::fprintf(stderr, "cannot write %s\n", path.c_str());
  return static_cast<bool>(f);
}

double speedup(double ours, double theirs, bool higher_is_better) {
  if (!(ours > 0) || !(theirs > 0)) return 0;
  return higher_is_better ? ours / theirs : theirs / ours;
}

std::string speedup_cell(double ours, double theirs, bool higher_is_better, int decimals) {
  const double s = speedup(ours, theirs, higher_is_better);
  return s > 0 ? absl::StrFormat("%.*fx", decimals, s) : std::string("-");
}

std::string RoundSpeedups::list() const {
  std::string out;
  for (double v : per_round) absl::StrAppendFormat(&out, "%s%.2f", out.empty() ? "" : " ", v);
  return out;
}

JsonValue RoundSpeedups::json() const {
  Json j;
  j.begin_object().key("per_round").begin_array();
  for (double v : per_round) j.value(v);
  j.end_array().key("median").value(median()).end_object();
  return j.root();
}

RoundSpeedups round_speedups(const std::vector<double>& ours, const std::vector<double>& theirs,
                             bool higher_is_better) {
  RoundSpeedups r;
  for (size_t i = 0; i < ours.size() && i < theirs.size(); ++i) {
    const double s = speedup(ours[i], theirs[i], higher_is_better);
    if (s > 0) r.per_round.push_back(s);
  }
  return r;
}

std::string reference_script(const std::string& flag_value, const std::string& relative) {
  return flag_value.empty() ? source_path(relative) : flag_value;
}

std::string ReferenceRun::failure(size_t tail) const {
  std::string why = exit_code != 0 ? absl::StrCat("exit ", exit_code)
                                   : std::string("exit 0 without a JSON report");
  const size_t from = output.size() > tail ? output.size() - tail : 0;
  return absl::StrCat(why, ":\n", output.substr(from));
}

ReferenceRun run_reference(const std::string& script, const std::vector<std::string>& args,
                           const std::string& report_flag) {
  static std::atomic<int> counter{0};
  const std::string path =
      absl::StrCat(temp_path(absl::StrCat("pytorch_report", counter.fetch_add(1))), ".json");
  std::vector<std::string> argv = {reference_python(), script};
  argv.insert(argv.end(), args.begin(), args.end());
  if (!report_flag.empty()) argv.push_back(report_flag);
  argv.push_back(path);
  ReferenceRun run;
  run.exit_code = run_command(argv, &run.output);
  take_report(path, &run);
  return run;
}

void take_report(const std::string& path, ReferenceRun* run) {
  run->report.set_null_value(google::protobuf::NULL_VALUE);
  if (run->exit_code == 0) {
    std::string error;
    if (!parse_json(read_file(path), &run->report, &error)) {
      run->report.set_null_value(google::protobuf::NULL_VALUE);
      absl::StrAppend(&run->output, "\nits report is not JSON: ", error);
    }
  }
  std::remove(path.c_str());
}

bool parse_json(const std::string& text, JsonValue* out, std::string* error) {
  const auto status = google::protobuf::util::JsonStringToMessage(text, out);
  if (!status.ok() && error != nullptr) *error = std::string(status.message());
  return status.ok();
}

std::string to_json(const JsonValue& v) {
  std::string out;
  if (!google::protobuf::util::MessageToJsonString(v, &out).ok()) return "null";
  return out;
}

const JsonValue* json_at(const JsonValue& v, std::initializer_list<std::string> keys) {
  const JsonValue* at = &v;
  for (const std::string& key : keys) {
    if (!at->has_struct_value()) return nullptr;
    const auto& fields = at->struct_value().fields();
    auto it = fields.find(key);
    if (it == fields.end()) return nullptr;
    at = &it->second;
  }
  return at;
}

double json_number(const JsonValue& v, std::initializer_list<std::string> keys, double fallback) {
  const JsonValue* at = json_at(v, keys);
  return at != nullptr && at->kind_case() == JsonValue::kNumberValue ? at->number_value() : fallback;
}

}  // namespace ddprpc::benchmarks
