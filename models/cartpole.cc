#include "models/cartpole.h"

#include <cmath>
#include <stdexcept>
#include <string>

namespace ddprpc::models {

CartPole::State CartPole::reset() {
  std::uniform_real_distribution<double> u(-0.05, 0.05);
  for (double& v : state_) v = u(rng_);
  steps_ = 0;
  started_ = true;
  return state_;
}

CartPole::Step CartPole::step(int64_t action) {
  if (action != 0 && action != 1) {
    throw std::invalid_argument("CartPole::step: action must be 0 or 1, got " +
                                std::to_string(action));
  }
  if (!started_) throw std::invalid_argument("CartPole::step called before reset()");
  auto [x, x_dot, theta, theta_dot] = state_;
  const double force = action == 1 ? kForceMag : -kForceMag;
  const double costheta = std::cos(theta), sintheta = std::sin(theta);
  const double temp = (force + kPoleMassLength * theta_dot * theta_dot * sintheta) / kTotalMass;
  const double thetaacc = (kGravity * sintheta - costheta * temp) /
                          (kLength * (4.0 / 3.0 - kMassPole * costheta * costheta / kTotalMass));
  const double xacc = temp - kPoleMassLength * thetaacc * costheta / kTotalMass;
  // Euler, in gym's order: positions use the old velocities.
  x += kTau * x_dot;
  x_dot += kTau * xacc;
  theta += kTau * theta_dot;
  theta_dot += kTau * thetaacc;
  state_ = {x, x_dot, theta, theta_dot};
  ++steps_;
  Step out;
  out.state = state_;
  out.reward = 1.0;
  out.terminated = x < -kXThreshold || x > kXThreshold || theta < -kThetaThreshold ||
                   theta > kThetaThreshold;
  out.truncated = !out.terminated && steps_ >= kMaxEpisodeSteps;
  return out;
}

}  // namespace ddprpc::models
