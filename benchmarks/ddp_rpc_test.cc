// Runs //benchmarks:ddp_rpc as a user would (a subprocess): a small run
// prints a parsable table and JSON; the same run with every role started on
// its own (as a multi-host launcher would) does too; --check_convergence
// passes when training works and fails when it cannot learn (lr 0); killing
// a parameter server mid-run makes it fail promptly with a message naming
// the server and the call, leaving no process behind.
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <regex>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "benchmarks/testing/subprocess.h"
#include "models/linear.h"
#include "gtest/gtest.h"
#include "rpc/rendezvous/launch.h"

namespace {

using namespace ddprpc::benchmarks::testing;

const std::string kBinary = "benchmarks/ddp_rpc";
const std::vector<std::string> kSmall = {"--trainers=2", "--ps=2", "--pytorch=false",
                                         "--dense_kernel=xnnpack"};
const char* const kPcts[] = {"p50", "p75", "p90", "p95"};

std::vector<std::string> with(std::vector<std::string> args, const std::vector<std::string>& more) {
  args.insert(args.end(), more.begin(), more.end());
  return args;
}

// The figures of one run ("ddprpc" or an entry of "ddprpc_by_kernel"),
// checked against its raw samples: every trainer has `iters` measured
// iterations; All takes the slowest trainer's seconds and the sum of the
// examples per iteration; each percentile is numpy's of those samples
// (sec/iter at p, ex/sec at 100 - p of examples / seconds).
void expect_figures_from_samples(const JsonValue& run, int iters, const std::string& where) {
  std::vector<double> slowest(iters, 0.0), summed(iters, 0.0);
  for (const char* key : {"trainer0", "trainer1", "all"}) {
    std::vector<double> sec = json_numbers(run, {key, "seconds"});
    std::vector<double> ex = json_numbers(run, {key, "examples"});
    ASSERT_EQ(sec.size(), static_cast<size_t>(iters)) << where << " " << key;
    ASSERT_EQ(ex.size(), static_cast<size_t>(iters)) << where << " " << key;
    if (std::string(key) == "all") {
      for (int i = 0; i < iters; ++i) {
        EXPECT_NEAR(sec[i], slowest[i], 1e-5 * slowest[i]) << where << " all, iteration " << i;
        EXPECT_EQ(ex[i], summed[i]) << where << " all, iteration " << i;
      }
    } else {
      for (int i = 0; i < iters; ++i) {
        EXPECT_GT(sec[i], 0) << where << " " << key;
        // 10 batches of 20..50 indices, bags of 1..10 of them: 20..500 examples.
        EXPECT_GE(ex[i], 20) << where << " " << key;
        EXPECT_LE(ex[i], 500) << where << " " << key;
        slowest[i] = std::max(slowest[i], sec[i]);
        summed[i] += ex[i];
      }
    }
    std::vector<double> rate;
    for (int i = 0; i < iters; ++i) rate.push_back(ex[i] / sec[i]);
    for (int p : {50, 75, 90, 95}) {
      const std::string name = absl::StrCat("p", p);
      const double want_sec = numpy_percentile(sec, p), want_ex = numpy_percentile(rate, 100 - p);
      EXPECT_NEAR(json_number(run, {key, name, "sec_per_iter"}), want_sec, 1e-4 * want_sec)
          << where << " " << key << " " << name;
      EXPECT_NEAR(json_number(run, {key, name, "ex_per_sec"}), want_ex, 1e-4 * want_ex)
          << where << " " << key << " " << name;
    }
  }
}

// The table of a 2-trainer run has Trainer0, Trainer1 and All rows per
// kernel, each printing its JSON's figures; the JSON's figures follow from
// its samples.
void expect_table_and_json(const std::string& out, const std::string& json_path, int iters,
                           const std::vector<std::string>& kernels = {"xnnpack"}) {
  JsonValue report;
  std::string error;
  const std::string j = read_file(json_path);
  ASSERT_TRUE(parse_json(j, &report, &error)) << error << "\n" << j;
  EXPECT_EQ(json_number(report, {"config", "trainers"}), 2) << j;
  const std::regex row(R"((Trainer0|Trainer1|All):\s+p50: ([0-9.]+)s\s+([0-9]+)/s\s+p75: ([0-9.]+)s\s+([0-9]+)/s\s+p90: ([0-9.]+)s\s+([0-9]+)/s\s+p95: ([0-9.]+)s\s+([0-9]+)/s)");
  size_t at = 0;
  for (const std::string& kernel : kernels) {
    const std::string heading = "dense layers on " + kernel;
    at = out.find(heading, at);
    ASSERT_NE(at, std::string::npos) << heading << " missing:\n" << out;
    const JsonValue* run = json_at(report, {"ddprpc_by_kernel", kernel});
    ASSERT_NE(run, nullptr) << kernel << ": " << j;
    expect_figures_from_samples(*run, iters, kernel);
    std::string table = out.substr(at);
    std::sregex_iterator it(table.begin(), table.end(), row);
    for (const char* key : {"trainer0", "trainer1", "all"}) {
      ASSERT_NE(it, std::sregex_iterator()) << kernel << " " << key << ":\n" << out;
      const std::smatch m = *it;  // a copy: the iterator moves on below
      ++it;
      for (int p = 0; p < 4; ++p) {
        EXPECT_NEAR(std::stod(m[2 + 2 * p].str()), json_number(*run, {key, kPcts[p], "sec_per_iter"}),
                    0.0006) << m[0];
        EXPECT_NEAR(std::stod(m[3 + 2 * p].str()), json_number(*run, {key, kPcts[p], "ex_per_sec"}),
                    0.6) << m[0];
      }
    }
  }
  // "ddprpc" is the first kernel's run.
  for (const char* key : {"trainer0", "trainer1", "all"}) {
    EXPECT_EQ(json_numbers(report, {"ddprpc", key, "seconds"}),
              json_numbers(report, {"ddprpc_by_kernel", kernels[0], key, "seconds"}));
  }
}

TEST(DdpRpcBenchmarkTest, SmallRunPrintsTableAndJson) {
  const std::string json = test_tmp("small.json");
  // Both kernels (the default), one run each.
  Child c(binary(kBinary),
          {"--trainers=2", "--ps=2", "--pytorch=false", "--iters=4", "--warmup=1", "--json=" + json},
          "small");
  ASSERT_EQ(c.wait_for(absl::Minutes(3)), 0) << c.err();
  const std::string out = c.out();
  if (ddprpc::models::xnnpack_linear_available()) {
    expect_table_and_json(out, json, 4, {"xnnpack", "aten"});
  } else {
    expect_table_and_json(out, json, 4, {"aten"});
  }
  for (const char* info : {"libtorch 2.", "gRPC 1.", "Gloo (headers 0.", "CPUs: ", "PyTorch's side: torch 2."}) {
    EXPECT_NE(out.find(info), std::string::npos) << info << " missing from the Info header:\n" << out;
  }
  // The binary runs on tcmalloc (//third_party:tcmalloc), except in the
  // sanitizer builds, which keep their own allocator.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  const char* allocator = "allocator: glibc malloc";
#else
  const char* allocator = "allocator: tcmalloc 2.";
#endif
  EXPECT_NE(out.find(allocator), std::string::npos) << allocator << " missing:\n" << out;
}

// --hosts=3 (root): both sides' ranks on three network namespaces, on
// their network paths; the run compares them and leaves no namespace.
TEST(DdpRpcBenchmarkTest, AcrossNetworkNamespacesBothSidesRunAndCompare) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root (ip netns)";
  const std::string json = test_tmp("hosts.json");
  Child c(binary(kBinary),
          {"--trainers=2", "--ps=2", "--iters=3", "--warmup=1", "--dense_kernel=aten",
           "--hosts=3", "--json=" + json},
          "hosts");
  ASSERT_EQ(c.wait_for(absl::Minutes(4)), 0) << c.err();
  const std::string out = c.out();
  for (const char* line :
       {"processes on 3 network namespaces on a bridge", "same-host transport off",
        "same-host allreduce off", "PyTorch: TensorPipe uv + basic",
        "All p50 sec/iter, PyTorch / ddprpc with aten"}) {
    EXPECT_NE(out.find(line), std::string::npos) << line << " missing:\n" << out;
  }
  EXPECT_EQ(out.find("PyTorch reference failed"), std::string::npos) << out;
  // Every namespace this run made is gone.
  const std::string prefix = absl::StrCat("ddprpc-bench-", c.pid(), "-");
  std::string left;
  if (FILE* ls = ::popen("ip netns list", "r")) {
    char buf[256];
    while (std::fgets(buf, sizeof(buf), ls)) left += buf;
    ::pclose(ls);
  }
  EXPECT_EQ(left.find(prefix), std::string::npos) << left;
}

