// rpc_rl: RPC throughput and latency for reinforcement learning
// (PyTorch's RL benchmark), with PyTorch's own benchmark
// (benchmarks/reference/rpc_rl.py) measured in the same run.
//
//   ./bazelw run //benchmarks:rpc_rl -- --world_size=3,5,10 --batch=true
//
// Processes: coordinator (rank 0), agent (rank 1), observers (ranks 2..W-1).
// The coordinator creates the agent and the observers as remote objects and
// runs --episodes episodes; in each, every observer sends --episode_steps
// random states to the agent by rpc_sync and waits for an action. The agent's
// policy is Flatten -> Linear(prod(state_size), out_features) -> nlayers x
// Linear(out_features, out_features) -> softmax, sampled (ours: layers this
// small run as one fused autograd node, models/linear_chain.h; with
// --dense_kernel=aten layer by layer as PyTorch's). --batch=false: each
// request runs through the policy alone. --batch=true: select_action_batch
// runs with async execution: it parks its request on a shared future until
// every observer has sent a state, the last one runs the whole batch in one
// call and completes the future, which answers everyone.
//
// Metrics (p50/p75/p90/p95, numpy's linear interpolation on both sides):
// agent latency (one request, or one batch from its first arrival until its
// future is completed and the replies of the batch's other requests are
// encoded and handed to the transport, as PyTorch's set_result does inside
// its timed region), agent throughput (batch size / agent latency), observer
// latency (request -> action) and observer throughput (1 / observer
// latency). One flag may hold a comma list; each
// value is run in turn and becomes the table's x axis. --output_file_path
// writes the JSON that `bazel run //benchmarks:plot -- FILE` charts.
#include <ATen/Parallel.h>
#include <ATen/ops/rand.h>
#include <ATen/ops/softmax.h>
#include <ATen/ops/zeros.h>
#include <gflags/gflags.h>
#include <torch/nn/modules/linear.h>

#include <chrono>
#include <cstring>
#include <cstdio>
#include <functional>
#include <map>
#include <memory>
#include <numeric>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "benchmarks/common.h"
#include "benchmarks/harness.h"
#include "benchmarks/rounds.h"
#include "models/categorical.h"
#include "models/chosen_log_probs.h"
#include "models/linear.h"
#include "models/linear_chain.h"
#include "models/policy_compile.h"
#include "rpc/rendezvous/launch.h"
#include "rpc/rref/rref.h"

DEFINE_string(world_size, "5", "processes: coordinator + agent + (world_size - 2) observers");
DEFINE_string(master_addr, "127.0.0.1", "address of the rendezvous (rank 0)");
DEFINE_int32(master_port, 0, "port of the rendezvous; 0 picks a free one for every run");
DEFINE_string(batch, "true",
              "true: the agent answers all observers from one batched policy call (async "
              "execution); false: one request at a time");
DEFINE_string(state_size, "10-20-10", "shape of an observer's state, dims joined by '-'");
DEFINE_string(nlayers, "5", "hidden Linear(out_features, out_features) layers of the policy");
DEFINE_string(out_features, "10", "actions the policy chooses from");
DEFINE_string(episodes, "10", "episodes the coordinator runs");
DEFINE_string(episode_steps, "10", "requests every observer sends per episode");
DEFINE_string(output_file_path, "benchmark_report.json",
              "JSON with the configuration and every figure (ours and PyTorch's)");
DEFINE_bool(pytorch, true,
            "also run PyTorch's benchmark (benchmarks/reference/rpc_rl.py with --python) "
            "on the same configuration and print both");
DEFINE_string(dense_kernel, "",
              "kernels of the agent's policy layers, a comma list, one run of ddprpc each: "
              "xnnpack (ours) or aten (libtorch's Linear, the kernel PyTorch's side runs). "
              "Against PyTorch, aten gives the ratio of the runtimes alone and xnnpack the "
              "ratio of the product. Default: xnnpack,aten where libtorch has XNNPACK, else "
              "aten (PyTorch's x86 wheels have none)");
DEFINE_string(compile, "",
              "BACKEND[/MODE]: the agent's policy compiled by //models:policy_compile "
              "(torchscript/script|freeze|optimize, xnnpack/default, nnc/interp) instead of "
              "eager layers; one run of ddprpc, labelled compiled:BACKEND/MODE, in place of "
              "--dense_kernel's");
DEFINE_int32(pairs, 1,
             "rounds of interleaved runs: ddprpc (once per --dense_kernel), then PyTorch's "
             "benchmark; each ratio printed is the median of the rounds' ratios");
DEFINE_int32(num_worker_threads, 16, "RPC worker threads per process");
DEFINE_int32(timeout_s, 600, "wall-clock limit of each configuration, in seconds (stops its processes)");
DEFINE_int32(rpc_timeout_s, 60, "deadline of each RPC, in seconds (episodes get --timeout_s)");

