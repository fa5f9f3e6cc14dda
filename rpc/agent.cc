#include "rpc/agent.h"

#include <algorithm>
#include <iterator>
#include <atomic>
#include <cstdlib>
#include <map>
#include <mutex>
#include <stdexcept>
#include <utility>

#include "absl/container/inlined_vector.h"
#include "absl/cleanup/cleanup.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "glog/logging.h"
#include "rpc/extension.h"
#include "rpc/hooks.h"
#include "rpc/internal/callee.h"
#include "rpc/core/internal/fault.h"
#include "rpc/core/internal/future_driver.h"
#include "rpc/core/internal/thread_policy.h"
#include "rpc/core/internal/thread_pool.h"
#include "rpc/rendezvous/init_method.h"
#include "rpc/transport/bulk_transport.h"
#include "rpc/transport/same_host_transport.h"
#include "rpc/transport/transport.h"
#include "rpc/wire/codec.h"

namespace ddprpc::rpc {
namespace {

using internal::Frame;

// The innermost SyncCallScope of this thread, or nullptr.
thread_local SyncCallScope* t_sync_scope = nullptr;
// The agent whose own thread this is (its timer, or one serving its
// requests), if any.
thread_local const RpcAgent* t_agent_thread = nullptr;

absl::Time deadline_after(absl::Duration timeout) {
  if (timeout <= absl::ZeroDuration() || timeout == absl::InfiniteDuration()) {
    return absl::InfiniteFuture();
  }
  return absl::Now() + timeout;
}

// Tells a call's hooks that it ended (reply: the response's ext, or nullptr).
// Requests and notices only, each from the worker whose connection
// carried it; anything else ends that connection.
absl::Status check_request(int caller, const Frame& frame) {
  const wire::Header& header = frame.header;
  if (header.kind() != wire::REQUEST && header.kind() != wire::NOTICE) {
    return absl::InvalidArgumentError(absl::StrCat(
        "malformed frame: a caller sent a frame of kind ", static_cast<int>(header.kind())));
  }
  if (header.src() != caller) {
    return absl::PermissionDeniedError(absl::StrCat("a frame from worker ", caller,
                                                    "'s stream claims to come from worker ",
                                                    header.src()));
  }
  return absl::OkStatus();
}

absl::Mutex extensions_mu(absl::kConstInit);
std::vector<std::pair<std::string, AgentExtensionFactory>>& extension_factories()
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(extensions_mu) {
  static auto* factories = new std::vector<std::pair<std::string, AgentExtensionFactory>>();
  return *factories;
}

std::vector<std::pair<std::string, AgentExtensionFactory>> registered_extensions() {
  absl::MutexLock lock(&extensions_mu);
  return extension_factories();
}

// Never throws: a hook that does is logged, and the call completes anyway.
void end_hooks(const std::vector<std::pair<RpcHook*, std::shared_ptr<void>>>& hooks,
               const MessageExt* reply) {
  for (const auto& [hook, state] : hooks) {
    try {
      hook->end_call(state, reply);
    } catch (const std::exception& e) {
      LOG(ERROR) << "rpc: a hook's end_call threw (ignored): " << e.what();
    } catch (...) {
      LOG(ERROR) << "rpc: a hook's end_call threw an exception of unknown type (ignored)";
    }
  }
}

}  // namespace

void register_agent_extension(const std::string& name, AgentExtensionFactory factory) {
  absl::MutexLock lock(&extensions_mu);
  for (const auto& [known, unused] : extension_factories()) {
    if (known == name) throw std::logic_error("RPC extension '" + name + "' registered twice");
  }
  extension_factories().emplace_back(name, std::move(factory));
}

std::shared_ptr<AgentExtension> RpcAgent::extension(const std::string& name) const {
  for (const auto& [known, extension] : extensions_) {
    if (known == name) return extension;
  }
  return nullptr;
}

SyncCallScope::SyncCallScope() : saved_(t_sync_scope) { t_sync_scope = this; }
SyncCallScope::~SyncCallScope() {
  t_sync_scope = saved_;
  if (auto transport = reserved_.lock()) transport->release_reading();
}

namespace {

// Answers liveness pings at shutdown (peers_alive()).
constexpr char kPing[] = "__rpc.ping";
int64_t ping() { return 0; }
DDPRPC_REGISTER_FUNCTION_AS(rpc_ping, kPing, ping);

RpcBackendOptions resolved(RpcBackendOptions options) {
  options.security = options.security.with_environment_defaults();
  return options;
}

}  // namespace

RpcAgent::RpcAgent(const std::string& name, int rank, int world_size, RpcBackendOptions options,
                   const FunctionRegistry* registry, bool serve_now)
    : rank_(rank), options_(resolved(std::move(options))), registry_(registry) {
  set_rpc_timeout(options_.rpc_timeout);
  if (world_size < 1 || rank < 0 || rank >= world_size) {
    throw RpcError(ErrorCode::kInvalidArgument,
                   absl::StrCat("invalid rank ", rank, " for world_size ", world_size));
  }
  if (name.empty() || absl::StrContains(name, "\n")) {
    throw RpcError(ErrorCode::kInvalidArgument, "worker name must be non-empty, one line");
  }
  if (options_.num_worker_threads < 1) {
    throw RpcError(ErrorCode::kInvalidArgument, "num_worker_threads must be at least 1");
  }
  if (options_.inline_request_handoff <= absl::ZeroDuration()) {
    throw RpcError(ErrorCode::kInvalidArgument, "inline_request_handoff must be above zero");
  }
  StoreAddress store_address;
  try {
    store_address = parse_init_method(options_.init_method);
  } catch (const std::invalid_argument& e) {
    throw RpcError(ErrorCode::kInvalidArgument, e.what());
  }
  const std::string& host = store_address.host;
  const int port = store_address.port;
  const Security& security = options_.security;
  if (!security.authenticated() && !security.encrypted() &&
      !(loopback_address(options_.listen_address) && loopback_address(host))) {
    if (!options_.allow_insecure) {
      throw RpcError(ErrorCode::kInvalidArgument,
                     absl::StrCat("worker '", name, "' would listen on ", options_.listen_address,
                                  " with no authentication: set ", kAuthTokenEnv, " (or ",
                                  kAuthTokenFileEnv, ", or RpcBackendOptions::security) to the "
                                  "job's secret, and/or TLS (", kTlsCertEnv, ", ", kTlsKeyEnv, ", ",
                                  kTlsCaEnv, "); or pass allow_insecure to run open to anyone "
                                  "who can reach these ports"));
    }
    static std::once_flag warned;
    std::call_once(warned, [&] {
      LOG(WARNING) << "rpc: worker '" << name << "' accepts connections from anyone who can reach "
                   << options_.listen_address << " (allow_insecure, no token, no TLS)";
    });
  }
  if (rank == 0) store_server_ = StoreServer::start(host, port, security);
  store_ = std::make_unique<Store>(host, port, std::max(options_.rpc_timeout, absl::Seconds(60)),
                                   security);
  pool_ = std::make_unique<internal::ThreadPool>(options_.num_worker_threads,
                                                 options_.batch_scheduling);
  reply_sender_ = std::make_unique<internal::ThreadPool>(1, options_.batch_scheduling);
  {
    absl::MutexLock lock(&workers_mu_);
    free_workers_ = options_.num_worker_threads;
  }
  // Before the server starts: peers may call as soon as they know us.
  for (const auto& [ext_name, factory] : registered_extensions()) {
    std::shared_ptr<AgentExtension> extension = factory(*this, rank_, world_size, registry_);
    if (!extension) continue;
    if (const internal::ExtensionCodec* codec = extension->codec()) {
      extension_codecs_.push_back(*codec);
    }
    extensions_.emplace_back(ext_name, std::move(extension));
  }
  internal::Callee::Options callee;
  callee.self = rank_;
  callee.self_name = name;
  callee.max_message_bytes = options_.max_message_bytes;
  callee.functions = registry_;
  for (const auto& [ext_name, extension] : extensions_) {
    callee.internal_functions.emplace_back(extension->function_prefix(), &extension->functions());
  }
  callee.extensions = &extension_codecs_;
  callee.reply_sender = reply_sender_.get();
  callee_ = std::make_unique<internal::Callee>(std::move(callee));
  transport::ServerLimits limits;
  limits.world_size = world_size;
  limits.self = rank_;
  limits.max_message_bytes = options_.max_message_bytes;
  limits.max_pending_requests = options_.max_pending_requests_per_stream;
  limits.max_pending_request_bytes = options_.max_pending_request_bytes_per_stream;
  limits.max_pending_reply_bytes = options_.max_pending_reply_bytes;
  limits.keepalive_interval = options_.keepalive_interval;
  limits.keepalive_timeout = options_.keepalive_timeout;
  limits.inline_handoff = options_.inline_request_handoff;
  limits.max_unauthenticated_connections = options_.max_unauthenticated_connections;
  limits.max_unauthenticated_per_peer = options_.max_unauthenticated_per_peer;
  limits.handshake_timeout = options_.handshake_timeout;
  limits.allow_other_uids = options_.allow_other_uids;
  limits.max_buffered_bytes = options_.max_receive_buffer_bytes;
  if (limits.max_buffered_bytes <= 0) {
    const int64_t message = std::min(options_.max_message_bytes, int64_t{1} << 40);
    limits.max_buffered_bytes = std::max(int64_t{256} << 20, 4 * message);
  }
  transport::TransportOptions transport_options;
  transport_options.batch_scheduling = options_.batch_scheduling;
  transport_options.max_spin = options_.max_spin;
  transport_options.capture_frames_dir = options_.capture_frames_dir;
  transport_ = transport::make_default_transport(transport_options);
  if (options_.bulk_min_bytes > 0 && !security.encrypted()) {
    transport::BulkOptions bulk;
    bulk.min_bytes = options_.bulk_min_bytes;
    bulk.streams = std::max(1, options_.bulk_streams);
    bulk.push = options_.bulk_push;
    bulk.push_min_cpus = options_.bulk_push_min_cpus;
    bulk.receive_cache_bytes = std::max<int64_t>(0, options_.bulk_receive_cache_bytes);
    // A lender that sends nothing for as long as keepalive takes to find
    // a peer dead is taken for dead.
    bulk.silence = std::max(options_.keepalive_interval + options_.keepalive_timeout,
                            absl::Seconds(1));
    transport_ = transport::make_bulk_transport(std::move(transport_), bulk);
  }
  if (options_.same_host_transport) {
    transport_ = transport::make_same_host_transport(std::move(transport_), transport_options);
  }
  server_ = transport_->listen(
      options_.listen_address, limits, security,
      [](int caller, const Frame& frame) { return check_request(caller, frame); },
      [this](std::shared_ptr<transport::Responder> responder, Frame frame) {
        if (!try_acquire_worker()) return offload(std::move(responder), std::move(frame));
        absl::Cleanup release = [this] { release_worker(); };
        serve(responder, frame, absl::Now());
      },
      [this](std::shared_ptr<transport::Responder> responder, Frame frame) {
        offload(std::move(responder), std::move(frame));
      });
  for (int i = 0; i < world_size; ++i) peers_.push_back(std::make_unique<PeerSlot>());
  {
    absl::MutexLock lock(&mu_);
    in_flight_.assign(world_size, 0);
    unreachable_.assign(world_size, "");
  }
  try {
    rendezvous(name, world_size);
  } catch (...) {
    stop(/*graceful=*/false);  // releases requests waiting for start_serving
    throw;
  }
  store_->set_fail_fast(true);
  {
    absl::MutexLock lock(&mu_);
    running_ = true;
  }
  {
    absl::MutexLock lock(&mu_);
    next_connection_check_ = absl::Now() + options_.keepalive_interval;
  }
  {
    absl::MutexLock lock(&expiry_->mu);
    expiry_->agent = this;
  }
  timer_ = std::thread([this] {
    internal::apply_thread_policy(options_.batch_scheduling);
    t_agent_thread = this;
    timer_loop();
  });
  if (serve_now) start_serving();
}

void RpcAgent::start_serving() {
  absl::MutexLock lock(&mu_);
  serving_ = true;
}

RpcAgent::~RpcAgent() {
  {
    // Waiters no longer reach this agent (one expiring a call finishes
    // first).
    absl::MutexLock lock(&expiry_->mu);
    expiry_->agent = nullptr;
  }
  stop(/*graceful=*/false);
  // Async results the program completes from now on are not answered; the
  // replies queued already are sent while the extensions still exist.
  if (callee_) callee_->close_replies();
  reply_sender_.reset();
  for (const auto& [name, extension] : extensions_) extension->detach();
  peers_.clear();  // before mu_ goes: a stream's close callback takes it
  server_.reset();
  transport_.reset();  // after its channels are closed
}

void RpcAgent::rendezvous(const std::string& name, int world_size) {
  // A store that holds this rank's departure is the previous job's on this
  // port, which its host closes once every worker has left: an init_rpc
  // right after a shutdown waits for the next one instead of reading the
  // old job's worker records.
  const std::string departed = absl::StrCat("rpc/shutdown/departed/", rank_);
  const absl::Time stale_deadline = absl::Now() + store_->timeout();
  while (store_->check({departed})) {
    if (absl::Now() >= stale_deadline) {
      throw RpcError(ErrorCode::kTimeout,
                     absl::StrCat("rendezvous store at ", store_->address(),
                                  " still serves the previous job on this port"));
    }
    absl::SleepFor(absl::Milliseconds(10));
  }
  std::string address = absl::StrCat(options_.listen_address, ":", server_->port());
  store_->set(absl::StrCat("rpc/worker/", rank_),
              absl::StrCat(name, "\n", address, "\n", server_->same_host_endpoint(), "\n",
                           server_->bulk_endpoint()));
  std::map<std::string, int> by_name;
  for (int r = 0; r < world_size; ++r) {
    std::string value = store_->get(absl::StrCat("rpc/worker/", r));
    std::vector<std::string> parts = absl::StrSplit(value, absl::MaxSplits('\n', 3));
    while (parts.size() >= 2 && parts.size() < 4) parts.emplace_back();  // no endpoint
    if (parts.size() != 4) {
      throw RpcError(ErrorCode::kInternal, "malformed worker record for rank " + std::to_string(r));
    }
    auto [it, inserted] = by_name.emplace(parts[0], r);
    if (!inserted) {
      throw RpcError(ErrorCode::kInvalidArgument,
                     absl::StrCat("worker name '", parts[0], "' is used by ranks ", it->second,
                                  " and ", r, "; names must be unique"));
    }
    workers_.push_back(WorkerInfo{parts[0], r, parts[1]});
    same_host_endpoints_.push_back(parts[2]);
    bulk_endpoints_.push_back(parts[3]);
  }
  transport_->world_known(same_host_endpoints_, bulk_endpoints_);
}

const WorkerInfo& RpcAgent::worker(const std::string& name) const {
  for (const auto& w : workers_) {
    if (w.name == name) return w;
  }
  throw RpcError(ErrorCode::kInvalidArgument, "unknown worker '" + name + "'");
}

const WorkerInfo& RpcAgent::worker(int id) const {
  if (id < 0 || id >= static_cast<int>(workers_.size())) {
    throw RpcError(ErrorCode::kInvalidArgument, absl::StrCat("unknown worker id ", id));
  }
  return workers_[id];
}

bool RpcAgent::running() const {
  absl::MutexLock lock(&mu_);
  return running_;
}

std::string RpcAgent::describe(const PendingCall& call) const {
  return absl::StrCat(call.api, "('", call.function, "') on worker '", workers_[call.to].name,
                      "'");
}

void RpcAgent::fail_pending(const std::vector<PendingCall>& calls, ErrorCode code,
                            const std::string& why) {
  for (const auto& call : calls) {
    end_hooks(call.hooks, nullptr);
    call.future.set_error(RpcError(code, absl::StrCat(describe(call), " failed: ", why)));
  }
}

// ------------------------------------------------------------------- caller

Future<c10::IValue> RpcAgent::call(int to, const std::string& function,
                                   std::vector<c10::IValue> args, absl::Duration timeout,
                                   const char* api, const std::string& display) {
  return send_request(to, function, std::move(args), timeout, api, display, /*one_way=*/false);
}

void RpcAgent::notify(int to, const std::string& function, std::vector<c10::IValue> args) {
  Future<c10::IValue> f = send_request(to, function, std::move(args), kDefaultTimeout, "notice",
                                       "", /*one_way=*/true);
  if (f.has_error()) LOG(WARNING) << f.error_message();
}

Future<c10::IValue> RpcAgent::send_request(int to, const std::string& function,
                                           std::vector<c10::IValue> args, absl::Duration timeout,
                                           const char* api, const std::string& display,
                                           bool one_way) {
  Future<c10::IValue> future;

  if (to < 0 || to >= static_cast<int>(workers_.size())) {
    future.set_error(RpcError(ErrorCode::kInvalidArgument,
                              absl::StrCat(api, "('", function, "'): unknown worker id ", to)));
    return future;
  }
  PendingCall call{future, to, display.empty() ? function : display, api,
                   deadline_after(timeout < absl::ZeroDuration() ? rpc_timeout() : timeout)};
  Frame frame;
  wire::Header& header = frame.header;
  header.set_kind(one_way ? wire::NOTICE : wire::REQUEST);
  header.set_function(function);
  header.set_src(rank_);
  const RpcHooks& hooks = rpc_hooks();
  MessageExt ext;
  if (!one_way && !hooks.empty()) {
    const OutgoingCall info{workers_[rank_], workers_[to], function, api, call.function};
    for (const auto& hook : hooks) {
      if (auto state = hook->start_call(info, &ext)) {
        call.hooks.emplace_back(hook.get(), std::move(state));
      }
    }
  }
  try {
    c10::IValue packed(c10::ivalue::Tuple::create(std::move(args)));
    for (const auto& hook : hooks) hook->outgoing_request(to, packed, &ext);
    internal::write_ext(std::move(ext), &header);
    internal::encode_value(packed, header.mutable_payload(), &frame, {&extension_codecs_, to});
  } catch (const std::exception& e) {
    fail_pending({call}, ErrorCode::kInvalidArgument,
                 absl::StrCat("cannot send the arguments: ", e.what()));
    return future;
  }
  uint64_t id;
  bool more_in_flight = false;
  {
    absl::MutexLock lock(&mu_);
    if (!running_) {
      fail_pending({call}, ErrorCode::kShutdown, "RPC agent is shut down");
      return future;
    }
    id = next_id_++;
    header.set_id(id);
    const uint64_t size = frame.size();
    if (size > static_cast<uint64_t>(options_.max_message_bytes)) {
      fail_pending({call}, ErrorCode::kMessageTooLarge,
                   absl::StrCat("request of ", size, " bytes exceeds max_message_bytes (",
                                options_.max_message_bytes, ")"));
      return future;
    }
    more_in_flight = in_flight_[to] > 0;
    if (!one_way) {
      ++in_flight_[to];
      pending_.emplace(id, call);
      if (call.deadline != absl::InfiniteFuture()) deadlines_.emplace(call.deadline, id);
    }
  }
  uint64_t generation = 0;
  std::shared_ptr<transport::Channel> stream = peer(to, &generation);  // null once stopped
  // Before the request goes: the background reader leaves its reply to us.
  if (!one_way && t_sync_scope && !t_sync_scope->reserved_.lock()) {
    transport_->reserve_reading();
    t_sync_scope->reserved_ = transport_;
  }
  if (!one_way && stream) {
    // Before the send: its reply, or its stream's end, may come at once.
    absl::MutexLock lock(&mu_);
    auto it = pending_.find(id);
    if (it != pending_.end()) it->second.stream = generation;
  }
  const bool sent = stream && stream->send(std::move(frame),
                                          transport::SendOptions{!one_way, more_in_flight,
                                                                 call.deadline});
  if (one_way) {
    if (sent) {
      future.set_result(c10::IValue());
    } else {
      fail_pending({call}, ErrorCode::kUnavailable, "the connection to the worker is broken");
    }
    return future;
  }
  if (!sent) {
    absl::MutexLock lock(&mu_);
    auto it = pending_.find(id);
    if (it != pending_.end()) {
      take_pending(it);
      fail_pending({call}, ErrorCode::kUnavailable, "the connection to the worker is broken");
    }
    return future;
  }
  // A waiter reads its channel itself, and fails the call at its deadline
  // itself: the timer thread that would otherwise may be busy (running a
  // callback that waits for this very call, say).
  std::weak_ptr<transport::Transport> weak = transport_;
  std::weak_ptr<transport::Channel> weak_channel = stream;
  std::weak_ptr<Expiry> expiry = expiry_;
  const absl::Time deadline = call.deadline;
  future.set_driver(std::make_shared<const internal::FutureDriver>(internal::FutureDriver{
      [weak, weak_channel, expiry, deadline, id](const std::function<bool()>& done,
                                                 absl::Time until) {
        {
          auto transport = weak.lock();  // keeps what the channel reads with
          auto channel = weak_channel.lock();
          if (transport && channel) channel->drive(done, std::min(deadline, until));
        }
        if (deadline != absl::InfiniteFuture() && absl::Now() >= deadline && !done()) {
          if (auto e = expiry.lock()) e->expire(id);
        }
      }}));
  return future;
}

transport::PeerOptions RpcAgent::peer_options(int to) const {
  transport::PeerOptions options;
  if (to >= 0 && to < static_cast<int>(same_host_endpoints_.size())) {
    options.same_host_endpoint = same_host_endpoints_[to];
  }
  options.self = rank_;
  options.peer = to;
  options.max_message_bytes = options_.max_message_bytes;
  options.keepalive_interval = options_.keepalive_interval;
  options.keepalive_timeout = options_.keepalive_timeout;
  options.security = options_.security;
  return options;
}

std::shared_ptr<transport::Channel> RpcAgent::peer(int to, uint64_t* generation) {
  PeerSlot& slot = *peers_[to];
  absl::MutexLock lock(&slot.mu);
  if (!slot.stream || slot.stream->broken()) {
    std::vector<BrokenStream> ended;  // let go outside mu_
    {
      absl::MutexLock state_lock(&mu_);
      // stop() sets stopped_ before it empties the slots (under slot.mu):
      // a stream opened after that would never be closed.
      if (stopped_) return nullptr;
      if (slot.stream) broken_.push_back({std::move(slot.stream), std::move(slot.ended)});
      // Broken streams that have reported their end have nothing more to
      // say: a peer that stays down, called again and again, must not pile
      // up one stream (and its descriptors) per call.
      auto over = std::stable_partition(broken_.begin(), broken_.end(),
                                        [](const BrokenStream& b) { return !b.ended->load(); });
      std::move(over, broken_.end(), std::back_inserter(ended));
      broken_.erase(over, broken_.end());
    }
    ended.clear();
    auto flag = std::make_shared<std::atomic<bool>>(false);
    slot.ended = flag;
    const uint64_t opened = slot.generation.fetch_add(1) + 1;
    slot.stream = transport_->connect(
        workers_[to].address, peer_options(to),
        [this, to](Frame frame) { return on_reply(to, std::move(frame)); },
        [this, to, flag, opened](const transport::CloseReason& reason) {
          flag->store(true);
          std::string why;
          if (reason.ok) {
            why = "the worker closed the connection";
          } else if (reason.unreachable) {
            why = absl::StrCat("the worker is unreachable (", reason.message, ")");
          } else {
            why = absl::StrCat("the connection failed (", reason.message, ")");
          }
          on_peer_closed(to, why, reason.unreachable, opened);
        });
  }
  if (generation != nullptr) *generation = slot.generation.load();
  return slot.stream;
}

absl::Status RpcAgent::on_reply(int from, Frame frame) {
  const wire::Header& header = frame.header;
  if (header.kind() != wire::RESPONSE && header.kind() != wire::ERROR) {
    return absl::DataLossError(absl::StrCat("worker '", workers_[from].name,
                                            "' sent a reply of kind ",
                                            static_cast<int>(header.kind())));
  }
  if (header.src() != from) {
    return absl::DataLossError(absl::StrCat("a reply on the stream to worker '",
                                            workers_[from].name, "' claims to come from worker ",
                                            header.src()));
  }
  PendingCall call;
  {
    absl::MutexLock lock(&mu_);
    auto it = pending_.find(header.id());
    // Timed out or failed already; a reply to a call made to another
    // worker is ignored likewise.
    unreachable_[from].clear();  // it answers
    if (it == pending_.end() || it->second.to != from) return absl::OkStatus();
    call = take_pending(it);
  }
  if (header.kind() == wire::ERROR) {
    if (!valid_error_code(header.error_code())) {
      fail_pending({call}, ErrorCode::kMalformedMessage,
                   absl::StrCat("malformed response: unknown error code ", header.error_code(),
                                ": ", header.error().substr(0, 1024)));
    } else {
      fail_pending({call}, static_cast<ErrorCode>(header.error_code()), header.error());
    }
    return absl::OkStatus();
  }
  c10::IValue value;
  const MessageExt ext = internal::read_ext(header);
  try {
    value = internal::decode_value(header.payload(), frame, {&extension_codecs_, call.to});
    for (const auto& hook : rpc_hooks()) hook->incoming_response(call.to, value, ext);
  } catch (const RpcError& e) {
    fail_pending({call}, e.code(), absl::StrCat("refused response: ", e.what()));
    return absl::OkStatus();
  } catch (const std::exception& e) {
    fail_pending({call}, ErrorCode::kMalformedMessage,
                 absl::StrCat("malformed response: ", e.what()));
    return absl::OkStatus();
  }
  // Outside the try: the call has completed (its future's callbacks cannot
  // throw, see future.h).
  end_hooks(call.hooks, &ext);
  call.future.set_result(std::move(value));
  return absl::OkStatus();
}

RpcAgent::PendingCall RpcAgent::take_pending(
    absl::flat_hash_map<uint64_t, PendingCall>::iterator it) {
  PendingCall call = std::move(it->second);
  deadlines_.erase({call.deadline, it->first});
  --in_flight_[call.to];
  pending_.erase(it);
  return call;
}

bool RpcAgent::is_reachable(int id) const {
  absl::MutexLock lock(&mu_);
  return id >= 0 && id < static_cast<int>(unreachable_.size()) && unreachable_[id].empty();
}

void RpcAgent::check_connections() {
  for (auto& slot : peers_) {
    std::shared_ptr<transport::Channel> stream;
    {
      absl::MutexLock lock(&slot->mu);
      stream = slot->stream;
    }
    if (stream) stream->check_connection();
  }
}

void RpcAgent::on_peer_closed(int peer, const std::string& why, bool unreachable,
                              uint64_t generation) {
  // A stream that broke earlier, ending only now, says nothing of the one
  // that replaced it.
  const bool latest = generation >= peers_[peer]->generation.load();
  std::vector<PendingCall> failed;
  bool newly_unreachable = false;
  {
    absl::MutexLock lock(&mu_);
    if (stopped_) return;
    if (unreachable && latest) {
      if (unreachable_[peer].empty()) {
        LOG(WARNING) << "rpc on '" << workers_[rank_].name << "': lost the connection to worker '"
                     << workers_[peer].name << "': " << why;
        newly_unreachable = true;
      }
      unreachable_[peer] = why;
    }
    for (auto it = pending_.begin(); it != pending_.end();) {
      if (it->second.to == peer && it->second.stream <= generation) {
        failed.push_back(take_pending(it++));
      } else {
        ++it;
      }
    }
  }
  fail_pending(failed, ErrorCode::kUnavailable, why);
  if (newly_unreachable) {
    for (const auto& hook : rpc_hooks()) {
      try {
        hook->worker_unreachable(workers_[peer], why);
      } catch (const std::exception& e) {
        LOG(ERROR) << "rpc: a hook's worker_unreachable threw (ignored): " << e.what();
      }
    }
  }
}

std::optional<RpcAgent::PendingCall> RpcAgent::take_expired(uint64_t id, std::string* why) {
  std::optional<PendingCall> call;
  {
    absl::MutexLock lock(&mu_);
    auto it = pending_.find(id);
    if (it == pending_.end()) return std::nullopt;  // answered, failed or expired already
    call = take_pending(it);
  }
  *why = end_expired(*call);
  return call;
}

std::string RpcAgent::end_expired(const PendingCall& call) {
  try {
    internal::fault_point("agent.timer");
    end_hooks(call.hooks, nullptr);
  } catch (const std::exception& e) {
    LOG(ERROR) << "rpc: ending the hooks of " << describe(call) << " failed: " << e.what();
  }
  return absl::StrCat(describe(call), " timed out (deadline passed; default rpc_timeout is ",
                      absl::FormatDuration(rpc_timeout()), ")");
}

void RpcAgent::Expiry::expire(uint64_t id) {
  std::optional<PendingCall> call;
  std::string why;
  {
    absl::MutexLock lock(&mu);
    if (agent == nullptr) return;
    call = agent->take_expired(id, &why);
  }
  // Outside the lock: its callbacks may wait for other calls, and expire them.
  if (call) call->future.set_error(RpcError(ErrorCode::kTimeout, why));
}

void RpcAgent::run_at(absl::Time when, std::function<void()> fn) {
  absl::MutexLock lock(&mu_);
  if (stopped_) return;
  timers_.emplace(when, std::move(fn));
}

void RpcAgent::timer_loop() {
  while (true) {
    std::vector<PendingCall> expired;
    std::vector<std::function<void()>> due_timers;
    {
      absl::MutexLock lock(&mu_);
      auto earliest = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        absl::Time t = deadlines_.empty() ? absl::InfiniteFuture() : deadlines_.begin()->first;
        if (!timers_.empty()) t = std::min(t, timers_.begin()->first);
        return std::min(t, next_connection_check_);
      };
      const absl::Time wake = earliest();
      auto due = [this, wake, &earliest]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return stopped_ || earliest() < wake;
      };
      mu_.AwaitWithDeadline(absl::Condition(&due), wake);
      if (stopped_) {
        timers_.clear();
        return;
      }
      const absl::Time now = absl::Now();
      while (!deadlines_.empty() && deadlines_.begin()->first <= now) {
        auto it = pending_.find(deadlines_.begin()->second);
        deadlines_.erase(deadlines_.begin());
        if (it == pending_.end()) continue;
        expired.push_back(take_pending(it));
      }
      while (!timers_.empty() && timers_.begin()->first <= now) {
        due_timers.push_back(std::move(timers_.begin()->second));
        timers_.erase(timers_.begin());
      }
      if (next_connection_check_ <= now) {
        // Idle streams learn of a dead connection within a keepalive round.
        next_connection_check_ = now + std::max(options_.keepalive_interval, absl::Milliseconds(100));
        due_timers.push_back([this] { check_connections(); });
      }
    }
    for (const auto& call : expired) {
      call.future.set_error(RpcError(ErrorCode::kTimeout, end_expired(call)));
    }
    for (auto& fn : due_timers) {
      try {
        fn();
      } catch (const std::exception& e) {
        LOG(ERROR) << "rpc: a timer task threw (ignored): " << e.what();
      } catch (...) {
        LOG(ERROR) << "rpc: a timer task threw (ignored)";
      }
    }
  }
}

