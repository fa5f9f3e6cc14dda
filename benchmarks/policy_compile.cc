// policy_compile: eager vs compiled PPO policy inference (the seed's
// torch.compile study, with what libtorch 1.13 offers). For each model (mlp:
// CartPole MLP, cnn: Atari conv), intra-op thread count, batch size and
// backend/mode: forward_exploration calls/s eager and compiled (median of
// timed trials after warm-up) and the speedup. Each compiled trial is paired
// with an eager trial right beside it (alternating which goes first), and the
// speedup is the median of the pairs' ratios, so that load from other
// processes, which comes and goes, hits both sides alike. A "default" row per
// cell measures what compile_policy(policy) gives with no options (default
// backend, caller-thread calls), the choice that must never lose to eager.
// Eager PyTorch (--python's, benchmarks/reference/policy_eager.py) is
// measured in the same run for the C++-vs-Python eager overhead.
//
//   ./bazelw run //benchmarks:policy_compile [-- --backend=xnnpack --mode=default]
#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>
#include <gflags/gflags.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "benchmarks/common.h"
#include "models/policy_compile.h"

DEFINE_string(backend, "",
              "only this backend (torchscript, xnnpack, nnc); default: every backend, plus "
              "the default-choice row");
DEFINE_string(mode, "", "only this mode of the backend(s) (script, freeze, optimize, default, interp)");
DEFINE_string(models, "mlp,cnn", "comma-separated: mlp (CartPole MLP), cnn (Atari conv)");
DEFINE_string(batches, "1,4,16", "comma-separated batch sizes");
DEFINE_string(threads, "1,2", "comma-separated intra-op thread counts (at::set_num_threads)");
DEFINE_int32(trials, 5,
             "timed trials per cell and backend, each paired with an eager trial (medians are "
             "reported)");
DEFINE_int32(trial_ms, 100, "length of one trial in milliseconds");
DEFINE_int32(warmup, 20, "untimed calls per cell before the trials");
DEFINE_string(json, "policy_compile.json",
              "where to write every figure (relative paths are relative to the directory bazel "
              "run was started from)");
DEFINE_bool(pytorch, true,
            "also measure eager PyTorch (benchmarks/reference/policy_eager.py with "
            "--python; skipped when that has no torch)");
DEFINE_bool(omp_passive, true,
            "run with OMP_WAIT_POLICY=PASSIVE (the binary restarts itself with it) unless "
            "OMP_WAIT_POLICY is already set; false shows the spinning-pool collapse of the "
            "multi-threaded rows (see models/policy_compile.h)");

namespace bench = ddprpc::benchmarks;
namespace models = ddprpc::models;

namespace {

std::vector<int> ints(const std::string& csv) {
  std::vector<int> out;
  for (absl::string_view s : absl::StrSplit(csv, ',', absl::SkipEmpty())) out.push_back(std::stoi(std::string(s)));
  return out;
}

// One trial: calls/s of fn over FLAGS_trial_ms.
double trial(const std::function<void()>& fn) {
  int64_t n = 0;
  const absl::Time start = absl::Now(), end = start + absl::Milliseconds(FLAGS_trial_ms);
  absl::Time now;
  do {
    fn();
    ++n;
  } while ((now = absl::Now()) < end);
  return n / absl::ToDoubleSeconds(now - start);
}

// Eager PyTorch calls/s by "model/threads/batch"; empty (with a note on
// stderr) when it cannot be measured.
std::map<std::string, double> measure_pytorch() {
  std::map<std::string, double> out;
  const std::string script = bench::reference_script("", "benchmarks/reference/policy_eager.py");
  if (script.empty()) {
    std::fprintf(stderr, "policy_compile: PyTorch not measured: benchmarks/reference/policy_eager.py not found\n");
    return out;
  }
  std::fprintf(stderr, "policy_compile: eager PyTorch reference (%s)\n", script.c_str());
  const bench::ReferenceRun run = bench::run_reference(
      script, {"--models", FLAGS_models, "--batches", FLAGS_batches, "--threads", FLAGS_threads,
               "--trials", absl::StrCat(FLAGS_trials), "--trial_ms", absl::StrCat(FLAGS_trial_ms)});
  // Its report: {"model/threads/batch": calls per second, ...}.
  if (run.report.has_struct_value()) {
    for (const auto& [key, v] : run.report.struct_value().fields()) {
      if (v.kind_case() == bench::JsonValue::kNumberValue) out[key] = v.number_value();
    }
  }
  if (!run.ok() || out.empty()) {
    std::fprintf(stderr, "policy_compile: PyTorch not measured: %s\n", run.failure(500).c_str());
  }
  return out;
}

struct Series {
  std::string label;  // backend/mode, or the default row's label
  bool is_default = false;
  std::optional<models::CompiledPolicy> compiled;  // empty: eager
  std::vector<double> rates;
  std::vector<double> ratios;  // over the paired eager trial
};

}  // namespace

