"""PyTorch's side of batch_rpc: the batch-RPC tutorial's two programs on PyTorch's own RPC.

1. Batch-updating parameter server (@rpc.functions.async_execution): T trainers train the same small
   CNN as batch_rpc (conv 3->8, conv 8->16, linear 1024->30; random 3x32x32 images, batch 20, MSE
   against one-hot labels); each sends its gradients with rpc_sync; the last of a round runs the SGD
   step (lr, momentum 0.9) and completes the shared future, answering everyone with the new model.
   Reported per trainer count: model updates per second over the measured iterations.
2. Batch CartPole REINFORCE: one agent, world_size - 1 observers, each stepping its own CartPole-v1
   (the same physics as models/cartpole.cc) for --steps steps per episode and asking the agent for
   every action, one at a time (select_action) or batched (select_action_batch, async execution).
   Reported per world size: seconds for --episodes episodes with and without batching.

Every process runs with one intra-op thread, as batch_rpc's do. Writes JSON to --json; batch_rpc runs
this with --python (.venv's by default) and prints the ratios.

    .venv/bin/python3 benchmarks/reference/batch_rpc.py --mode all --json out.json
"""
import argparse
import json
import math
import random
import socket
import threading
import time

import torch
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.rpc import RRef

NUM_CLASSES, BATCH, IMAGE = 30, 20, 32


class ImageModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1)
        self.fc = nn.Linear(16 * (IMAGE // 4) * (IMAGE // 4), NUM_CLASSES)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc(x.flatten(1))


class BatchUpdateParameterServer:
    def __init__(self, batch_update_size, lr, seed):
        torch.manual_seed(seed)
        self.model = ImageModel()
        self.lock = threading.Lock()
        self.future_model = torch.futures.Future()
        self.batch_update_size = batch_update_size
        self.curr_update_size = 0
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=lr, momentum=0.9)
        for p in self.model.parameters():
            p.grad = torch.zeros_like(p)
        self.update_times = []

    def get_model(self):
        return [p.detach().clone() for p in self.model.parameters()]

    @staticmethod
    @rpc.functions.async_execution
    def update_and_fetch_model(ps_rref, grads):
        self = ps_rref.local_value()
        with self.lock:
            self.curr_update_size += 1
            for p, g in zip(self.model.parameters(), grads):
                p.grad += g
            fut = self.future_model
            if self.curr_update_size >= self.batch_update_size:
                for p in self.model.parameters():
                    p.grad /= self.batch_update_size
                self.curr_update_size = 0
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=False)
                fut.set_result([p.detach().clone() for p in self.model.parameters()])
                self.update_times.append(time.perf_counter())
                self.future_model = torch.futures.Future()
        return fut

    def updates_per_s(self, warmup):
        t = self.update_times
        n = len(t)
        if n <= warmup or warmup < 1 or t[-1] <= t[warmup - 1]:
            return 0.0
        return (n - warmup) / (t[-1] - t[warmup - 1])


def train(ps_rref, seed, iterations):
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(seed)
    m = ImageModel()
    labels = torch.zeros(BATCH, NUM_CLASSES).scatter_(1, torch.randint(0, NUM_CLASSES, (BATCH, 1), generator=gen), 1)
    with torch.no_grad():
        for p, v in zip(m.parameters(), ps_rref.rpc_sync().get_model()):
            p.copy_(v)
    for _ in range(iterations):
        inputs = torch.randn(BATCH, 3, IMAGE, IMAGE, generator=gen)
        m.zero_grad(set_to_none=True)
        F.mse_loss(m(inputs), labels).backward()
        model = rpc.rpc_sync(ps_rref.owner(), BatchUpdateParameterServer.update_and_fetch_model,
                             args=(ps_rref, [p.grad for p in m.parameters()]))
        with torch.no_grad():
            for p, v in zip(m.parameters(), model):
                p.copy_(v)
    return iterations


def run_ps(trainers, a):
    ps_rref = rpc.remote("ps", BatchUpdateParameterServer, args=(trainers, a["ps_lr"], a["seed"]))
    iterations = a["warmup"] + a["iters"]
    futs = [rpc.rpc_async(f"trainer{i}", train, args=(ps_rref, a["seed"] + 1 + i, iterations), timeout=0)
            for i in range(trainers)]
    torch.futures.wait_all(futs)
    return ps_rref.local_value().updates_per_s(a["warmup"])


