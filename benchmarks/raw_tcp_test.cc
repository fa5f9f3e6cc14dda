// The raw TCP round trips that rpc_pingpong prints as the network's bound:
// every byte comes back, each round is timed once, several streams split
// the bytes between them, and a peer that is not there is an error.
#include "benchmarks/raw_tcp.h"

#include <unistd.h>

#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace bench = ddprpc::benchmarks;

namespace {

void round_trips(int streams, int64_t bytes, int spin_us = 0) {
  bench::RawTcpListener listener;
  ASSERT_TRUE(bench::raw_tcp_listen("127.0.0.1", &listener).ok());
  ASSERT_GT(listener.port, 0);
  absl::Status echoed;
  std::thread echo([&] {
    echoed = bench::raw_tcp_echo("127.0.0.1", listener.port, streams, bytes, 2 + 5, spin_us);
  });
  std::vector<double> micros;
  const absl::Status s =
      bench::raw_tcp_round_trips(listener, streams, bytes, 2, 5, &micros, spin_us);
  echo.join();
  EXPECT_TRUE(s.ok()) << s;
  EXPECT_TRUE(echoed.ok()) << echoed;
  ASSERT_EQ(micros.size(), 5u);
  for (double us : micros) EXPECT_GT(us, 0);
}

TEST(RawTcpTest, OneStreamEchoesEveryByte) { round_trips(1, 1 << 20); }

// 3 streams over a size they do not divide: the last one takes what is left.
TEST(RawTcpTest, SeveralStreamsSplitTheBytes) { round_trips(3, (4 << 20) + 7); }

TEST(RawTcpTest, MoreStreamsThanBytes) { round_trips(4, 2); }

// Reads that look without sleeping first still get every byte, small or
// large (the echo checks them).
TEST(RawTcpTest, SpinningReadsEchoEveryByte) {
  round_trips(1, 16, /*spin_us=*/200);
  round_trips(3, (4 << 20) + 7, /*spin_us=*/200);
}

TEST(RawTcpTest, NoListenerIsAnError) {
  bench::RawTcpListener listener;
  ASSERT_TRUE(bench::raw_tcp_listen("127.0.0.1", &listener).ok());
  ::close(listener.fd);  // nobody listens on the port any more
  EXPECT_FALSE(bench::raw_tcp_echo("127.0.0.1", listener.port, 1, 16, 1).ok());
  EXPECT_FALSE(bench::raw_tcp_echo("not an address", listener.port, 1, 16, 1).ok());
  EXPECT_FALSE(bench::raw_tcp_listen("::1", &listener).ok());  // IPv4 only
}

// An echo that leaves after the first round ends the measurement with an
// error, at once (the connection closes), not after the silence timeout.
TEST(RawTcpTest, AnEchoThatLeavesIsAnError) {
  bench::RawTcpListener listener;
  ASSERT_TRUE(bench::raw_tcp_listen("127.0.0.1", &listener).ok());
  std::thread echo([&] { bench::raw_tcp_echo("127.0.0.1", listener.port, 1, 1024, 1).IgnoreError(); });
  std::vector<double> micros;
  const absl::Status s = bench::raw_tcp_round_trips(listener, 1, 1024, 0, 3, &micros);
  echo.join();
  EXPECT_FALSE(s.ok());
  EXPECT_EQ(micros.size(), 1u);
}

}  // namespace