int main(int argc, char** argv) {
  gflags::SetUsageMessage("eager vs compiled PPO policy inference (calls/s, speedup)");
  bench::parse_flags(&argc, &argv, "benchmarks/policy_compile");
  // Idle OpenMP workers that spin starve XNNPACK's pool (and each other) on
  // small machines. libgomp reads OMP_WAIT_POLICY when it loads, so set it
  // and start again, once.
  if (FLAGS_omp_passive && !std::getenv("OMP_WAIT_POLICY")) {
    setenv("OMP_WAIT_POLICY", "PASSIVE", 1);
    execv(bench::self_exe().c_str(), argv);
    std::fprintf(stderr, "policy_compile: could not restart with OMP_WAIT_POLICY=PASSIVE\n");
  }
  const char* wait_policy = std::getenv("OMP_WAIT_POLICY");
  const bool all_backends = FLAGS_backend.empty() && FLAGS_mode.empty();

  std::map<std::string, double> pytorch;
  if (FLAGS_pytorch) pytorch = measure_pytorch();

  bench::Table table({"model", "threads", "batch", "backend/mode", "eager calls/s", "compiled calls/s",
                      "speedup", "PyTorch eager", "C++/Py eager"});
  bench::Table best_table({"model", "threads", "batch", "best backend/mode", "speedup", "default speedup"});
  bench::Json json;
  json.begin_object().key("omp_wait_policy").value(wait_policy ? wait_policy : "");
  std::printf("policy_compile: %s\n", bench::versions().c_str());
  json.versions();
  json.key("cpus").value(bench::cpu_count()).key("trials").value(FLAGS_trials).key("trial_ms").value(FLAGS_trial_ms);
  json.key("cells").begin_array();
  std::vector<std::string> skipped;
  double default_worst = 0;
  std::string default_worst_cell;
  int selected = 0;

  for (absl::string_view model_name : absl::StrSplit(FLAGS_models, ',', absl::SkipEmpty())) {
    models::PpoPolicy policy = model_name == "cnn" ? models::make_cnn_policy() : models::make_mlp_policy();
    policy->eval();
    std::vector<Series> series;
    series.push_back({"eager"});
    for (const auto& [backend, mode] : models::compile_backends()) {
      if (!FLAGS_backend.empty() && backend != FLAGS_backend) continue;
      if (!FLAGS_mode.empty() && mode != FLAGS_mode) continue;
      ++selected;
      std::fprintf(stderr, "policy_compile: compiling %s/%s for the %s policy\n", backend.c_str(), mode.c_str(),
                   std::string(model_name).c_str());
      models::CompileOptions options;
      options.backend = backend;
      options.mode = mode;
      options.threads = models::Threads::kIntraOpPools;  // the row's thread count applies
      try {
        series.push_back({backend + "/" + mode, false, models::compile_policy(policy, options)});
      } catch (const std::exception& e) {
        std::fprintf(stderr, "policy_compile: skipping: %s\n", e.what());
        skipped.push_back(e.what());
      }
    }
    if (all_backends) {
      try {
        models::CompiledPolicy compiled = models::compile_policy(policy);
        series.push_back({absl::StrCat("default: ", compiled.name(), ", caller thread"), true, std::move(compiled)});
      } catch (const std::exception& e) {
        std::fprintf(stderr, "policy_compile: skipping the default choice: %s\n", e.what());
        skipped.push_back(e.what());
      }
    }
    if (series.size() == 1) continue;

    for (int threads : ints(FLAGS_threads)) {
      at::set_num_threads(threads);
      for (int batch : ints(FLAGS_batches)) {
        std::fprintf(stderr, "policy_compile: %s, %d thread(s), batch %d\n", std::string(model_name).c_str(),
                     threads, batch);
        const at::Tensor obs = policy->example_input(batch);
        std::vector<std::function<void()>> calls;
        for (auto& s : series) {
          s.rates.clear();
          s.ratios.clear();
          if (s.compiled) {
            calls.push_back([&s, &obs] { s.compiled->forward_exploration(obs); });
          } else {
            calls.push_back([&policy, &obs] {
              c10::InferenceMode guard;
              policy->forward_exploration(obs);
            });
          }
          for (int i = 0; i < FLAGS_warmup; ++i) calls.back()();
        }
        for (int t = 0; t < FLAGS_trials; ++t) {
          for (size_t i = 1; i < series.size(); ++i) {
            const bool eager_first = (t + i) % 2 == 0;
            const double first = trial(calls[eager_first ? 0 : i]);
            const double second = trial(calls[eager_first ? i : 0]);
            const double eager = eager_first ? first : second, compiled = eager_first ? second : first;
            series[0].rates.push_back(eager);
            series[i].rates.push_back(compiled);
            series[i].ratios.push_back(compiled / eager);
          }
        }

        const double eager = bench::percentile(series[0].rates, 0.5);
        const std::string key = absl::StrCat(model_name, "/", threads, "/", batch);
        const double py = pytorch.count(key) ? pytorch[key] : 0;
        std::string best;
        double best_speedup = -1e9, default_speedup = 0;
        for (size_t i = 1; i < series.size(); ++i) {
          const double rate = bench::percentile(series[i].rates, 0.5);
          const double speedup = (bench::percentile(series[i].ratios, 0.5) - 1) * 100;
          table.add({std::string(model_name), absl::StrCat(threads), absl::StrCat(batch), series[i].label,
                     absl::StrFormat("%.0f", eager), absl::StrFormat("%.0f", rate),
                     absl::StrFormat("%+.0f%%", speedup), py > 0 ? absl::StrFormat("%.0f", py) : "-",
                     py > 0 ? absl::StrFormat("%.2fx", eager / py) : "-"});
          json.begin_object().key("model").value(std::string(model_name)).key("threads").value(threads);
          json.key("batch").value(batch).key("backend").value(series[i].label);
          json.key("default_choice").value(series[i].is_default);
          json.key("eager_calls_per_s").value(eager).key("compiled_calls_per_s").value(rate);
          json.key("speedup_pct").value(speedup).key("pytorch_eager_calls_per_s").value(py).end_object();
          if (series[i].is_default) {
            default_speedup = speedup;
            if (default_worst_cell.empty() || speedup < default_worst) {
              default_worst = speedup;
              default_worst_cell = absl::StrCat(key, " (", series[i].label, ")");
            }
          } else if (speedup > best_speedup) {
            best_speedup = speedup;
            best = series[i].label;
          }
        }
        if (!best.empty()) {
          best_table.add({std::string(model_name), absl::StrCat(threads), absl::StrCat(batch), best,
                          absl::StrFormat("%+.0f%%", best_speedup),
                          all_backends ? absl::StrFormat("%+.0f%%", default_speedup) : "-"});
        }
      }
    }
  }
  json.end_array();
  json.key("skipped").begin_array();
  for (const auto& s : skipped) json.value(s);
  json.end_array();

  std::printf(
      "OMP_WAIT_POLICY=%s, %d CPUs; calls/s: median of %d x %d ms trials per backend (eager: of all its "
      "trials); speedup: median of the paired compiled/eager ratios\n\n",
      wait_policy ? wait_policy : "(unset)", bench::cpu_count(), FLAGS_trials, FLAGS_trial_ms);
  std::printf("%s", table.str().c_str());
  if (!skipped.empty()) {
    std::printf("\nSkipped (backend cannot handle the model):\n");
    for (const auto& s : skipped) std::printf("  %s\n", s.c_str());
  }
  std::printf("\nBest backend per model, threads and batch size:\n%s", best_table.str().c_str());
  if (!default_worst_cell.empty()) {
    std::printf("\nDefault choice (compile_policy with no options): worst speedup %+.0f%% at %s: %s\n",
                default_worst, default_worst_cell.c_str(),
                default_worst >= 0 ? "never slower than eager" : "SLOWER than eager there");
    json.key("default_worst_speedup_pct").value(default_worst).key("default_worst_cell").value(default_worst_cell);
  }
  if (selected == 0) std::fprintf(stderr, "policy_compile: no backend/mode matches --backend/--mode\n");
  json.end_object();
  const std::string path = bench::output_path(FLAGS_json);
  if (json.write(path)) std::printf("wrote %s\n", path.c_str());
  return selected == 0 ? 1 : 0;
}