// As under a multi-host launcher: each rank its own process, told its place
// by --rank, --world_size and --master_port instead of the local launch.
TEST(DdpRpcBenchmarkTest, RolesStartedOnTheirOwnRunTheSameBenchmark) {
  const std::string json = test_tmp("roles.json");
  const std::string port = absl::StrCat(ddprpc::rpc::pick_free_port());
  std::vector<std::unique_ptr<Child>> ranks;
  for (int rank = 0; rank < 5; ++rank) {  // trainers 0-1, ps 2-3, master 4
    ranks.push_back(std::make_unique<Child>(
        binary(kBinary),
        with(kSmall, {"--iters=3", "--warmup=1", "--json=" + json, absl::StrCat("--rank=", rank),
                      "--world_size=5", "--master_port=" + port}),
        absl::StrCat("roles", rank)));
  }
  for (int rank = 0; rank < 5; ++rank) {
    EXPECT_EQ(ranks[rank]->wait_for(absl::Minutes(3)), 0)
        << "rank " << rank << ":\n" << tail(ranks[rank]->err());
  }
  expect_table_and_json(ranks[4]->out(), json, 3);
}

TEST(DdpRpcBenchmarkTest, WorldSizeThatDoesNotMatchTheRolesIsRefused) {
  Child c(binary(kBinary), with(kSmall, {"--rank=0", "--world_size=4", "--master_port=1"}),
          "mismatch");
  EXPECT_EQ(c.wait_for(absl::Seconds(30)), 2);
  EXPECT_NE(c.err().find("the world size must be 5"), std::string::npos) << c.err();
}