# CartPole-v1, as models/cartpole.cc (gym's constants and Euler order).
class CartPole:
    GRAVITY, MASSCART, MASSPOLE, LENGTH, FORCE, TAU = 9.8, 1.0, 0.1, 0.5, 10.0, 0.02
    TOTAL = MASSCART + MASSPOLE
    POLEMASS_LENGTH = MASSPOLE * LENGTH
    THETA_LIMIT, X_LIMIT, MAX_STEPS = 12 * 2 * math.pi / 360, 2.4, 500

    def __init__(self, seed):
        self.rng = random.Random(seed)

    def reset(self):
        self.state = [self.rng.uniform(-0.05, 0.05) for _ in range(4)]
        self.steps = 0
        return self.state

    def step(self, action):
        x, x_dot, theta, theta_dot = self.state
        force = self.FORCE if action == 1 else -self.FORCE
        c, s = math.cos(theta), math.sin(theta)
        temp = (force + self.POLEMASS_LENGTH * theta_dot * theta_dot * s) / self.TOTAL
        thetaacc = (self.GRAVITY * s - c * temp) / (self.LENGTH * (4.0 / 3.0 - self.MASSPOLE * c * c / self.TOTAL))
        xacc = temp - self.POLEMASS_LENGTH * thetaacc * c / self.TOTAL
        x, x_dot = x + self.TAU * x_dot, x_dot + self.TAU * xacc
        theta, theta_dot = theta + self.TAU * theta_dot, theta_dot + self.TAU * thetaacc
        self.state = [x, x_dot, theta, theta_dot]
        self.steps += 1
        done = abs(x) > self.X_LIMIT or abs(theta) > self.THETA_LIMIT or self.steps >= self.MAX_STEPS
        return self.state, 1.0, done


class Policy(nn.Module):
    def __init__(self):
        super().__init__()
        self.affine1 = nn.Linear(4, 128)
        self.dropout = nn.Dropout(p=0.6)
        self.affine2 = nn.Linear(128, 2)

    def forward(self, x):
        return F.softmax(self.affine2(F.relu(self.dropout(self.affine1(x)))), dim=-1)


class Observer:
    def __init__(self, batch, seed, gamma):
        self.id = rpc.get_worker_info().id - 1
        self.env = CartPole(seed)
        self.gamma = gamma
        self.select_action = Agent.select_action_batch if batch else Agent.select_action

    def run_episode(self, agent_rref, n_steps):
        state, start, rewards = self.env.reset(), 0, [0.0] * n_steps
        for step in range(n_steps):
            action = rpc.rpc_sync(agent_rref.owner(), self.select_action,
                                  args=(agent_rref, self.id, torch.tensor([state], dtype=torch.float)))
            state, reward, done = self.env.step(action)
            rewards[step] = reward
            if done or step + 1 >= n_steps:
                ret = 0.0
                for i in range(step, start - 1, -1):
                    ret = rewards[i] + self.gamma * ret
                    rewards[i] = ret
                state, start = self.env.reset(), step + 1
        return torch.tensor(rewards)