namespace ddprpc {
namespace {

namespace bench = benchmarks;
namespace models = ddprpc::models;
using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

const char* const kMetrics[] = {"agent latency (seconds)", "agent throughput",
                                "observer latency (seconds)", "observer throughput"};
const int kPercentiles[] = {50, 75, 90, 95};

std::string worker_name(int rank) {
  if (rank == 0) return "coordinator";
  if (rank == 1) return "agent";
  return absl::StrCat("observer", rank);
}

// One action from row `row` of `probs` ([rows, actions], contiguous float).
int64_t sample_row(const at::Tensor& probs, int64_t row) {
  thread_local std::mt19937_64 rng(std::random_device{}());
  const int64_t n = probs.size(1);
  return ddprpc::models::sample_categorical(probs.data_ptr<float>() + row * n, n, rng);
}

constexpr char kCompiledPrefix[] = "compiled:";

// The dummy policy of PyTorch's benchmark; `compile` ("" or BACKEND[/MODE])
// runs it through //models:policy_compile.
class Policy {
 public:
  Policy(int64_t in_features, int64_t nlayers, int64_t out_features, models::DenseKernel kernel,
         const std::string& compile)
      : kernel_(kernel) {
    layers_.emplace_back(in_features, out_features);
    for (int64_t i = 0; i < nlayers; ++i) layers_.emplace_back(out_features, out_features);
    for (auto& layer : layers_) {
      weights_.push_back(layer->weight);
      biases_.push_back(layer->bias);
      layer->set_kernel(kernel);
      // XNNPACK: many forwards per weight update (an episode's steps): pack
      // each weight once, as an inference layer does, not each batch.
      layer->cache_packed_weight(kernel == models::DenseKernel::kXnnpack);
    }
    if (!compile.empty()) {
      std::vector<std::pair<at::Tensor, at::Tensor>> weights;
      for (auto& layer : layers_) weights.emplace_back(layer->weight, layer->bias);
      models::CompileOptions options;
      std::string error;
      if (!models::parse_compile_spec(compile, &options, &error)) throw std::invalid_argument(error);
      compiled_.emplace(models::compile_linear_softmax(weights, options));
    }
  }
  // x: [batch, state...] -> action probabilities [batch, out_features].
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = x.dim() == 2 ? x : x.flatten(1);
    if (compiled_) return compiled_->forward(h);
    // Ours: small layers as one autograd node (linear_chain.h).
    if (kernel_ == models::DenseKernel::kXnnpack && models::linear_chain_fits(h, weights_, biases_)) {
      return models::linear_chain_softmax(h, weights_, biases_);
    }
    for (auto& layer : layers_) h = layer->forward(h);
    return at::softmax(h, -1);
  }

 private:
  const models::DenseKernel kernel_;
  std::vector<models::Linear> layers_;  // torch::nn::Linear on XNNPACK (packed once) or ATen
  std::vector<at::Tensor> weights_, biases_;  // the layers' parameters
  std::optional<models::CompiledLinearSoftmax> compiled_;
};

// The agent, owned by rank 1 and called by the observers through an RRef.
class RlAgent {
 public:
  RlAgent() = default;

  void set_world(int64_t batch_size, std::vector<int64_t> state_size, int64_t nlayers,
                 int64_t out_features, std::string kernel_name) {
    models::DenseKernel kernel = models::DenseKernel::kXnnpack;
    std::string compile;
    if (absl::StartsWith(kernel_name, kCompiledPrefix)) {
      compile = kernel_name.substr(std::strlen(kCompiledPrefix));
    } else if (!models::parse_dense_kernel(kernel_name, &kernel)) {
      throw rpc::RpcError(rpc::ErrorCode::kInvalidArgument, "set_world: unknown kernel " + kernel_name);
    }
    absl::MutexLock lock(&mu_);
    const int64_t in = std::accumulate(state_size.begin(), state_size.end(), int64_t{1},
                                       std::multiplies<int64_t>());
    policy_ = std::make_unique<Policy>(in, nlayers, out_features, kernel, compile);
    batch_size_ = batch_size;
    pending_ = batch_size;
    std::vector<int64_t> shape{batch_size};
    shape.insert(shape.end(), state_size.begin(), state_size.end());
    states_ = at::zeros(shape);
    flat_states_ = states_.view({batch_size, in});
    saved_log_probs_.clear();
  }

  // batch=false: one state through the policy; returns the sampled action.
  int64_t select_action(int64_t observer_id, at::Tensor state) {
    const auto start = Clock::now();
    at::Tensor probs = policy()->forward(state.to(at::kFloat).reshape({1, state.numel()}));
    const int64_t a = sample_row(probs, 0);
    at::Tensor log_prob = models::chosen_log_probs(probs, {a});
    absl::MutexLock lock(&mu_);
    saved_log_probs_.push_back(log_prob);
    const double latency = seconds_since(start);
    latency_.push_back(latency);
    throughput_.push_back(1.0 / latency);
    ++answered_;
    return a;
  }

