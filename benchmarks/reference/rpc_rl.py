"""PyTorch's own RPC reinforcement-learning benchmark, the workload of //benchmarks:rpc_rl.

A one-file condensation of pytorch/benchmarks/distributed/rpc/rl (launcher,
coordinator, agent, observer) for PyTorch 2.13 (the project's .venv):

  .venv/bin/python3 benchmarks/reference/rpc_rl.py --world_size 3,5,10 --batch true \
      --output_file_path rl_pytorch.json

Rank 0 is the coordinator, rank 1 the agent, ranks 2.. the observers. Every
observer sends a random state of --state_size to the agent by rpc_sync and
waits for an action, --episode_steps times per episode. The agent's policy is
Flatten -> Linear(prod(state_size), out_features) -> nlayers x
Linear(out_features, out_features) -> softmax, sampled with Categorical.
batch=false: each request runs alone; batch=true: select_action_batch is an
@rpc.functions.async_execution function that gathers one state per observer
and answers all of them from one policy call. The JSON has the same shape as
//benchmarks:rpc_rl's: {"x_axis_name", "benchmark_results": [{x, metric: {p50..}}]}.
"""
import argparse
import json
import os
import random
import threading
import time
from functools import reduce

import numpy as np
import torch
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributions import Categorical

COORDINATOR_NAME = "coordinator"
AGENT_NAME = "agent"
OBSERVER_NAME = "observer{}"
METRICS = ["agent latency (seconds)", "agent throughput", "observer latency (seconds)",
           "observer throughput"]
PERCENTILES = [50, 75, 90, 95]


class Policy(nn.Module):
    def __init__(self, in_features, nlayers, out_features):
        super().__init__()
        self.model = nn.Sequential(
            nn.Flatten(1, -1), nn.Linear(in_features, out_features),
            *[nn.Linear(out_features, out_features) for _ in range(nlayers)])

    def forward(self, x):
        return F.softmax(self.model(x), dim=-1)


class Agent:
    def __init__(self):
        self.lock = threading.Lock()
        self.future_actions = torch.futures.Future()
        self.reset_metrics()

    def reset_metrics(self):
        self.agent_latency, self.agent_throughput = [], []

    def set_world(self, batch_size, state_size, nlayers, out_features, batch):
        self.batch, self.batch_size, self.state_size = batch, batch_size, state_size
        self.policy = Policy(reduce(lambda x, y: x * y, state_size), nlayers, out_features)
        self.saved_log_probs = [] if batch else {k: [] for k in range(batch_size)}
        self.pending_states = batch_size
        self.states = torch.zeros(batch_size, *state_size)

    @staticmethod
    @rpc.functions.async_execution
    def select_action_batch(agent_rref, observer_id, state):
        self = agent_rref.local_value()
        observer_id -= 2
        self.states[observer_id].copy_(state)
        future_action = self.future_actions.then(
            lambda future_actions: future_actions.wait()[observer_id].item())
        with self.lock:
            if self.pending_states == self.batch_size:
                self.agent_latency_start = time.time()
            self.pending_states -= 1
            if self.pending_states == 0:
                self.pending_states = self.batch_size
                probs = self.policy(self.states)
                m = Categorical(probs)
                actions = m.sample()
                self.saved_log_probs.append(m.log_prob(actions).t())
                future_actions = self.future_actions
                self.future_actions = torch.futures.Future()
                future_actions.set_result(actions)
                latency = time.time() - self.agent_latency_start
                self.agent_latency.append(latency)
                self.agent_throughput.append(self.batch_size / latency)
        return future_action

    @staticmethod
    def select_action_non_batch(agent_rref, observer_id, state):
        self = agent_rref.local_value()
        observer_id -= 2
        start = time.time()
        probs = self.policy(state.float().unsqueeze(0))
        m = Categorical(probs)
        action = m.sample()
        with self.lock:
            self.saved_log_probs[observer_id].append(m.log_prob(action))
        latency = time.time() - start
        self.agent_latency.append(latency)
        self.agent_throughput.append(1 / latency)
        return action.item()

    def finish_episode(self):
        out = (self.agent_latency, self.agent_throughput)
        self.reset_metrics()
        self.saved_log_probs = [] if self.batch else {k: [] for k in range(self.batch_size)}
        return out