// ------------------------------------------------------------------- callee

bool RpcAgent::try_acquire_worker() {
  absl::MutexLock lock(&workers_mu_);
  if (free_workers_ == 0) return false;
  --free_workers_;
  return true;
}

void RpcAgent::acquire_worker() {
  absl::MutexLock lock(&workers_mu_);
  auto available = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(workers_mu_) {
    return free_workers_ > 0;
  };
  workers_mu_.Await(absl::Condition(&available));
  --free_workers_;
}

void RpcAgent::release_worker() {
  absl::MutexLock lock(&workers_mu_);
  ++free_workers_;
}

void RpcAgent::offload(std::shared_ptr<transport::Responder> responder, Frame frame) {
  auto task = std::make_shared<std::pair<std::shared_ptr<transport::Responder>, Frame>>(
      std::move(responder), std::move(frame));
  const bool queued = pool_->try_run(
      [this, task, received = absl::Now()] {
        acquire_worker();
        absl::Cleanup release = [this] { release_worker(); };
        serve(task->first, task->second, received);
      },
      static_cast<size_t>(std::max(options_.max_queued_requests, 1)));
  if (queued) return;
  const wire::Header& header = task->second.header;
  const std::string why =
      absl::StrCat("worker '", self().name, "' has ", options_.max_queued_requests,
                   " requests waiting for a thread already (max_queued_requests); '",
                   header.function().substr(0, 256), "' was refused");
  if (header.kind() == wire::NOTICE) {
    LOG(WARNING) << "rpc: " << why;
    return;
  }
  task->first->send(callee_->error_reply(header.id(), ErrorCode::kResourceExhausted, why));
}

