// policy_compile: eager vs compiled PPO policy inference (the seed's
// torch.compile study, with what libtorch 1.13 offers): for each model
// (mlp, cnn), thread count, batch size (1, 4, 16) and backend/mode,
// forward_exploration calls/s eager and compiled (median of trials after
// warm-up) and the speedup; eager PyTorch (python3-torch) is measured in
// the same run for the C++-vs-Python eager overhead.
//
//   ./bazelw run //benchmarks:policy_compile [-- --backend=xnnpack --mode=default]
#include <ATen/Parallel.h>
#include <gflags/gflags.h>

#include <cstdio>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <map>
#include <regex>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "benchmarks/common.h"
#include "models/policy_compile.h"

DEFINE_string(backend, "", "only this backend (torchscript, xnnpack, nnc); default: all");
DEFINE_string(mode, "", "only this mode of the backend(s); default: all");
DEFINE_string(models, "mlp,cnn", "comma-separated: mlp (CartPole MLP), cnn (Atari conv)");
DEFINE_string(batches, "1,4,16", "comma-separated batch sizes");
DEFINE_string(threads, "1,2", "comma-separated intra-op thread counts");
DEFINE_int32(trials, 3, "timed trials per cell (the median is reported)");
DEFINE_int32(trial_ms, 150, "length of one trial in milliseconds");
DEFINE_string(json, "policy_compile.json", "where to write every figure");
DEFINE_bool(pytorch, true, "also measure eager PyTorch (benchmarks/reference/policy_eager.py)");

namespace bench = ddprpc::benchmarks;
namespace models = ddprpc::models;