// The mean loss of the first and the last iteration from the report.
std::pair<double, double> first_and_last_loss(const std::string& out) {
  std::smatch m;
  std::regex re(R"(mean loss ([0-9.]+) in the first iteration, ([0-9.]+) in the last)");
  if (!std::regex_search(out, m, re)) return {0, 0};
  return {std::stod(m[1].str()), std::stod(m[2].str())};
}

TEST(DdpRpcBenchmarkTest, CheckConvergenceSeesTheLossFallAndTheTablesChange) {
  const std::string json = test_tmp("converge.json");
  Child c(binary(kBinary),
          with(kSmall, {"--iters=10", "--warmup=0", "--check_convergence", "--json=" + json}),
          "converge");
  ASSERT_EQ(c.wait_for(absl::Minutes(3)), 0) << tail(c.out()) << tail(c.err());
  const std::string out = c.out();
  const auto [first, last] = first_and_last_loss(out);
  EXPECT_GT(first, 1.5) << out;  // ~ln(8) before any training
  EXPECT_LT(last, 0.9 * first) << out;
  for (const char* ps : {"ps0", "ps1"}) {
    std::smatch m;
    ASSERT_TRUE(std::regex_search(out, m, std::regex(absl::StrCat(ps, R"(: ([0-9]+) of 300 embedding rows changed)"))))
        << out;
    EXPECT_GT(std::stoi(m[1].str()), 0) << out;
  }
  EXPECT_NE(out.find("Convergence check: passed"), std::string::npos) << out;
  EXPECT_NE(read_file(json).find("\"convergence\""), std::string::npos);
}

