"""Eager PyTorch (the Python the benchmark names, .venv's by default) on the PPO policies of //models:ppo_policy.

Run: .venv/bin/python3 benchmarks/reference/policy_eager.py --threads 1,2 --json out.json
Measures forward_exploration (encoder + both heads + Gumbel-max sample, as
models/ppo_policy.cc does) in calls per second, the median of timed trials
after warm-up, under torch.inference_mode(). Writes
{"mlp/1/16": calls_per_s, ...} keyed by model/threads/batch.
"""
import argparse
import json
import time

import torch
import torch.nn as nn


class Policy(nn.Module):
    def __init__(self, kind, obs=4, actions=2):
        super().__init__()
        if kind == "mlp":
            self.enc = nn.Sequential(nn.Linear(obs, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh())
        else:
            actions = 6
            self.enc = nn.Sequential(
                nn.Conv2d(4, 16, 8, 4, 2), nn.ReLU(), nn.Conv2d(16, 32, 4, 2, 2), nn.ReLU(),
                nn.Conv2d(32, 256, 11), nn.ReLU(), nn.Flatten())
        self.pi, self.vf = nn.Linear(256, actions), nn.Linear(256, 1)

    def forward_exploration(self, x):
        h = self.enc(x)
        logits, value = self.pi(h), self.vf(h)
        u = torch.rand_like(logits).clamp_(1e-10, 1.0)
        return torch.argmax(logits - torch.log(-torch.log(u)), dim=1), logits, value


def rate(fn, ms, trials):
    out = []
    for _ in range(trials):
        n, start = 0, time.perf_counter()
        while True:
            fn()
            n += 1
            now = time.perf_counter()
            if now - start >= ms / 1000:
                break
        out.append(n / (now - start))
    out.sort()
    return out[len(out) // 2]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="mlp,cnn")
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--threads", default="1", help="comma-separated intra-op thread counts")
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--trial_ms", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    res = {}
    with torch.inference_mode():
        for kind in a.models.split(","):
            p = Policy(kind).eval()
            for threads in (int(t) for t in a.threads.split(",")):
                torch.set_num_threads(threads)
                for b in (int(b) for b in a.batches.split(",")):
                    x = torch.randn(b, 4) if kind == "mlp" else torch.rand(b, 4, 84, 84)
                    for _ in range(a.warmup):
                        p.forward_exploration(x)
                    key = "%s/%d/%d" % (kind, threads, b)
                    res[key] = rate(lambda: p.forward_exploration(x), a.trial_ms, a.trials)
                    print(key, round(res[key]), "calls/s", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f)


if __name__ == "__main__":
    main()