  // batch=true, async execution: the returned future completes once every
  // observer has sent its state for this step.
  rpc::Future<int64_t> select_action_batch(int64_t observer_id, at::Tensor state) {
    const int64_t row = observer_id - 2;
    rpc::Future<int64_t> mine;
    rpc::Future<std::vector<int64_t>> full;  // set when this request completes the batch
    Policy* policy = nullptr;
    if (!states_.defined() || row < 0 || row >= states_.size(0)) {
      throw rpc::RpcError(rpc::ErrorCode::kInvalidArgument,
                          absl::StrCat("select_action_batch: no observer ", observer_id));
    }
    // Outside the lock, as the seed: only this observer writes its row, and
    // the batch's last request reads them all after taking the lock. A float
    // state of the row's shape is copied as bytes (no view and no operator
    // per request); anything else goes through copy_, which converts or
    // fails with the reason.
    if (state.scalar_type() == at::kFloat && state.is_contiguous() &&
        state.sizes() == states_.sizes().slice(1)) {
      std::memcpy(states_.data_ptr<float>() + row * state.numel(), state.data_ptr<float>(),
                  state.numel() * sizeof(float));
    } else {
      states_[row].copy_(state);
    }
    {
      absl::MutexLock lock(&mu_);
      mine = future_actions_.then(
          [row](const rpc::Future<std::vector<int64_t>>& f) { return f.value()[row]; });
      if (pending_ == batch_size_) batch_start_ = Clock::now();
      if (--pending_ == 0) {
        pending_ = batch_size_;
        full = future_actions_;
        future_actions_ = rpc::Future<std::vector<int64_t>>();
        policy = policy_.get();
      }
    }
    if (policy != nullptr) {
      // No other request of this step can arrive before `full` completes.
      at::Tensor probs = policy->forward(flat_states_);
      // Plain integers: every observer's answer is an index, not a tensor
      // op; their log-probabilities (Categorical's log_prob) are one node.
      const int64_t rows = probs.size(0);
      std::vector<int64_t> actions(rows);
      for (int64_t r = 0; r < rows; ++r) actions[r] = sample_row(probs, r);
      at::Tensor log_probs = models::chosen_log_probs(probs, actions);
      full.set_result(std::move(actions));
      // The other requests' replies go out now, inside the timed region (as
      // PyTorch's set_result sends them); this request's own goes out when
      // the handler returns, after it, on both sides.
      rpc::send_completed_replies();
      absl::MutexLock lock(&mu_);
      saved_log_probs_.push_back(log_probs);
      const double latency = seconds_since(batch_start_);
      latency_.push_back(latency);
      throughput_.push_back(batch_size_ / latency);
      answered_ += batch_size_;
    }
    return mine;
  }

  // The episode's agent latencies and throughputs and the number of actions
  // answered; resets them.
  std::tuple<std::vector<double>, std::vector<double>, int64_t> finish_episode() {
    absl::MutexLock lock(&mu_);
    auto out = std::make_tuple(std::move(latency_), std::move(throughput_), answered_);
    latency_.clear();
    throughput_.clear();
    saved_log_probs_.clear();
    answered_ = 0;
    return out;
  }

 private:
  Policy* policy() {
    absl::MutexLock lock(&mu_);
    if (!policy_) throw std::runtime_error("RlAgent: set_world was not called");
    return policy_.get();
  }

  absl::Mutex mu_;
  // State below is protected by mu_ (states_ rows are written by their
  // observer's request before it takes mu_, and read by the batch's last).
  std::unique_ptr<Policy> policy_ ABSL_GUARDED_BY(mu_);
  int64_t batch_size_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t pending_ ABSL_GUARDED_BY(mu_) = 0;
  at::Tensor states_;  // [observers, state...], set by set_world before any request
  at::Tensor flat_states_;  // states_ as [observers, prod(state)], the policy's input
  rpc::Future<std::vector<int64_t>> future_actions_ ABSL_GUARDED_BY(mu_);
  Clock::time_point batch_start_ ABSL_GUARDED_BY(mu_);
  std::vector<at::Tensor> saved_log_probs_ ABSL_GUARDED_BY(mu_);
  std::vector<double> latency_ ABSL_GUARDED_BY(mu_);
  std::vector<double> throughput_ ABSL_GUARDED_BY(mu_);
  int64_t answered_ ABSL_GUARDED_BY(mu_) = 0;
};

// An observer: random states and rewards, one request per step.
class RlObserver {
 public:
  RlObserver(int64_t id, std::vector<int64_t> state_size, bool batch)
      : id_(id), state_size_(std::move(state_size)), batch_(batch) {}

