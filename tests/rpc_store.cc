#include "tests/rpc_store.h"

#include <stdexcept>
#include <string>

#include "absl/strings/numbers.h"
#include "rpc/rpc.h"

namespace ddprpc::testing {

std::shared_ptr<rpc::Store> connect_rpc_store() {
  const std::string address = rpc::current_agent()->store().address();
  const size_t colon = address.rfind(':');
  int port = 0;
  if (colon == std::string::npos || !absl::SimpleAtoi(address.substr(colon + 1), &port)) {
    throw std::runtime_error("unexpected store address " + address);
  }
  return std::make_shared<rpc::Store>(address.substr(0, colon), port, absl::Seconds(60));
}

}  // namespace ddprpc::testing
