#include "rpc/core/internal/receive_low_water.h"

#include <sys/socket.h>

#include <algorithm>

namespace ddprpc::rpc::internal {

void expect_bytes(int fd, size_t left, int* current) {
  const int mark = static_cast<int>(std::max<size_t>(1, std::min(left, kReceiveLowWaterBytes)));
  if (mark == *current) return;
  // A mark the kernel refuses leaves the default: slower, never wrong.
  if (::setsockopt(fd, SOL_SOCKET, SO_RCVLOWAT, &mark, sizeof(mark)) == 0) *current = mark;
}

}  // namespace ddprpc::rpc::internal