void RpcAgent::serve(const std::shared_ptr<transport::Responder>& responder, Frame& request,
                     absl::Time received) {
  {
    // Peers may call as soon as the rendezvous is done, before we are.
    absl::MutexLock lock(&mu_);
    auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return serving_ || stopped_; };
    mu_.Await(absl::Condition(&ready));
    // Stopped (before it started, or since this request was queued): it is
    // not run; its stream closes with the server.
    if (!serving_ || stopped_) return;
  }
  const RpcAgent* outer = t_agent_thread;
  t_agent_thread = this;
  absl::Cleanup restore = [outer] { t_agent_thread = outer; };
  // The caller is the worker its stream belongs to (checked against every
  // frame by the transport), never what a frame says. The callee turns a
  // handler's failure into the call's error; whatever still escapes it
  // fails this call here, not the thread.
  const uint64_t id = request.header.id();
  const bool one_way = request.header.kind() == wire::NOTICE;
  std::string failure;
  try {
    internal::fault_point("agent.dispatch");
    callee_->serve(responder->caller(), request, received,
                   [responder](Frame reply) { responder->send(std::move(reply)); });
    return;
  } catch (const std::exception& e) {
    failure = e.what();
  } catch (...) {
    failure = "an exception of unknown type";
  }
  const std::string function = request.header.function().substr(0, 256);
  const std::string why = absl::StrCat("worker '", self().name, "' failed serving '", function,
                                       "' from worker ", responder->caller(), ": ", failure);
  LOG(ERROR) << "rpc: " << why;
  if (one_way) return;
  try {
    responder->send(callee_->error_reply(id, ErrorCode::kInternal, why));
  } catch (...) {
    LOG(ERROR) << "rpc: the error reply to worker " << responder->caller() << " for '" << function
               << "' could not be sent either";
  }
}