// --lookups=sequential reaches the same tables one after another: with one
// trainer (no concurrent updates on the servers) the same seed trains to the
// same losses as concurrent lookups.
TEST(DdpRpcBenchmarkTest, SequentialLookupsTrainTheSameModel) {
  std::vector<std::pair<double, double>> losses;
  for (const char* lookups : {"concurrent", "sequential"}) {
    Child c(binary(kBinary),
            {"--trainers=1", "--ps=2", "--pytorch=false", "--dense_kernel=aten", "--iters=10",
             "--warmup=0", "--check_convergence", std::string("--lookups=") + lookups,
             "--json=" + test_tmp(std::string(lookups) + ".json")},
            lookups);
    ASSERT_EQ(c.wait_for(absl::Minutes(3)), 0) << tail(c.err());
    EXPECT_NE(c.out().find(std::string("lookups: ") + lookups), std::string::npos) << c.out();
    losses.push_back(first_and_last_loss(c.out()));
    EXPECT_GT(losses.back().first, 0) << c.out();
  }
  EXPECT_EQ(losses[0], losses[1]);
}

TEST(DdpRpcBenchmarkTest, UnknownKernelOrLookupsIsRefused) {
  for (const char* flag : {"--dense_kernel=xnnpack,blas", "--lookups=parallel", "--pairs=0"}) {
    Child c(binary(kBinary), with(kSmall, {flag}), "refused");
    EXPECT_EQ(c.wait_for(absl::Seconds(30)), 2) << flag;
    EXPECT_NE(c.err().find("see --help"), std::string::npos) << c.err();
  }
}

// --sparse: the tables' gradients are sparse and training still learns;
// with 100k rows per table, only rows that batches looked up change.
TEST(DdpRpcBenchmarkTest, SparseGradientsTrainTheTables) {
  Child learns(binary(kBinary),
               with(kSmall, {"--sparse", "--iters=10", "--warmup=0", "--check_convergence",
                             "--json=" + test_tmp("sparse.json")}),
               "sparse");
  ASSERT_EQ(learns.wait_for(absl::Minutes(3)), 0) << tail(learns.out()) << tail(learns.err());
  EXPECT_NE(learns.out().find("sparse embedding gradients"), std::string::npos) << learns.out();
  EXPECT_NE(learns.out().find("Convergence check: passed"), std::string::npos) << learns.out();
  // Too many rows to learn in 3 iterations (exit 3 is fine); what changed is
  // at most what 2 trainers x 3 iterations x 10 batches x 50 indices named.
  Child big(binary(kBinary),
            with(kSmall, {"--sparse", "--num_embeddings=100000", "--iters=3", "--warmup=0",
                          "--check_convergence", "--json=" + test_tmp("sparse_big.json")}),
            "sparse_big");
  const int code = big.wait_for(absl::Minutes(3));
  EXPECT_TRUE(code == 0 || code == 3) << tail(big.err());
  std::smatch m;
  const std::string out = big.out();
  ASSERT_TRUE(std::regex_search(out, m, std::regex(R"(ps0: ([0-9]+) of 100000 embedding rows changed)")))
      << out;
  EXPECT_GT(std::stoi(m[1].str()), 0);
  EXPECT_LE(std::stoi(m[1].str()), 3000);
}

// The check can fail: with a zero learning rate nothing is learned.
TEST(DdpRpcBenchmarkTest, CheckConvergenceFailsWhenNothingIsLearned) {
  Child c(binary(kBinary),
          with(kSmall, {"--iters=3", "--warmup=0", "--check_convergence", "--lr=0",
                        "--json=" + test_tmp("frozen.json")}),
          "frozen");
  EXPECT_EQ(c.wait_for(absl::Minutes(3)), 3) << tail(c.err());
  const std::string out = c.out();
  EXPECT_NE(out.find("ps0: 0 of 300 embedding rows changed"), std::string::npos) << out;
  EXPECT_NE(out.find("Convergence check: FAILED"), std::string::npos) << out;
  EXPECT_NE(c.err().find("convergence check failed"), std::string::npos) << tail(c.err());
}

