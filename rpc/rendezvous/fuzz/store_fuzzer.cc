// Fuzzes the rendezvous store's request handling: the first byte picks the
// method, the rest is its StoreRequest. Whatever a client sends, the store
// answers with a status and stays within its bounds.
#include <cstdint>
#include <cstdlib>

#include "rpc/rendezvous/internal/store_state.h"
#include "rpc/rendezvous/store.pb.h"

using ddprpc::rpc::internal::StoreState;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static auto* state = new StoreState();
  if (size < 1) return 0;
  ddprpc::rendezvous::StoreRequest req;
  if (!req.ParseFromArray(data + 1, static_cast<int>(size - 1))) return 0;
  // Waits that would block are cut short (a timeout in range stays one).
  if (req.timeout_ms() > 2 && req.timeout_ms() <= StoreState::kMaxTimeoutMs) req.set_timeout_ms(2);
  ddprpc::rendezvous::StoreResponse resp;
  auto never = [] { return false; };
  switch (data[0] % 6) {
    case 0: state->set(req, &resp); break;
    case 1: state->get(req, &resp, never); break;
    case 2: state->add(req, &resp); break;
    case 3: state->wait(req, &resp, never); break;
    case 4: state->check(req, &resp); break;
    case 5: state->compare_set(req, &resp); break;
  }
  return 0;
}