int RpcAgent::busy_worker_threads() const { return callee_ ? callee_->executing() : 0; }

// ----------------------------------------------------------------- shutdown

bool RpcAgent::peer_alive(int id) const {
  return transport_->probe(workers_[id].address, peer_options(-1),
                           absl::Now() + absl::Milliseconds(500));
}

bool RpcAgent::store_barrier(const std::string& prefix, bool wait, absl::Duration timeout) {
  store_->set(absl::StrCat(prefix, "/", rank_), "1");
  if (!wait) return true;
  const absl::Time deadline = deadline_after(timeout);
  std::vector<int> waiting;
  for (int r = 0; r < static_cast<int>(workers_.size()); ++r) {
    // A worker found gone at an earlier barrier is not waited for again.
    if (r != rank_ && !left_.count(r)) waiting.push_back(r);
  }
  while (!waiting.empty()) {
    std::vector<std::string> keys;
    for (int r : waiting) keys.push_back(absl::StrCat(prefix, "/", r));
    try {
      store_->wait(keys, std::min(absl::Seconds(1), deadline - absl::Now()));
      return true;
    } catch (const RpcError& e) {
      if (e.code() != ErrorCode::kTimeout) throw;
    }
    if (absl::Now() >= deadline) return false;
    std::vector<int> missing;
    for (int r : waiting) {
      if (!store_->check({absl::StrCat(prefix, "/", r)})) missing.push_back(r);
    }
    std::vector<bool> alive = peers_alive(missing);
    std::vector<int> still;
    for (size_t i = 0; i < missing.size(); ++i) {
      if (alive[i]) {
        still.push_back(missing[i]);
      } else {
        LOG(WARNING) << "rpc shutdown: worker '" << workers_[missing[i]].name
                     << "' is unreachable; not waiting for it";
        left_.insert(missing[i]);
      }
    }
    waiting.swap(still);
  }
  return true;
}