  // Returns (rewards, observer latencies, observer throughputs, actions
  // received that lie in [0, num_actions)).
  std::tuple<at::Tensor, std::vector<double>, std::vector<double>, int64_t> run_ob_episode(
      rpc::RRef<RlAgent> agent, int64_t n_steps, int64_t num_actions) {
    at::Tensor state = at::rand(state_size_);
    at::Tensor rewards = at::zeros({n_steps});
    std::vector<double> latency, throughput;
    int64_t valid = 0;
    for (int64_t step = 0; step < n_steps; ++step) {
      const auto start = Clock::now();
      const int64_t action = batch_ ? agent.rpc_sync(&RlAgent::select_action_batch, id_, state)
                                    : agent.rpc_sync(&RlAgent::select_action, id_, state);
      const double l = seconds_since(start);
      latency.push_back(l);
      throughput.push_back(1.0 / l);
      if (action >= 0 && action < num_actions) ++valid;
      state = at::rand(state_size_);
      // A random 0/1 reward, drawn like the reference's random.randint(0, 1).
      thread_local std::mt19937_64 rng(std::random_device{}());
      rewards.data_ptr<float>()[step] =
          static_cast<float>(std::uniform_int_distribution<int64_t>(0, 1)(rng));
    }
    return {rewards, latency, throughput, valid};
  }