class Agent:
    def __init__(self, world_size, batch, seed, gamma, lr):
        torch.manual_seed(seed)
        self.ob_rrefs = [rpc.remote(f"observer{r}", Observer, args=(batch, seed + 1000 * r, gamma))
                         for r in range(1, world_size)]
        self.policy = Policy()
        self.optimizer = torch.optim.Adam(self.policy.parameters(), lr=lr)
        self.batch = batch
        self.n = world_size - 1
        self.lock = threading.Lock()
        self.reset()

    def reset(self):
        self.saved_log_probs = [] if self.batch else {i: [] for i in range(self.n)}
        self.states = torch.zeros(self.n, 1, 4)
        self.pending = self.n
        self.future_actions = torch.futures.Future()

    @staticmethod
    def select_action(agent_rref, ob_id, state):
        self = agent_rref.local_value()
        probs = self.policy(state)
        action = torch.multinomial(probs, 1)
        with self.lock:
            self.saved_log_probs[ob_id].append(torch.log(probs.gather(1, action)).reshape(()))
        return action.item()

    @staticmethod
    @rpc.functions.async_execution
    def select_action_batch(agent_rref, ob_id, state):
        self = agent_rref.local_value()
        with self.lock:
            self.states[ob_id].copy_(state)
            fut = self.future_actions.then(lambda f: f.wait()[ob_id].item())
            self.pending -= 1
            if self.pending == 0:
                self.pending = self.n
                probs = self.policy(self.states.clone()).view(self.n, 2)
                actions = torch.multinomial(probs, 1)
                self.saved_log_probs.append(torch.log(probs.gather(1, actions)).view(self.n))
                current, self.future_actions = self.future_actions, torch.futures.Future()
                current.set_result(actions.view(-1))
        return fut

    def run_episode(self, n_steps):
        futs = [ob.rpc_async(timeout=0).run_episode(RRef(self), n_steps) for ob in self.ob_rrefs]
        rewards = torch.stack(torch.futures.wait_all(futs)).t()  # [steps, observers]
        with self.lock:
            if self.batch:
                log_probs = torch.stack(self.saved_log_probs)
            else:
                log_probs = torch.stack([torch.stack(self.saved_log_probs[i]) for i in range(self.n)]).t()
            self.reset()
        (-log_probs * rewards / self.n).sum().backward()
        self.optimizer.step()
        self.optimizer.zero_grad()


def run_cartpole(world_size, a):
    out = {"world_size": world_size}
    for batch in (True, False):
        agent = Agent(world_size, batch, a["seed"], a["gamma"], a["lr"])
        t0 = time.perf_counter()
        for _ in range(a["episodes"]):
            agent.run_episode(a["steps"])
        out["batch_s" if batch else "nobatch_s"] = time.perf_counter() - t0
    return out


def worker(rank, world, task, arg, a, port, results):
    torch.set_num_threads(1)
    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}",
                                           num_worker_threads=a["num_worker_threads"], rpc_timeout=600)
    if task == "ps":
        name = "ps" if rank == 0 else f"trainer{rank - 1}"
    else:
        name = "agent" if rank == 0 else f"observer{rank}"
    rpc.init_rpc(name, rank=rank, world_size=world, rpc_backend_options=opts)
    if rank == 0:
        results.put(run_ps(arg, a) if task == "ps" else run_cartpole(arg, a))
    rpc.shutdown()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(task, arg, world, a):
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=worker, args=(r, world, task, arg, a, port, results)) for r in range(world)]
    for p in procs:
        p.start()
    out = results.get(timeout=a["timeout_s"])
    for p in procs:
        p.join(timeout=a["timeout_s"])
    return out


def int_list(text):
    if ".." in text:
        lo, hi = text.split("..")
        return list(range(int(lo), int(hi) + 1))
    return [int(v) for v in text.split(",") if v]


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["ps", "cartpole", "all"], default="all")
    ap.add_argument("--trainers", default="2,4,8")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--ps_lr", type=float, default=0.001)
    ap.add_argument("--world_sizes", default="2..11")
    ap.add_argument("--episodes", type=int, default=10)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--seed", type=int, default=543)
    ap.add_argument("--gamma", type=float, default=1.0)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--num_worker_threads", type=int, default=16)
    ap.add_argument("--timeout_s", type=int, default=600)
    ap.add_argument("--json", default="")
    a = vars(ap.parse_args())
    res = {"ps": [], "cartpole": []}
    print(f"PyTorch {torch.__version__} batch RPC reference", flush=True)
    if a["mode"] in ("ps", "all"):
        for t in int_list(a["trainers"]):
            ups = launch("ps", t, t + 1, a)
            print(f"ps trainers={t}: {ups:.1f} updates/s", flush=True)
            res["ps"].append({"trainers": t, "updates_per_s": ups})
    if a["mode"] in ("cartpole", "all"):
        for w in int_list(a["world_sizes"]):
            r = launch("cartpole", w, w, a)
            print(f"cartpole world_size={w}: batch {r['batch_s']:.3f}s, no-batch {r['nobatch_s']:.3f}s", flush=True)
            res["cartpole"].append(r)
    if a["json"]:
        with open(a["json"], "w") as f:
            json.dump(res, f, indent=1)