std::vector<bool> RpcAgent::peers_alive(const std::vector<int>& ids) {
  // While serving, a peer is alive if it answers a ping within a second (a
  // stopped process accepts connections but answers nothing); once stopped,
  // if its port completes a connection.
  constexpr absl::Duration kPingTimeout = absl::Seconds(1);
  std::vector<bool> alive(ids.size(), false);
  std::vector<Future<c10::IValue>> pings(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) {
    if (is_reachable(ids[i])) pings[i] = call(ids[i], kPing, {}, kPingTimeout, "ping");
  }
  for (size_t i = 0; i < ids.size(); ++i) {
    if (!is_reachable(ids[i])) continue;
    pings[i].wait_for(kPingTimeout + absl::Milliseconds(500));
    if (!pings[i].completed()) continue;
    ErrorCode code = ErrorCode::kOk;
    try {
      pings[i].value();
    } catch (const RpcError& e) {
      code = e.code();
    }
    if (code == ErrorCode::kShutdown) {
      alive[i] = peer_alive(ids[i]);
    } else {
      // Any answer (an error reply too, e.g. a registry without the ping).
      alive[i] = code != ErrorCode::kTimeout && code != ErrorCode::kUnavailable;
    }
  }
  return alive;
}

std::map<std::string, std::string> RpcAgent::debug_info() const {
  std::map<std::string, std::string> info;
  info["agent.worker"] = self().name;
  info["agent.num_workers"] = std::to_string(workers_.size());
  info["agent.num_worker_threads"] = std::to_string(options_.num_worker_threads);
  info["agent.rpc_timeout"] = absl::FormatDuration(rpc_timeout());
  {
    absl::MutexLock lock(&mu_);
    info["agent.num_pending_calls"] = std::to_string(pending_.size());
    info["agent.broken_streams"] = std::to_string(broken_.size());
    info["agent.running"] = running_ ? "1" : "0";
  }
  {
    absl::MutexLock lock(&workers_mu_);
    info["agent.idle_worker_threads"] = std::to_string(free_workers_);
  }
  int unreachable = 0;
  for (const WorkerInfo& w : workers_) unreachable += w.id != rank_ && !is_reachable(w.id);
  info["agent.unreachable_workers"] = std::to_string(unreachable);
  for (const auto& [name, extension] : extensions_) extension->add_debug_info(&info);
  return info;
}

