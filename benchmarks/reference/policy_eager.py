"""Eager PyTorch (Debian's python3-torch) on the PPO policies of //models:ppo_policy.

Run: /usr/bin/python3 benchmarks/reference/policy_eager.py --threads 1 --json out.json
Writes {"mlp": {"1": calls_per_s, "4": ..., "16": ...}, "cnn": {...}}: forward_exploration
(encoder + heads + Gumbel-max sample) calls per second, median of trials.
"""
import argparse, json, time
import torch, torch.nn as nn

class Policy(nn.Module):
    def __init__(self, kind, obs=4, actions=2):
        super().__init__()
        self.kind = kind
        if kind == "mlp":
            self.enc = nn.Sequential(nn.Linear(obs, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh())
        else:
            actions = 6
            self.enc = nn.Sequential(nn.Conv2d(4, 16, 8, 4, 2), nn.ReLU(), nn.Conv2d(16, 32, 4, 2, 2), nn.ReLU(),
                                     nn.Conv2d(32, 256, 11), nn.ReLU(), nn.Flatten())
        self.pi, self.vf = nn.Linear(256, actions), nn.Linear(256, 1)
    def forward_exploration(self, x):
        h = self.enc(x); logits = self.pi(h); self.vf(h)
        u = torch.rand_like(logits).clamp_(1e-10, 1.0)
        return torch.argmax(logits - torch.log(-torch.log(u)), dim=1)

def rate(fn, ms, trials):
    out = []
    for _ in range(trials):
        n, s = 0, time.perf_counter()
        while time.perf_counter() - s < ms / 1000:
            fn(); n += 1
        out.append(n / (time.perf_counter() - s))
    out.sort(); return out[len(out) // 2]

if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1); ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--trial_ms", type=int, default=200); ap.add_argument("--json", default="")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    res = {}
    with torch.no_grad():
        for kind in ("mlp", "cnn"):
            p = Policy(kind).eval(); res[kind] = {}
            for b in (1, 4, 16):
                x = torch.randn(b, 4) if kind == "mlp" else torch.rand(b, 4, 84, 84)
                for _ in range(20): p.forward_exploration(x)
                res[kind][str(b)] = rate(lambda: p.forward_exploration(x), a.trial_ms, a.trials)
                print(kind, b, round(res[kind][str(b)]), "calls/s", flush=True)
    if a.json: json.dump(res, open(a.json, "w"))