 private:
  const int64_t id_;
  const std::vector<int64_t> state_size_;
  const bool batch_;
};

const auto agent_class = rpc::register_class<RlAgent>("ddprpc.bench.RlAgent")
                             .constructor<>()
                             .method("set_world", &RlAgent::set_world)
                             .method("select_action", &RlAgent::select_action)
                             .method("select_action_batch", &RlAgent::select_action_batch)
                             .method("finish_episode", &RlAgent::finish_episode);
const auto observer_class =
    rpc::register_class<RlObserver>("ddprpc.bench.RlObserver")
        .constructor<int64_t, std::vector<int64_t>, bool>()
        .method("run_ob_episode", &RlObserver::run_ob_episode);

// One configuration, after the x-axis value was substituted.
struct Config {
  int world_size = 0;
  bool batch = true;
  std::vector<int64_t> state_size;
  int64_t nlayers = 0, out_features = 0, episodes = 0, episode_steps = 0;
  std::string kernel;  // the first of --dense_kernel
};

// --dense_kernel as names (or the one compiled run of --compile); "" and an
// error message in *error if one is unknown.
std::vector<std::string> dense_kernels(std::string* error) {
  if (!FLAGS_compile.empty()) {
    models::CompileOptions options;
    std::string why;
    if (models::parse_compile_spec(FLAGS_compile, &options, &why)) return {kCompiledPrefix + FLAGS_compile};
    *error = "--compile: " + why;
    return {};
  }
  std::vector<models::DenseKernel> kernels;
  std::string why;
  if (!models::parse_dense_kernels(FLAGS_dense_kernel, &kernels, &why)) {
    *error = "--dense_kernel: " + why;
    return {};
  }
  std::vector<std::string> out;
  for (models::DenseKernel k : kernels) out.push_back(models::dense_kernel_name(k));
  return out;
}

bool parse_bool(const std::string& s, bool* out) {
  if (s == "true" || s == "True" || s == "1") return (*out = true), true;
  if (s == "false" || s == "False" || s == "0") return (*out = false), true;
  return false;
}

// Parses the flags (with `x_name` = `x_value` substituted); "" or an error.
std::string parse_config(const std::string& x_name, const std::string& x_value, Config* c) {
  std::map<std::string, std::string> v = {
      {"world_size", FLAGS_world_size},     {"batch", FLAGS_batch},
      {"state_size", FLAGS_state_size},     {"nlayers", FLAGS_nlayers},
      {"out_features", FLAGS_out_features}, {"episodes", FLAGS_episodes},
      {"episode_steps", FLAGS_episode_steps}};
  if (!x_name.empty()) v[x_name] = x_value;
  auto integer = [&](const char* name, int64_t min, int64_t* out) -> std::string {
    if (!absl::SimpleAtoi(v[name], out) || *out < min) {
      return absl::StrCat("--", name, "=", v[name], ": expected an integer >= ", min);
    }
    return "";
  };
  int64_t ws = 0;
  for (auto [name, min, out] : {std::make_tuple("world_size", 3, &ws),
                                std::make_tuple("nlayers", 0, &c->nlayers),
                                std::make_tuple("out_features", 1, &c->out_features),
                                std::make_tuple("episodes", 1, &c->episodes),
                                std::make_tuple("episode_steps", 1, &c->episode_steps)}) {
    std::string err = integer(name, min, out);
    if (!err.empty()) return err;
  }
  c->world_size = static_cast<int>(ws);
  std::string kernel_error;
  const std::vector<std::string> kernels = dense_kernels(&kernel_error);
  if (!kernel_error.empty()) return kernel_error;
  c->kernel = kernels[0];
  if (!parse_bool(v["batch"], &c->batch)) return "--batch=" + v["batch"] + ": expected true or false";
  c->state_size.clear();
  for (absl::string_view d : absl::StrSplit(v["state_size"], '-')) {
    int64_t n = 0;
    if (!absl::SimpleAtoi(d, &n) || n < 1) {
      return "--state_size=" + v["state_size"] + ": expected positive dims joined by '-'";
    }
    c->state_size.push_back(n);
  }
  return "";
}

// Which flag holds a comma list (the x axis): "" for none; error if several.
std::string x_axis_name(std::string* error) {
  const std::vector<std::pair<std::string, std::string>> flags = {
      {"world_size", FLAGS_world_size}, {"batch", FLAGS_batch},
      {"state_size", FLAGS_state_size}, {"nlayers", FLAGS_nlayers},
      {"out_features", FLAGS_out_features}, {"episodes", FLAGS_episodes},
      {"episode_steps", FLAGS_episode_steps}};
  std::vector<std::string> listed;
  for (const auto& [name, value] : flags) {
    if (value.find(',') != std::string::npos) listed.push_back(name);
  }
  if (listed.size() > 1) {
    *error = "only one flag may hold a comma list, got " + absl::StrJoin(listed, ", ");
  }
  return listed.empty() ? "" : listed[0];
}

void json_metrics(bench::Json& json, const std::vector<std::vector<double>>& samples) {
  for (int m = 0; m < 4; ++m) {
    json.key(kMetrics[m]).begin_object();
    for (int p : kPercentiles) json.key(absl::StrCat("p", p)).value(bench::percentile(samples[m], p / 100.0));
    json.end_object();
  }
}

int coordinator(const Config& c) {
  const int observers = c.world_size - 2;
  auto agent = rpc::remote<RlAgent>("agent");
  agent.rpc_sync(&RlAgent::set_world, int64_t{observers}, c.state_size, c.nlayers,
                 c.out_features, c.kernel);
  std::vector<rpc::RRef<RlObserver>> obs;
  for (int rank = 2; rank < c.world_size; ++rank) {
    obs.push_back(rpc::remote<RlObserver>(worker_name(rank), int64_t{rank}, c.state_size, c.batch));
  }
  std::vector<std::vector<double>> samples(4);
  int64_t requests = 0, answered = 0, valid = 0;
  // One line per configuration unless on a terminal.
  bench::Progress progress(absl::StrFormat("rpc_rl: world_size %d batch %s: episode", c.world_size,
                                           c.batch ? "true" : "false"),
                           c.episodes, 1);
  for (int64_t ep = 0; ep < c.episodes; ++ep) {
    const auto start = Clock::now();
    rpc::SyncCallScope waited_here;  // this thread reads the episode's replies
    std::vector<rpc::Future<std::tuple<at::Tensor, std::vector<double>, std::vector<double>, int64_t>>>
        futs;
    for (auto& ob : obs) {
      futs.push_back(ob.rpc_async(rpc::CallOptions{absl::Seconds(FLAGS_timeout_s)}, &RlObserver::run_ob_episode, agent, c.episode_steps,
                                  c.out_features));
    }
    for (auto& ret : rpc::wait_all(futs)) {
      auto& [rewards, latency, throughput, ok] = ret;
      samples[2].insert(samples[2].end(), latency.begin(), latency.end());
      samples[3].insert(samples[3].end(), throughput.begin(), throughput.end());
      requests += static_cast<int64_t>(latency.size());
      valid += ok;
    }
    auto [latency, throughput, n] = agent.rpc_sync(&RlAgent::finish_episode);
    samples[0].insert(samples[0].end(), latency.begin(), latency.end());
    samples[1].insert(samples[1].end(), throughput.begin(), throughput.end());
    answered += n;
    progress.update(ep + 1, absl::StrFormat("last episode %.3f s", seconds_since(start)));
  }
  bench::Json json;
  json.begin_object();
  json.versions();
  json_metrics(json, samples);
  // The samples the percentiles come from.
  json.key("samples").begin_object();
  for (int m = 0; m < 4; ++m) {
    json.key(kMetrics[m]).begin_array();
    for (double v : samples[m]) json.value(v);
    json.end_array();
  }
  json.end_object();
  json.key("requests").value(requests).key("answered").value(answered).key("valid_actions").value(valid);
  json.end_object();
  std::string error;
  if (!bench::write_result(json, &error)) {
    std::fprintf(stderr, "rpc_rl: cannot hand the results back: %s\n", error.c_str());
    return 1;
  }
  return requests == answered && valid == requests ? 0 : 3;
}

int worker(const Config& c) {
  at::set_num_threads(1);  // many processes share the cores (the reference does the same)
  const int rank = bench::env_rank();
  rpc::RpcBackendOptions options = bench::backend_options();
  options.allow_insecure = ddprpc::benchmarks::allow_insecure();
  options.num_worker_threads = FLAGS_num_worker_threads;
  options.rpc_timeout = absl::Seconds(FLAGS_rpc_timeout_s);
  rpc::init_rpc(worker_name(rank), rank, c.world_size, options);
  int rc = 0;
  if (rank == 0) {
    try {
      rc = coordinator(c);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "rpc_rl: coordinator failed: %s\n", e.what());
      rc = 1;
    }
  }
  rpc::shutdown(/*graceful=*/rc == 0);
  return rc;
}

