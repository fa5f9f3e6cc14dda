// CartPole-v1 as in OpenAI Gym / Gymnasium, in C++: a pole on a cart, pushed
// left (action 0) or right (action 1) by 10 N. Euler integration with
// tau = 0.02 s and gym's constants; reward 1 per step (also the last one);
// the episode terminates when |x| > 2.4 or |theta| > 12 degrees and is
// truncated after 500 steps (v1's TimeLimit). reset() draws each state
// component from uniform(-0.05, 0.05) with the environment's own seeded RNG,
// so a seed fixes every reset. Not thread-safe: one environment per thread.
#pragma once

#include <array>
#include <cstdint>
#include <random>

namespace ddprpc::models {

class CartPole {
 public:
  // x, x_dot, theta, theta_dot.
  using State = std::array<double, 4>;
  struct Step {
    State state;
    double reward = 0;
    bool terminated = false;  // the pole fell or the cart left the track
    bool truncated = false;   // max_episode_steps reached
    bool done() const { return terminated || truncated; }
  };

  static constexpr double kGravity = 9.8, kMassCart = 1.0, kMassPole = 0.1;
  static constexpr double kTotalMass = kMassCart + kMassPole;
  static constexpr double kLength = 0.5;  // half the pole's length
  static constexpr double kPoleMassLength = kMassPole * kLength;
  static constexpr double kForceMag = 10.0, kTau = 0.02;
  static constexpr double kThetaThreshold = 12 * 2 * 3.14159265358979323846 / 360;
  static constexpr double kXThreshold = 2.4;
  static constexpr int kMaxEpisodeSteps = 500;

  explicit CartPole(uint64_t seed = 0) : rng_(seed) {}

  // Starts a new episode; returns its first state.
  State reset();
  // Applies action 0 (push left) or 1 (push right); throws
  // std::invalid_argument for any other action or before the first reset().
  Step step(int64_t action);

  const State& state() const { return state_; }
  // For tests: continue from a given state.
  void set_state(const State& s) {
    state_ = s;
    started_ = true;
  }
  int steps_in_episode() const { return steps_; }

 private:
  std::mt19937_64 rng_;
  State state_{};
  int steps_ = 0;
  bool started_ = false;
};

}  // namespace ddprpc::models