// --elastic --kill: trainer1 of three ends itself at iteration 3; the run
// completes with the survivors, marks trainer1 lost, reports epoch 2 and
// the dropped batch, and still converges.
TEST(DdpRpcBenchmarkTest, ElasticRunTrainsOnWithoutAKilledTrainer) {
  const std::string json = test_tmp("elastic.json");
  Child c(binary(kBinary),
          {"--trainers=3", "--ps=2", "--pytorch=false", "--dense_kernel=xnnpack", "--iters=10",
           "--warmup=0", "--elastic", "--kill=trainer1@iter3", "--check_convergence",
           "--rpc_timeout_s=20", "--json=" + json},
          "elastic");
  ASSERT_EQ(c.wait_for(absl::Minutes(3)), 0) << tail(c.out()) << tail(c.err());
  const std::string out = c.out();
  EXPECT_TRUE(std::regex_search(out, std::regex(R"(Trainer1:  lost: .*trainer1)"))) << out;
  EXPECT_TRUE(std::regex_search(out, std::regex(R"(All \(2 of 3\):  p50:)"))) << out;
  EXPECT_TRUE(std::regex_search(
      out, std::regex(R"(Elastic: membership epoch 2 at the end; trainers lost: trainer1; )"
                      R"(trainers joined: none; parameter servers lost: none; )"
                      R"(batches dropped on each survivor: 1 at most)")))
      << out;
  EXPECT_NE(out.find("Convergence check: passed"), std::string::npos) << out;
  JsonValue report;
  std::string error;
  ASSERT_TRUE(parse_json(read_file(json), &report, &error)) << error;
  EXPECT_EQ(json_number(report, {"ddprpc", "elastic", "epoch"}), 2);
  EXPECT_EQ(json_number(report, {"ddprpc", "elastic", "batches_dropped"}), 1);
  EXPECT_TRUE(run_processes("elastic").empty()) << "orphaned benchmark processes";
}

// --elastic --kill --add: trainer1 of three ends itself at iteration 3,
// ps2 of three as iteration 6 starts, and trainer3, a standby, is called
// to join at iteration 7. The run completes: shard 2 is restored on ps0
// from the checkpoint of iteration 4 (ps2's of iteration 6 was not taken),
// the trainers re-bind to it, the updates since that checkpoint are
// counted as lost, trainer3 joins at the start of iteration 7 or a later
// one, and the run still converges.
TEST(DdpRpcBenchmarkTest, ElasticRunReplacesAKilledParameterServer) {
  const std::string json = test_tmp("elastic_ps.json");
  const std::string dir = test_tmp("checkpoints");
  ASSERT_EQ(::mkdir(dir.c_str(), 0700), 0);
  Child c(binary(kBinary),
          {"--trainers=3", "--ps=3", "--pytorch=false", "--dense_kernel=xnnpack", "--iters=12",
           "--warmup=0", "--elastic", "--kill=trainer1@iter3", "--kill=ps2@iter6", "--add=trainer@iter7",
           "--checkpoint_every=4",
           "--checkpoint_dir=" + dir, "--check_convergence", "--rpc_timeout_s=20",
           "--json=" + json},
          "elastic_ps");
  ASSERT_EQ(c.wait_for(absl::Minutes(3)), 0) << tail(c.out()) << tail(c.err());
  const std::string out = c.out();
  EXPECT_TRUE(std::regex_search(out, std::regex(R"(All \(3 of 4\):  p50:)"))) << out;
  // Epochs: trainer1 out, ps2 out, trainer3 joining, trainer3 admitted.
  EXPECT_TRUE(std::regex_search(
      out, std::regex(R"(Elastic: membership epoch 5 at the end; trainers lost: trainer1; )"
                      R"(trainers joined: trainer3 at iteration (7|8|9|1[01]); )"
                      R"(parameter servers lost: ps2; .*updates lost: [1-9][0-9]*)")))
      << out;
  EXPECT_TRUE(std::regex_search(
      out, std::regex(R"(shard 2: lost with ps2, restored on ps0 \(epoch 3\) from its replica )"
                      R"(of iteration 4 in [0-9.]+ s; [1-9][0-9]* updates lost)")))
      << out;
  EXPECT_NE(out.find("ps2 (its shard now on ps0): 300 of 300 embedding rows changed"),
            std::string::npos)
      << out;
  EXPECT_NE(out.find("Convergence check: passed"), std::string::npos) << out;
  JsonValue report;
  std::string error;
  ASSERT_TRUE(parse_json(read_file(json), &report, &error)) << error;
  EXPECT_EQ(json_number(report, {"ddprpc", "elastic", "epoch"}), 5);
  // Iterations 4 and 5 of two trainers (10 batches each), less what
  // reached neither: at least one iteration's worth.
  EXPECT_GE(json_number(report, {"ddprpc", "elastic", "updates_lost"}), 10);
  EXPECT_LE(json_number(report, {"ddprpc", "elastic", "updates_lost"}), 2 * 2 * 10 + 3);
  EXPECT_TRUE(run_processes("elastic_ps").empty()) << "orphaned benchmark processes";
}