class Observer:
    def __init__(self):
        self.id = rpc.get_worker_info().id

    def set_state(self, state_size, batch):
        self.state_size = state_size
        self.select_action = Agent.select_action_batch if batch else Agent.select_action_non_batch

    def run_ob_episode(self, agent_rref, n_steps):
        state = torch.rand(self.state_size)
        rewards = torch.zeros(n_steps)
        latencies, throughputs = [], []
        for st in range(n_steps):
            start = time.time()
            rpc.rpc_sync(agent_rref.owner(), self.select_action, args=(agent_rref, self.id, state))
            latency = time.time() - start
            latencies.append(latency)
            throughputs.append(1 / latency)
            state, rewards[st] = torch.rand(self.state_size), random.randint(0, 1)
        return [rewards, None, latencies, throughputs]


def run_coordinator(args, world_size):
    batch_size = world_size - 2
    agent_rref = rpc.remote(AGENT_NAME, Agent)
    ob_rrefs = []
    for rank in range(2, world_size):
        ob = rpc.remote(OBSERVER_NAME.format(rank), Observer)
        ob.rpc_sync().set_state(args.state_size, args.batch)
        ob_rrefs.append(ob)
    agent_rref.rpc_sync().set_world(batch_size, args.state_size, args.nlayers, args.out_features,
                                    args.batch)
    agent_lat, agent_tp, ob_lat, ob_tp = [], [], [], []
    for ep in range(args.episodes):
        start = time.time()
        futs = [ob.rpc_async().run_ob_episode(agent_rref, args.episode_steps) for ob in ob_rrefs]
        rets = torch.futures.wait_all(futs)
        lat, tp = agent_rref.rpc_sync().finish_episode()
        agent_lat += lat
        agent_tp += tp
        for ret in rets:
            ob_lat += ret[2]
            ob_tp += ret[3]
        print(f"Episode {ep} - {time.time() - start:.3f}", flush=True)
    metrics = {}
    for name, samples in zip(METRICS, [agent_lat, agent_tp, ob_lat, ob_tp]):
        metrics[name] = {f"p{p}": float(np.percentile(sorted(samples), p)) for p in PERCENTILES}
    metrics["requests"] = len(ob_lat)
    return metrics


def run_worker(rank, args, world_size, port, queue):
    os.environ["MASTER_ADDR"] = args.master_addr
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    options = rpc.TensorPipeRpcBackendOptions(num_worker_threads=16, rpc_timeout=300)
    name = COORDINATOR_NAME if rank == 0 else AGENT_NAME if rank == 1 else OBSERVER_NAME.format(rank)
    rpc.init_rpc(name, rank=rank, world_size=world_size, rpc_backend_options=options)
    if rank == 0:
        queue.put(run_coordinator(args, world_size))
    rpc.shutdown()


def main():
    p = argparse.ArgumentParser(description="PyTorch RPC RL benchmark (reference for //benchmarks:rpc_rl)")
    p.add_argument("--world_size", default="5")
    p.add_argument("--master_addr", default="127.0.0.1")
    p.add_argument("--master_port", default="29501")
    p.add_argument("--batch", default="true")
    p.add_argument("--state_size", default="10-20-10")
    p.add_argument("--nlayers", default="5")
    p.add_argument("--out_features", default="10")
    p.add_argument("--episodes", default="10")
    p.add_argument("--episode_steps", default="10")
    p.add_argument("--output_file_path", default="rl_pytorch.json")
    raw = vars(p.parse_args())
    listed = [k for k in ("world_size", "batch", "state_size", "nlayers", "out_features",
                          "episodes", "episode_steps") if "," in raw[k]]
    if len(listed) > 1:
        raise SystemExit(f"only one argument may hold a comma list, got {listed}")
    x_axis = listed[0] if listed else None
    report = {"x_axis_name": x_axis, "benchmark_results": []}
    for x in raw[x_axis].split(",") if x_axis else [None]:
        v = dict(raw)
        if x_axis:
            v[x_axis] = x
        args = argparse.Namespace(
            master_addr=v["master_addr"], batch=v["batch"].lower() in ("1", "true", "yes"),
            state_size=[int(s) for s in v["state_size"].split("-")], nlayers=int(v["nlayers"]),
            out_features=int(v["out_features"]), episodes=int(v["episodes"]),
            episode_steps=int(v["episode_steps"]))
        world_size = int(v["world_size"])
        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        port = int(v["master_port"]) + (len(report["benchmark_results"]) if x_axis else 0)
        mp.spawn(run_worker, args=(args, world_size, port, queue), nprocs=world_size, join=True)
        result = queue.get()
        if x_axis:
            result[x_axis] = x
        report["benchmark_results"].append(result)
    print(json.dumps(report))
    with open(raw["output_file_path"], "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()