// metric -> percentile -> value, from one result object (ours or the
// reference's, which share the shape).
using Figures = std::map<std::string, std::map<int, double>>;

// The p50 of `metric` in `figures`; 0 when missing.
double p50(const Figures& figures, const std::string& metric) {
  const auto m = figures.find(metric);
  if (m == figures.end()) return 0;
  const auto v = m->second.find(50);
  return v == m->second.end() ? 0 : v->second;
}

Figures parse_figures(const bench::JsonValue& result) {
  Figures out;
  for (const char* metric : kMetrics) {
    for (int p : kPercentiles) {
      const bench::JsonValue* v = bench::json_at(result, {metric, absl::StrCat("p", p)});
      if (v != nullptr && v->kind_case() == bench::JsonValue::kNumberValue) {
        out[metric][p] = v->number_value();
      }
    }
  }
  return out;
}

std::string format_value(int metric, double v) {
  return metric % 2 == 0 ? absl::StrFormat("%.5f", v) : absl::StrFormat("%.0f", v);
}

// The table of PyTorch's launcher: one row per x value, four metrics x four percentiles.
void print_table(const std::string& x_name, const std::vector<std::string>& xs,
                 const std::vector<Figures>& rows) {
  const int w = 9;
  const std::string x_label = x_name.empty() ? "" : x_name + " |";
  const int xw = std::max<int>(w, x_label.size() + 1);
  std::string heading = absl::StrFormat("%-*s", xw, x_label), sub = std::string(xw, ' ');
  for (const char* metric : kMetrics) {
    heading += absl::StrFormat("%-*s", 4 * w, metric);
    for (int p : kPercentiles) sub += absl::StrFormat("%-*s", w, absl::StrCat("p", p));
  }
  std::printf("%s\n%s\n", heading.c_str(), sub.c_str());
  for (size_t i = 0; i < rows.size(); ++i) {
    std::string line = absl::StrFormat("%-*s", xw, x_name.empty() ? "" : xs[i]);
    for (int m = 0; m < 4; ++m) {
      for (int p : kPercentiles) {
        auto it = rows[i].find(kMetrics[m]);
        const bool has = it != rows[i].end() && it->second.count(p) > 0;
        line += absl::StrFormat("%-*s", w, has ? format_value(m, it->second.at(p)) : "-");
      }
    }
    std::printf("%s\n", line.c_str());
  }
}

// One run of ours over every x value with `kernel`: the figures per x and
// each coordinator's JSON (with its x value). False after printing why not.
bool run_ours(int argc, char** argv, const std::string& x_name, const std::vector<std::string>& xs,
              const std::vector<Config>& configs, const std::string& kernel,
              std::vector<Figures>* figures, google::protobuf::ListValue* results) {
  for (size_t i = 0; i < configs.size(); ++i) {
    bench::RolesOptions launch;
    launch.nprocs = configs[i].world_size;
    if (!x_name.empty()) launch.args.push_back("--" + x_name + "=" + xs[i]);
    launch.args.push_back("--dense_kernel=" + kernel);
    launch.master_addr = FLAGS_master_addr;
    launch.master_port = FLAGS_master_port;
    launch.timeout = absl::Seconds(FLAGS_timeout_s);
    launch.grace_period = absl::Seconds(10);
    std::fprintf(stderr, "rpc_rl: %s%s%s: %d processes, policy on %s\n", x_name.c_str(),
                 x_name.empty() ? "" : "=", xs[i].c_str(), configs[i].world_size, kernel.c_str());
    const bench::RolesResult r = bench::run_roles(argc, argv, launch);
    bench::JsonValue result = r.result;
    if (r.exit_code != 0) {
      std::fprintf(stderr, "rpc_rl: failed%s: %s\n",
                   r.failed_rank < 0 ? "" : (" on " + worker_name(r.failed_rank)).c_str(),
                   r.exit_code == 3 ? "some requests were not answered with a valid action"
                                    : r.message.c_str());
      return false;
    }
    if (!r.has_result || !result.has_struct_value()) {
      std::fprintf(stderr, "rpc_rl: the coordinator's result is not a JSON object: %s\n",
                   r.result_error.c_str());
      return false;
    }
    figures->push_back(parse_figures(result));
    if (!x_name.empty()) {
      (*result.mutable_struct_value()->mutable_fields())[x_name].set_string_value(xs[i]);
    }
    *results->add_values() = std::move(result);
  }
  return true;
}

