// A client of the store that the current RPC agent's rendezvous serves, for
// tests that build process groups beside RPC (as ddp_rpc's trainers do).
#pragma once

#include <memory>

#include "rpc/rendezvous/store.h"

namespace ddprpc::testing {

std::shared_ptr<rpc::Store> connect_rpc_store();

}  // namespace ddprpc::testing