absl::Duration RpcAgent::rpc_timeout() const {
  const int64_t ns = rpc_timeout_ns_.load(std::memory_order_relaxed);
  return ns == INT64_MAX ? absl::InfiniteDuration() : absl::Nanoseconds(ns);
}

void RpcAgent::set_rpc_timeout(absl::Duration timeout) {
  rpc_timeout_ns_.store(timeout == absl::InfiniteDuration() ? INT64_MAX
                                                             : absl::ToInt64Nanoseconds(timeout),
                        std::memory_order_relaxed);
}

bool RpcAgent::shutdown(bool graceful) {
  if (t_agent_thread == this) {
    // It would wait for its own thread (the timer's join, the worker pool's).
    throw RpcError(ErrorCode::kInvalidArgument,
                   absl::StrCat("rpc::shutdown() on worker '", self().name,
                                "' cannot run on one of its agent's threads (in a request "
                                "handler, or a callback of a call that timed out)"));
  }
  // One shutdown at a time: a second, concurrent one returns at once.
  if (shutting_down_.exchange(true)) return false;
  {
    absl::MutexLock lock(&mu_);
    if (stopped_) return false;
  }
  bool barrier_ok = false;
  bool calls_ended = true;  // this worker's calls all got their replies
  // This worker's own calls get at most the RPC timeout (60 s without one)
  // to end: calls without a deadline, or to a peer that never answers, are
  // failed by stop() after it.
  const absl::Duration rpc_timeout = this->rpc_timeout();
  const absl::Time calls_deadline =
      absl::Now() + (rpc_timeout > absl::ZeroDuration() && rpc_timeout != absl::InfiniteDuration()
                         ? rpc_timeout
                         : absl::Seconds(60));
  auto drain_own_calls = [this, calls_deadline, &calls_ended] {
    absl::MutexLock lock(&mu_);
    auto idle = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return pending_.empty(); };
    if (!mu_.AwaitWithDeadline(absl::Condition(&idle), calls_deadline)) {
      LOG(WARNING) << "rpc shutdown on '" << self().name << "': " << pending_.size()
                   << " call(s) of this worker still have no reply; they fail";
      calls_ended = false;
    }
  };
  if (graceful) {
    drain_own_calls();
    try {
      // Keep serving until every worker is done calling.
      barrier_ok = store_barrier("rpc/shutdown/arrived", true, options_.shutdown_timeout);
      if (!barrier_ok) {
        LOG(WARNING) << "rpc shutdown on '" << self().name
                     << "': other workers did not reach shutdown within shutdown_timeout";
      }
      if (barrier_ok) {
        // Calls made while others were still working (e.g. RRef deletions
        // after a last reply) finish before anyone counts what is left.
        drain_own_calls();
        barrier_ok = store_barrier("rpc/shutdown/drained", true, options_.shutdown_timeout);
      }
    } catch (const RpcError& e) {
      LOG(WARNING) << "rpc shutdown on '" << self().name << "': " << e.what();
    }
  }
  if (graceful && barrier_ok) {
    // Every worker has finished its calls (an extension's too, such as
    // RRef deletions).
    for (const auto& [name, extension] : extensions_) extension->drained();
  }
  stop(graceful);
  if (graceful && barrier_ok) {
    try {
      // Rank 0 hosts the store: it stays until everyone is past the barrier.
      store_barrier("rpc/shutdown/departed", rank_ == 0, absl::Seconds(30));
    } catch (const RpcError& e) {
      LOG(WARNING) << "rpc shutdown on '" << self().name << "': " << e.what();
    }
  }
  // The store's client stays until the agent goes: another thread may be
  // in a store call (rpc::barrier, all_gather) and fails there instead.
  store_server_.reset();
  // Clean only if every other worker reached shutdown (none given up as
  // dead or unreachable) and every call of this one ended.
  return graceful && barrier_ok && calls_ended && left_.empty();
}