// Faults it cannot inject are refused before anything starts.
TEST(DdpRpcBenchmarkTest, KillsItCannotInjectAreRefused) {
  for (const char* kill : {"--kill=ps5@iter3", "--kill=trainer9@iter3", "--kill=trainer1@3",
                           "--kill=master@iter3", "--kill=trainer1@iter1000", "--add=ps@iter3",
                           "--add=trainer@iter1000"}) {
    Child c(binary(kBinary), with(kSmall, {"--elastic", kill}), "badkill");
    EXPECT_EQ(c.wait_for(absl::Minutes(1)), 2) << kill << "\n" << tail(c.err());
    EXPECT_TRUE(c.err().find("--kill") != std::string::npos ||
                c.err().find("--add") != std::string::npos)
        << kill << "\n" << tail(c.err());
  }
  // A server's loss is survived only with --elastic.
  Child c(binary(kBinary), with(kSmall, {"--kill=ps0@iter3"}), "badkill");
  EXPECT_EQ(c.wait_for(absl::Minutes(1)), 2) << tail(c.err());
  EXPECT_NE(c.err().find("needs --elastic"), std::string::npos) << tail(c.err());
}

TEST(DdpRpcBenchmarkTest, KilledParameterServerFailsTheRunCleanly) {
  // Every progress update reaches stderr (as on a terminal), not 20 lines.
  ::setenv("DDPRPC_PROGRESS_TTY", "1", 1);
  Child c(binary(kBinary),
          with(kSmall, {"--iters=500", "--warmup=0", "--json=" + test_tmp("killed.json")}),
          "killed");
  // Wait until training runs, then kill ps0 (rank 2 = trainers + 0).
  absl::Time deadline = absl::Now() + absl::Minutes(2);
  while (c.err().find("iteration 2/") == std::string::npos && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(50));
  }
  ::unsetenv("DDPRPC_PROGRESS_TTY");
  pid_t ps0 = find_rank("killed", 2);
  ASSERT_GT(ps0, 0) << "ps0 not found; benchmark stderr:\n" << tail(c.err());
  absl::Time killed = absl::Now();
  kill(ps0, SIGKILL);
  int code = c.wait_for(absl::Seconds(90));
  EXPECT_NE(code, 0);
  EXPECT_NE(code, -1) << "the benchmark hung after a parameter server died";
  EXPECT_LT(absl::Now() - killed, absl::Seconds(60));
  const std::string err = c.err();
  // e.g. "rref.rpc('ddprpc.models.EmbeddingTable.forward') on worker 'ps0' failed"
  EXPECT_TRUE(std::regex_search(err, std::regex(R"(\('[A-Za-z_.]+'\) on worker 'ps0' failed)")))
      << tail(err);
  absl::SleepFor(absl::Milliseconds(500));
  EXPECT_TRUE(run_processes("killed").empty()) << "orphaned benchmark processes";
}

}  // namespace