// PyTorch's benchmark on the same configuration: its figures per x and its
// report (null when it failed, after printing why).
std::vector<Figures> run_pytorch(const std::string& script, size_t xs, bench::JsonValue* report) {
  std::fprintf(stderr, "rpc_rl: running PyTorch's benchmark (%s), same configuration\n",
               script.c_str());
  bench::ReferenceRun run = bench::run_reference(
      script,
      {"--world_size", FLAGS_world_size, "--batch", FLAGS_batch, "--state_size", FLAGS_state_size,
       "--nlayers", FLAGS_nlayers, "--out_features", FLAGS_out_features, "--episodes",
       FLAGS_episodes, "--episode_steps", FLAGS_episode_steps, "--master_addr", FLAGS_master_addr,
       "--master_port", absl::StrCat(rpc::pick_free_port())},
      "--output_file_path");
  std::vector<Figures> theirs;
  if (const bench::JsonValue* results = bench::json_at(run.report, {"benchmark_results"})) {
    for (const auto& r : results->list_value().values()) theirs.push_back(parse_figures(r));
  }
  if (!run.ok() || theirs.size() != xs) {
    std::printf("PyTorch's benchmark failed (%s)\n", run.failure().c_str());
    theirs.clear();
    report->set_null_value(google::protobuf::NULL_VALUE);
    return theirs;
  }
  *report = std::move(run.report);
  return theirs;
}