namespace {

std::vector<int> ints(const std::string& csv) {
  std::vector<int> out;
  for (absl::string_view s : absl::StrSplit(csv, ',')) out.push_back(std::stoi(std::string(s)));
  return out;
}

template <typename F>
double calls_per_s(F fn) {
  for (int i = 0; i < 20; ++i) fn();
  std::vector<double> rates;
  for (int t = 0; t < FLAGS_trials; ++t) {
    int64_t n = 0;
    absl::Time start = absl::Now(), end = start + absl::Milliseconds(FLAGS_trial_ms);
    absl::Time now;
    do {
      fn();
      ++n;
    } while ((now = absl::Now()) < end);
    rates.push_back(n / absl::ToDoubleSeconds(now - start));
  }
  return bench::percentile(rates, 0.5);
}

// {"mlp": {"1": x, ...}, ...} from the reference script.
std::map<std::string, double> parse_reference(const std::string& json) {
  std::map<std::string, double> out;
  std::regex kind_re("\"(mlp|cnn)\"\\s*:\\s*\\{([^}]*)\\}");
  std::regex cell_re("\"([0-9]+)\"\\s*:\\s*([0-9.eE+-]+)");
  for (std::sregex_iterator k(json.begin(), json.end(), kind_re), end; k != end; ++k) {
    std::string body = (*k)[2].str();
    for (std::sregex_iterator c(body.begin(), body.end(), cell_re); c != end; ++c) {
      out[(*k)[1].str() + "/" + (*c)[1].str()] = std::stod((*c)[2].str());
    }
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  // OpenMP threads that spin while XNNPACK's pool works starve it on small
  // machines; passive waiting removes the collapse. libgomp reads this when
  // it loads, so set it and start again (once), unless the user chose.
  if (!std::getenv("OMP_WAIT_POLICY")) {
    setenv("OMP_WAIT_POLICY", "PASSIVE", 1);
    execv("/proc/self/exe", argv);
  }
  gflags::SetUsageMessage("eager vs compiled PPO policy inference (calls/s, speedup)");
  bench::parse_flags(&argc, &argv, "benchmarks/policy_compile");

  std::map<std::string, double> pytorch;
  const std::string script = bench::source_path("benchmarks/reference/policy_eager.py");
  if (FLAGS_pytorch && !script.empty()) {
    std::fprintf(stderr, "policy_compile: eager PyTorch reference (1 thread)\n");
    const std::string out = bench::temp_path("policy_eager") + ".json";
    std::string log;
    bench::run_command({"/usr/bin/python3", script, "--threads", "1", "--json", out}, &log);
    std::ifstream in(out);
    std::stringstream s;
    s << in.rdbuf();
    pytorch = parse_reference(s.str());
    std::remove(out.c_str());
  }

  bench::Table table({"model", "threads", "batch", "backend/mode", "eager calls/s",
                      "compiled calls/s", "speedup", "PyTorch eager", "C++/Py eager"});
  bench::Json json;
  json.begin_object().key("cells").begin_array();
  // best[model/batch] at 1 thread: (speedup, backend)
  std::map<std::string, std::pair<double, std::string>> best;
  // The default choice (default_backend at kDefaultPolicyThreads): worst speedup seen.
  double default_worst = 1e18;
  for (absl::string_view model_name : absl::StrSplit(FLAGS_models, ',')) {
    models::PpoPolicy policy =
        model_name == "cnn" ? models::make_cnn_policy() : models::make_mlp_policy();
    policy->eval();
    std::vector<models::CompiledPolicy> compiled;
    for (const auto& [backend, mode] : models::compile_backends()) {
      if (!FLAGS_backend.empty() && backend != FLAGS_backend) continue;
      if (!FLAGS_mode.empty() && mode != FLAGS_mode) continue;
      try {
        compiled.push_back(models::compile_policy(policy, backend, mode));
      } catch (const std::exception& e) {
        std::fprintf(stderr, "policy_compile: skipping: %s\n", e.what());
      }
    }
    for (int threads : ints(FLAGS_threads)) {
      models::set_policy_threads(threads);
      for (int batch : ints(FLAGS_batches)) {
        std::fprintf(stderr, "policy_compile: %s, %d thread(s), batch %d\n",
                     std::string(model_name).c_str(), threads, batch);
        at::Tensor obs = policy->example_input(batch);
        double eager;
        {
          c10::InferenceMode guard;
          eager = calls_per_s([&] { policy->forward_exploration(obs); });
        }
        const std::string key = absl::StrCat(model_name, "/", batch);
        const double py = threads == 1 && pytorch.count(key) ? pytorch[key] : 0;
        for (auto& c : compiled) {
          const double rate = calls_per_s([&] { c.forward_exploration(obs); });
          const double speedup = (rate / eager - 1) * 100;
          table.add({std::string(model_name), absl::StrCat(threads), absl::StrCat(batch), c.name(),
                     absl::StrFormat("%.0f", eager), absl::StrFormat("%.0f", rate),
                     absl::StrFormat("%+.0f%%", speedup), py > 0 ? absl::StrFormat("%.0f", py) : "-",
                     py > 0 ? absl::StrFormat("%.2fx", eager / py) : "-"});
          json.begin_object().key("model").value(std::string(model_name)).key("threads").value(threads);
          json.key("batch").value(batch).key("backend").value(c.name()).key("eager_calls_per_s").value(eager);
          json.key("compiled_calls_per_s").value(rate).key("speedup_pct").value(speedup);
          json.key("pytorch_eager_calls_per_s").value(py).end_object();
          if (threads == 1 && (!best.count(key) || speedup > best[key].first)) best[key] = {speedup, c.name()};
          auto def = models::default_backend(policy->kind);
          if (threads == models::kDefaultPolicyThreads && c.name() == def.first + "/" + def.second) {
            default_worst = std::min(default_worst, speedup);
          }
        }
      }
    }
  }
  json.end_array();
  models::set_policy_threads(models::kDefaultPolicyThreads);
  std::printf("%s", table.str().c_str());
  if (default_worst < 1e17) {
    std::printf("\nDefault choice (models::default_backend, %d thread): worst speedup %+.0f%%%s\n",
                models::kDefaultPolicyThreads, default_worst,
                default_worst >= 0 ? " (never slower than eager)" : " (SLOWER than eager somewhere)");
  }
  std::printf("Best backend per model and batch size (1 thread):\n");
  json.key("best_1_thread").begin_object();
  for (const auto& [key, b] : best) {
    std::printf("  %-8s %-22s %+.0f%%\n", key.c_str(), b.second.c_str(), b.first);
    json.key(key).begin_object().key("backend").value(b.second).key("speedup_pct").value(b.first).end_object();
  }
  json.end_object().end_object();
  const std::string path = bench::output_path(FLAGS_json);
  if (json.write(path)) std::printf("wrote %s\n", path.c_str());
  return 0;
}