void RpcAgent::stop(bool graceful) {
  std::vector<PendingCall> failed;
  {
    absl::MutexLock lock(&mu_);
    if (stopped_) return;
    stopped_ = true;
    running_ = false;
    for (auto& [id, call] : pending_) failed.push_back(std::move(call));
    pending_.clear();
    std::fill(in_flight_.begin(), in_flight_.end(), 0);
    deadlines_.clear();
  }
  fail_pending(failed, ErrorCode::kShutdown, "RPC was shut down before the reply arrived");
  if (timer_.joinable()) timer_.join();
  // A graceful close waits for the peer to end the stream: not for one
  // that is unreachable. Every stream is half-closed first, so that the
  // waits run together.
  std::vector<std::pair<std::shared_ptr<transport::Channel>, bool>> streams;
  for (int to = 0; to < static_cast<int>(peers_.size()); ++to) {
    std::shared_ptr<transport::Channel> stream;
    {
      absl::MutexLock lock(&peers_[to]->mu);
      stream = std::move(peers_[to]->stream);
    }
    if (!stream) continue;
    const bool gently = graceful && is_reachable(to);
    if (gently) stream->begin_close();
    streams.emplace_back(std::move(stream), gently);
  }
  for (auto& [stream, gently] : streams) stream->close(gently);
  std::vector<BrokenStream> broken;
  {
    absl::MutexLock lock(&mu_);
    broken.swap(broken_);
  }
  for (auto& b : broken) b.stream->close(/*graceful=*/false);
  // After the barriers every live worker has finished calling this one:
  // what streams remain belong to workers that are gone or closing theirs.
  if (server_) server_->shutdown(graceful ? absl::Seconds(2) : absl::ZeroDuration());
  pool_.reset();
  server_.reset();
  // Requests still waiting for an extension (e.g. an RRef's creation) end
  // now, while the reply sender their callbacks may use exists.
  for (const auto& [name, extension] : extensions_) extension->stopped();
}

}  // namespace ddprpc::rpc