int launcher(int argc, char** argv) {
  std::string error;
  const std::string x_name = x_axis_name(&error);
  std::vector<std::string> xs = {""};
  if (!x_name.empty()) {
    gflags::CommandLineFlagInfo info;
    gflags::GetCommandLineFlagInfo(x_name.c_str(), &info);
    xs = absl::StrSplit(info.current_value, ',', absl::SkipWhitespace());
  }
  std::vector<Config> configs;
  for (const auto& x : xs) {
    Config c;
    if (error.empty()) error = parse_config(x_name, x, &c);
    configs.push_back(c);
  }
  const std::vector<std::string> kernels = dense_kernels(&error);
  if (error.empty() && FLAGS_pairs < 1) error = "--pairs must be at least 1";
  if (!error.empty()) {
    std::fprintf(stderr, "rpc_rl: %s\n", error.c_str());
    return 2;
  }
  std::printf("--------------------------------------------------------------\n");
  std::printf("ddprpc rpc benchmark reinforcement learning suite\n");
  std::printf("--------------------------------------------------------------\n");
  std::printf("master_addr : %s\nmaster_port : %s\nbatch : %s\nstate_size : %s\nnlayers : %s\n"
              "out_features : %s\nepisodes : %s\nepisode_steps : %s\noutput_file_path : %s\n"
              "x_axis_name : %s\ndense_kernel : %s\npairs : %d\n"
              "percentiles : numpy's linear interpolation, both sides\nallocator : %s\n",
              FLAGS_master_addr.c_str(),
              FLAGS_master_port == 0 ? "(free port)" : absl::StrCat(FLAGS_master_port).c_str(),
              FLAGS_batch.c_str(), FLAGS_state_size.c_str(), FLAGS_nlayers.c_str(),
              FLAGS_out_features.c_str(), FLAGS_episodes.c_str(), FLAGS_episode_steps.c_str(),
              FLAGS_output_file_path.c_str(), x_name.empty() ? "(none)" : x_name.c_str(),
              FLAGS_dense_kernel.c_str(), FLAGS_pairs, bench::allocator_name().c_str());
  std::printf("versions : %s\n", bench::versions().c_str());
  std::fflush(stdout);

  const std::string script = bench::source_path("benchmarks/reference/rpc_rl.py");
  const bool pytorch = FLAGS_pytorch && !script.empty();
  // Per round, the figures of each x.
  bench::RoundsPlan plan;
  plan.name = "rpc_rl";
  plan.rounds = FLAGS_pairs;
  plan.variants = kernels;
  plan.with_theirs = pytorch;
  bench::Rounds<std::vector<Figures>> rounds;
  std::map<std::string, google::protobuf::ListValue> ours_json;  // the first round's
  bench::JsonValue theirs_json;  // PyTorch's first report as its script wrote it; null if none
  theirs_json.set_null_value(google::protobuf::NULL_VALUE);
  const int rc = bench::run_rounds<std::vector<Figures>>(
      plan,
      [&](const std::string& kernel, int round, std::vector<Figures>* figures) {
        google::protobuf::ListValue results;
        if (!run_ours(argc, argv, x_name, xs, configs, kernel, figures, &results)) return 1;
        if (round == 0) {
          std::printf("\nddprpc, policy on %s:\n", kernel.c_str());
          print_table(x_name, xs, *figures);
          std::fflush(stdout);
          ours_json[kernel] = std::move(results);
        }
        return 0;
      },
      [&](int round, std::vector<Figures>* figures) {
        bench::JsonValue report;
        *figures = run_pytorch(script, xs.size(), &report);
        if (figures->empty()) return false;  // it failed: no ratio to take
        if (round == 0) {
          std::printf("\n------------------ PyTorch (same machine, same run) ------------------\n");
          print_table(x_name, xs, *figures);
          theirs_json = std::move(report);
        }
        return true;
      },
      &rounds);
  if (rc != 0) return rc;
  if (!pytorch) {
    std::printf("\nPyTorch's benchmark not run (--pytorch=false or reference script not found)\n");
  }

  // Ratios at p50, per x and kernel: the median over the rounds.
  bench::JsonValue ratios_json;
  auto& ratio_fields = *ratios_json.mutable_struct_value()->mutable_fields();
  if (!rounds.theirs.empty()) {
    std::printf("\nddprpc / PyTorch at p50 (throughputs; > 1: ddprpc faster), median of %zu "
                "interleaved round(s):\n",
                rounds.theirs.size());
    for (size_t i = 0; i < xs.size(); ++i) {
      for (const std::string& kernel : kernels) {
        std::string line = absl::StrFormat(
            "  %s%s%s policy on %-7s (%s):", x_name, x_name.empty() ? "" : "=", xs[i], kernel,
            kernel == "aten" ? "runtimes alone" : "the product");
        for (const char* metric : {"agent throughput", "observer throughput"}) {
          const bench::RoundSpeedups ratios = rounds.speedups(
              kernel,
              [&](const std::vector<Figures>& round) { return p50(round[i], metric); },
              /*higher_is_better=*/true);
          absl::StrAppendFormat(&line, " %s %.2fx [%s]", metric, ratios.median(), ratios.list());
          ratio_fields[absl::StrCat(kernel, " ", x_name, "=", xs[i], " ", metric)] = ratios.json();
        }
        std::printf("%s\n", line.c_str());
      }
    }
  }

  bench::JsonValue report;
  auto& fields = *report.mutable_struct_value()->mutable_fields();
  auto& args = *fields["benchmark_args"].mutable_struct_value()->mutable_fields();
  for (const auto& [name, value] :
       std::vector<std::pair<std::string, std::string>>{{"world_size", FLAGS_world_size},
                                                        {"batch", FLAGS_batch},
                                                        {"state_size", FLAGS_state_size},
                                                        {"nlayers", FLAGS_nlayers},
                                                        {"out_features", FLAGS_out_features},
                                                        {"episodes", FLAGS_episodes},
                                                        {"episode_steps", FLAGS_episode_steps},
                                                        {"dense_kernel", FLAGS_dense_kernel}}) {
    args[name].set_string_value(value);
  }
  args["cpus"].set_number_value(bench::cpu_count());
  args["pairs"].set_number_value(FLAGS_pairs);
  fields["x_axis_name"].set_string_value(x_name);
  // The plot reads benchmark_results: the first kernel's run.
  *fields["benchmark_results"].mutable_list_value() = ours_json[kernels[0]];
  auto& by_kernel = *fields["benchmark_results_by_kernel"].mutable_struct_value()->mutable_fields();
  for (auto& [kernel, results] : ours_json) *by_kernel[kernel].mutable_list_value() = std::move(results);
  fields["pytorch"] = std::move(theirs_json);
  fields["ratios_p50"] = std::move(ratios_json);
  const std::string path = bench::output_path(FLAGS_output_file_path);
  if (!bench::write_json(report, path)) return 1;
  std::printf("\nwrote %s (chart it: ./bazelw run //benchmarks:plot -- %s)\n", path.c_str(),
              path.c_str());
  return 0;
}

}  // namespace
}  // namespace ddprpc

// After main's one-time set-up; also where ranks forked by run_roles start.
int rank_main(int argc, char** argv) {
  ddprpc::benchmarks::keep_freed_memory();
  ddprpc::benchmarks::parse_flags(&argc, &argv, "benchmarks/rpc_rl");
  if (FLAGS_dense_kernel.empty()) FLAGS_dense_kernel = ddprpc::models::default_dense_kernels();
  if (ddprpc::benchmarks::env_rank() >= 0) {
    ddprpc::Config c;
    const std::string error = ddprpc::parse_config("", "", &c);
    if (!error.empty()) {
      std::fprintf(stderr, "rpc_rl: %s\n", error.c_str());
      return 2;
    }
    return ddprpc::worker(c);
  }
  return ddprpc::launcher(argc, argv);
}

int main(int argc, char** argv) {
  gflags::SetUsageMessage(
      "RPC throughput/latency benchmark for reinforcement learning (coordinator, agent, "
      "observers), with PyTorch's benchmark run on the same configuration.\n"
      "  usage: rpc_rl [--world_size=3,5,10] [--batch=true] ...  (one flag may hold a comma "
      "list: the x axis)");
  return ddprpc::benchmarks::run_main(argc, argv, &rank_main);
}
