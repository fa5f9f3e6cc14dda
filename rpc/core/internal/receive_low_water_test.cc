#include "rpc/core/internal/receive_low_water.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <string>

#include "gtest/gtest.h"

namespace ddprpc::rpc::internal {
namespace {

// A connected pair of TCP sockets on loopback: [0] writes, [1] reads.
struct TcpPair {
  int fd[2] = {-1, -1};
  TcpPair() {
    const int listener = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof(addr);
    if (::bind(listener, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
        ::listen(listener, 1) != 0 ||
        ::getsockname(listener, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
      ::close(listener);
      return;
    }
    fd[0] = ::socket(AF_INET, SOCK_STREAM, 0);
    if (::connect(fd[0], reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0) {
      fd[1] = ::accept(listener, nullptr, nullptr);
    }
    ::close(listener);
  }
  ~TcpPair() {
    for (int f : fd) {
      if (f >= 0) ::close(f);
    }
  }
};

int mark_of(int fd) {
  int mark = 0;
  socklen_t len = sizeof(mark);
  ::getsockopt(fd, SOL_SOCKET, SO_RCVLOWAT, &mark, &len);
  return mark;
}

bool readable(int fd) {
  pollfd p{fd, POLLIN, 0};
  return ::poll(&p, 1, 200) == 1 && (p.revents & POLLIN) != 0;
}

void send_bytes(int fd, size_t n) {
  const std::string bytes(n, 'x');
  size_t sent = 0;
  while (sent < n) {
    const ssize_t k = ::send(fd, bytes.data() + sent, n - sent, 0);
    ASSERT_GT(k, 0);
    sent += static_cast<size_t>(k);
  }
}

TEST(ReceiveLowWaterTest, TheMarkIsWhatIsLeftUpToItsSize) {
  TcpPair pair;
  ASSERT_GE(pair.fd[1], 0);
  int current = 1;
  expect_bytes(pair.fd[1], 100000, &current);
  EXPECT_EQ(current, 100000);
  EXPECT_EQ(mark_of(pair.fd[1]), 100000);
  expect_bytes(pair.fd[1], 64 << 20, &current);
  EXPECT_EQ(current, static_cast<int>(kReceiveLowWaterBytes));
  EXPECT_EQ(mark_of(pair.fd[1]), static_cast<int>(kReceiveLowWaterBytes));
  expect_bytes(pair.fd[1], 0, &current);  // never below one byte
  EXPECT_EQ(current, 1);
  EXPECT_EQ(mark_of(pair.fd[1]), 1);
}

TEST(ReceiveLowWaterTest, PollWaitsForTheMarkThenReportsTheBytes) {
  TcpPair pair;
  ASSERT_GE(pair.fd[1], 0);
  int current = 1;
  expect_bytes(pair.fd[1], 300000, &current);
  send_bytes(pair.fd[0], 1000);
  EXPECT_FALSE(readable(pair.fd[1])) << "woken before the mark";
  send_bytes(pair.fd[0], 299000);
  EXPECT_TRUE(readable(pair.fd[1]));
  reset_low_water(pair.fd[1], &current);
  EXPECT_EQ(mark_of(pair.fd[1]), 1);
}

}  // namespace
}  // namespace ddprpc::rpc::internal
