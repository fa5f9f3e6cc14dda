// The callee side without a network: requests served from many threads at
// once (the RRef protocol's table included) give the right replies and
// leave nothing behind. Also run under --config=tsan.
#include "rpc/internal/callee.h"

#include <atomic>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "rpc/core/internal/thread_pool.h"
#include "rpc/rref/internal/rref_context.h"

namespace ddprpc::rpc::internal {
namespace {

constexpr int kWorld = 4;

Frame request(int src, uint64_t id, const std::string& function, std::vector<c10::IValue> args) {
  Frame frame;
  frame.header.set_kind(wire::REQUEST);
  frame.header.set_id(id);
  frame.header.set_src(src);
  frame.header.set_function(function);
  encode_value(c10::IValue(c10::ivalue::Tuple::create(std::move(args))),
               frame.header.mutable_payload(), &frame);
  return frame;
}

struct Served {
  Frame reply;
  bool answered = false;
};

class CalleeTest : public ::testing::Test {
 protected:
  CalleeTest() {
    functions_.add("add", make_handler("add", [](int64_t a, int64_t b) { return a + b; }));
    functions_.add("concat", make_handler("concat", [](std::string a, std::string b) { return a + b; }));
    rrefs_ = std::make_shared<RRefContext>(nullptr, /*self_id=*/0, kWorld, &functions_);
    Callee::Options options;
    options.self = 0;
    options.self_name = "worker0";
    options.functions = &functions_;
    options.internal_functions = {{RRefContext::kFunctionPrefix, &rrefs_->functions()}};
    codecs_ = {*rrefs_->codec()};
    options.extensions = &codecs_;
    options.reply_sender = &reply_sender_;
    callee_ = std::make_unique<Callee>(std::move(options));
  }

  // Serves one request synchronously (every function here completes inline).
  Served serve(int caller, Frame frame) {
    Served out;
    callee_->serve(caller, frame, absl::Now(), [&](Frame reply) {
      out.answered = parse_frame(serialize_frame(reply), &out.reply).ok();
    });
    return out;
  }

  c10::IValue value_of(const Served& s) {
    EXPECT_TRUE(s.answered);
    EXPECT_EQ(s.reply.header.kind(), wire::RESPONSE) << s.reply.header.error();
    return decode_value(s.reply.header.payload(), s.reply);
  }

  FunctionRegistry functions_;
  ThreadPool reply_sender_{1};
  std::shared_ptr<RRefContext> rrefs_;
  std::vector<ExtensionCodec> codecs_;
  std::unique_ptr<Callee> callee_;
};

TEST_F(CalleeTest, AnswersEveryRequestFromManyThreads) {
  constexpr int kThreads = 8, kCalls = 300;
  std::vector<std::thread> threads;
  std::atomic<int> wrong{0};
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      const int caller = t % kWorld;
      for (int i = 0; i < kCalls; ++i) {
        const uint64_t id = static_cast<uint64_t>(t) * kCalls + i;
        Served sum = serve(caller, request(caller, id, "add", {int64_t{t}, int64_t{i}}));
        if (!sum.answered || sum.reply.header.id() != id || value_of(sum).toInt() != t + i) ++wrong;
        Served text = serve(caller, request(caller, id, "concat",
                                            {std::string("a"), absl::StrCat(i)}));
        if (value_of(text).toStringRef() != absl::StrCat("a", i)) ++wrong;
        // An RRef the caller names (id = its fork), fetched, then released.
        const int64_t local = id + 1;
        const c10::IValue no_target = int64_t{-1};
        Served created = serve(caller, request(caller, id, "__rref.create",
                                               {int64_t{caller}, local, int64_t{caller}, local,
                                                std::string("function"), std::string("add"),
                                                no_target, int64_t{0},
                                                c10::IValue(c10::ivalue::Tuple::create(
                                                    {int64_t{i}, int64_t{1}}))}));
        if (!created.answered || created.reply.header.kind() != wire::RESPONSE) ++wrong;
        Served fetched = serve(caller, request(caller, id, "__rref.fetch", {int64_t{caller}, local}));
        if (value_of(fetched).toInt() != i + 1) ++wrong;
        Served deleted = serve(caller, request(caller, id, "__rref.del_fork",
                                               {int64_t{caller}, local, int64_t{caller}, local}));
        if (!deleted.answered || deleted.reply.header.kind() != wire::RESPONSE) ++wrong;
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(wrong.load(), 0);
  EXPECT_EQ(rrefs_->owned_count(), 0u);
  EXPECT_EQ(callee_->executing(), 0);
}

TEST_F(CalleeTest, RefusesWhatTheCallerMayNotDo) {
  // Worker 1 creates an RRef; worker 2 may neither delete its fork nor
  // create one in its name.
  const c10::IValue no_target = int64_t{-1};
  auto create = [&](int caller, int64_t w) {
    return serve(caller, request(caller, 1, "__rref.create",
                                 {w, int64_t{5}, w, int64_t{5}, std::string("function"),
                                  std::string("add"), no_target, int64_t{0},
                                  c10::IValue(c10::ivalue::Tuple::create({int64_t{1}, int64_t{2}}))}));
  };
  EXPECT_EQ(create(1, 1).reply.header.kind(), wire::RESPONSE);
  Served forged = create(2, 1);
  EXPECT_EQ(forged.reply.header.error_code(), static_cast<int>(ErrorCode::kPermissionDenied));
  Served del = serve(2, request(2, 2, "__rref.del_fork", {int64_t{1}, int64_t{5}, int64_t{1}, int64_t{5}}));
  EXPECT_EQ(del.reply.header.error_code(), static_cast<int>(ErrorCode::kPermissionDenied))
      << del.reply.header.error();
  EXPECT_EQ(rrefs_->owned_count(), 1u);
  Served own = serve(1, request(1, 3, "__rref.del_fork", {int64_t{1}, int64_t{5}, int64_t{1}, int64_t{5}}));
  EXPECT_EQ(own.reply.header.kind(), wire::RESPONSE) << own.reply.header.error();
  EXPECT_EQ(rrefs_->owned_count(), 0u);
  // A function that does not exist; arguments of the wrong type.
  EXPECT_EQ(serve(0, request(0, 4, "nope", {})).reply.header.error_code(),
            static_cast<int>(ErrorCode::kUnknownFunction));
  EXPECT_EQ(serve(0, request(0, 5, "add", {std::string("x"), int64_t{1}})).reply.header.error_code(),
            static_cast<int>(ErrorCode::kInvalidArgument));
}

}  // namespace
}  // namespace ddprpc::rpc::internal
