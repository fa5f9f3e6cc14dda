// Extensions of the RPC agent: layers above rpc (remote references, for
// instance) that serve internal functions of their own and carry values of
// their own kind inside messages, without the agent knowing them.
//
// An extension's library registers a factory at static initialization
// (register_agent_extension); every agent constructed afterwards makes one
// instance before it serves, routes requests for functions named
// "<function_prefix()>..." to functions(), hands c10 capsules in arguments
// and results to codec() (the wire codec's ExtensionCodec; values of a type
// no extension claims cannot be sent), and tells it of its lifecycle. Code
// above finds the instance with RpcAgent::extension(name).
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <string>

namespace ddprpc::rpc {

class FunctionRegistry;
class RpcAgent;

namespace internal {
struct ExtensionCodec;
}  // namespace internal

class AgentExtension {
 public:
  virtual ~AgentExtension() = default;
  // The internal functions this extension serves to other workers, each
  // named with function_prefix() (e.g. "__rref.").
  virtual std::string function_prefix() const = 0;
  virtual const FunctionRegistry& functions() const = 0;
  // Encodes and decodes its values (c10 capsules); nullptr if it has none.
  virtual const internal::ExtensionCodec* codec() const { return nullptr; }
  // The agent stopped serving: requests that wait for messages that can no
  // longer come should fail now.
  virtual void stopped() {}
  // The agent is going away: the extension must not call it any more.
  virtual void detach() {}
  // A graceful shutdown: every worker has ended its calls (none is in
  // flight anywhere), so what the extension still holds is held for good.
  virtual void drained() {}
  // Counters for RpcAgent::debug_info(), prefixed with the extension's name.
  virtual void add_debug_info(std::map<std::string, std::string>* info) const {}
};

// Makes the extension of one agent, during its construction (before its
// rendezvous: `rank` and `world_size` are known, the other workers not yet).
// `user_functions` is the registry the agent serves.
using AgentExtensionFactory = std::function<std::shared_ptr<AgentExtension>(
    RpcAgent& agent, int rank, int world_size, const FunctionRegistry* user_functions)>;

// Every agent constructed from now on makes an extension `name` with
// `factory`. Names are unique; registering one twice throws
// std::logic_error.
void register_agent_extension(const std::string& name, AgentExtensionFactory factory);

}  // namespace ddprpc::rpc
