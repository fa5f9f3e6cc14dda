// CartPole-v1 dynamics against values of gym's equations (the first step
// from rest is gym's well-known [0, 0.19512195, 0, -0.29268293]).
#include "models/cartpole.h"

#include <cmath>
#include <stdexcept>

#include "gtest/gtest.h"

namespace ddprpc::models {
namespace {

void expect_state(const CartPole::State& got, const CartPole::State& want) {
  for (int i = 0; i < 4; ++i) EXPECT_NEAR(got[i], want[i], 1e-12) << "component " << i;
}

TEST(CartPoleTest, StepsFromRestMatchGym) {
  CartPole env;
  env.set_state({0, 0, 0, 0});
  CartPole::Step s = env.step(1);
  expect_state(s.state, {0.0, 0.1951219512195122, 0.0, -0.2926829268292683});
  EXPECT_EQ(s.reward, 1.0);
  EXPECT_FALSE(s.done());
  s = env.step(1);
  expect_state(s.state, {0.0039024390243902443, 0.3902439024390244, -0.005853658536585366,
                         -0.5853658536585366});
}

TEST(CartPoleTest, PushLeftFromATiltedState) {
  CartPole env;
  env.set_state({0.01, -0.02, 0.03, 0.04});
  expect_state(env.step(0).state,
               {0.0096, -0.21553901710278936, 0.0308, 0.3419952237760392});
}

TEST(CartPoleTest, AlwaysPushingRightTopplesThePoleAtStepNine) {
  CartPole env;
  env.set_state({0, 0, 0, 0});
  CartPole::Step s;
  int steps = 0;
  do {
    s = env.step(1);
    ++steps;
  } while (!s.done() && steps < 100);
  EXPECT_EQ(steps, 9);
  EXPECT_TRUE(s.terminated);
  EXPECT_FALSE(s.truncated);
  EXPECT_EQ(s.reward, 1.0);  // the terminating step is rewarded too
  EXPECT_LT(s.state[2], -CartPole::kThetaThreshold);
  expect_state(s.state, {0.14065097203306187, 1.7603811257683097, -0.21518604988500967,
                         -2.777886494012814});
}

TEST(CartPoleTest, CartLeavingTheTrackTerminates) {
  CartPole env;
  env.set_state({2.39, 1.0, 0, 0});
  EXPECT_TRUE(env.step(1).terminated);
  env.set_state({-2.39, -1.0, 0, 0});
  EXPECT_TRUE(env.step(0).terminated);
  env.set_state({2.0, 1.0, 0, 0});
  EXPECT_FALSE(env.step(1).terminated);
}

TEST(CartPoleTest, ResetIsSeededAndSmall) {
  CartPole a(543), b(543), c(544);
  for (int episode = 0; episode < 20; ++episode) {
    CartPole::State sa = a.reset(), sb = b.reset(), sc = c.reset();
    EXPECT_EQ(sa, sb);
    EXPECT_NE(sa, sc);
    for (double v : sa) {
      EXPECT_GE(v, -0.05);
      EXPECT_LT(v, 0.05);
    }
    EXPECT_EQ(a.steps_in_episode(), 0);
  }
}

TEST(CartPoleTest, TruncatedAfter500Steps) {
  CartPole env(1);
  env.reset();
  CartPole::Step s;
  for (int i = 0; i < CartPole::kMaxEpisodeSteps; ++i) {
    // Keep the pole up by pushing toward its lean: a simple balancing rule.
    const auto& st = env.state();
    s = env.step(st[2] + 0.5 * st[3] > 0 ? 1 : 0);
    ASSERT_FALSE(s.terminated) << "fell at step " << i + 1;
    if (i + 1 < CartPole::kMaxEpisodeSteps) {
      ASSERT_FALSE(s.truncated);
    }
  }
  EXPECT_TRUE(s.truncated);
  EXPECT_TRUE(s.done());
}

TEST(CartPoleTest, RejectsBadActionsAndStepBeforeReset) {
  CartPole env;
  EXPECT_THROW(env.step(0), std::invalid_argument);
  env.reset();
  EXPECT_THROW(env.step(2), std::invalid_argument);
  EXPECT_THROW(env.step(-1), std::invalid_argument);
}

}  // namespace
}  // namespace ddprpc::models
