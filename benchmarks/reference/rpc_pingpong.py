"""PyTorch's side of rpc_pingpong: TensorPipe round trips between two processes on loopback.

Rank 0 calls rank 1 with rpc_sync(identity, tensor) for 16 B, 64 KiB and 4 MiB of float32 and
records p50/p90 microseconds per call, then 5000 pipelined rpc_async calls (calls/s). Writes
the figures as JSON to the path given (rpc_pingpong reads it and prints them beside its own).

    .venv/bin/python3 benchmarks/reference/rpc_pingpong.py out.json
"""
import json
import socket
import sys
import time

import torch
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp


def identity(t):
    return t


def pct(xs, p):
    # The same rule as rpc_pingpong's: sorted[floor(n * p)].
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(len(xs) * p))]


def run(rank, port, out):
    opts = rpc.TensorPipeRpcBackendOptions(num_worker_threads=8, init_method=f"tcp://127.0.0.1:{port}")
    rpc.init_rpc(f"w{rank}", rank=rank, world_size=2, rpc_backend_options=opts)
    if rank == 0:
        res = {}
        for numel in [4, 16384, 1048576]:  # 16 B, 64 KiB, 4 MiB of float32
            t = torch.ones(numel)
            for _ in range(50):
                rpc.rpc_sync("w1", identity, args=(t,))
            n = 2000 if numel < 1e6 else 200
            lat = []
            for _ in range(n):
                s = time.perf_counter()
                rpc.rpc_sync("w1", identity, args=(t,))
                lat.append((time.perf_counter() - s) * 1e6)
            res[f"sync_{numel * 4}B"] = {"p50_us": pct(lat, .5), "p90_us": pct(lat, .9)}
        t = torch.ones(4)
        s = time.perf_counter()
        futs = [rpc.rpc_async("w1", identity, args=(t,)) for _ in range(5000)]
        torch.futures.wait_all(futs)
        res["async_16B_calls_per_s"] = 5000 / (time.perf_counter() - s)
        print(json.dumps(res, indent=1))
        with open(out, "w") as f:
            json.dump(res, f)
    rpc.shutdown()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    out = sys.argv[1] if len(sys.argv) > 1 else "pytorch_rpc_pingpong.json"
    mp.spawn(run, args=(free_port(), out), nprocs=2, join=True)
