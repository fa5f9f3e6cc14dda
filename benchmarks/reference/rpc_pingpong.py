"""PyTorch's side of rpc_pingpong: TensorPipe round trips between two processes.

Rank 0 calls rank 1 with rpc_sync(identity, tensor) for 16 B, 64 KiB, 4 MiB and 64 MiB of
float32 and records p50/p90 microseconds per call, then 5000 pipelined rpc_async calls
(calls/s). Writes the figures as JSON to the path given (rpc_pingpong reads it and prints them
beside its own).

    .venv/bin/python3 benchmarks/reference/rpc_pingpong.py out.json

With RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT in the environment (rpc_pingpong starts
it so, one process per rank, on the network namespaces of its own ranks) it runs that one
rank; otherwise it spawns both on loopback. --network_path restricts TensorPipe to its TCP
transport and basic channel (uv, basic): what crosses hosts, with no shared memory or
cross-memory copies.
"""
import argparse
import json
import os
import socket
import time

import torch
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp

SIZES = [4, 16384, 1048576, 16777216]  # 16 B, 64 KiB, 4 MiB, 64 MiB of float32


def identity(t):
    return t


def pct(xs, p):
    # The same rule as rpc_pingpong's: sorted[floor(n * p)].
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(len(xs) * p))]


def counts(numel, huge_iters):
    # (untimed, timed) calls, as rpc_pingpong's warmup_calls / timed_calls.
    if numel > (4 << 20):
        return 5, huge_iters
    return 50, (2000 if numel < 1e6 else 200)


def bytes_read():
    """Bytes this process has read through read(2)-like calls, sockets included (rchar)."""
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("rchar:"):
                return int(line.split()[1])
    raise RuntimeError("no rchar in /proc/self/io")


def run(rank, addr, port, args):
    # The network path: TCP only (no shared memory, no cross-memory copies).
    # The restriction must go to the constructor: TensorPipeRpcBackendOptions
    # is a Python class, so assigning opts._transports afterwards only adds
    # an attribute that nothing reads.
    restrict = {"_transports": ["uv"], "_channels": ["basic"]} if args.network_path else {}
    opts = rpc.TensorPipeRpcBackendOptions(num_worker_threads=8,
                                           init_method=f"tcp://{addr}:{port}", **restrict)
    rpc.init_rpc(f"w{rank}", rank=rank, world_size=2, rpc_backend_options=opts)
    if rank == 0:
        res = {}
        for numel in SIZES:
            t = torch.ones(numel)
            warmup, n = counts(numel, args.huge_iters)
            for _ in range(warmup):
                rpc.rpc_sync("w1", identity, args=(t,))
            lat = []
            before = bytes_read()
            for _ in range(n):
                s = time.perf_counter()
                rpc.rpc_sync("w1", identity, args=(t,))
                lat.append((time.perf_counter() - s) * 1e6)
            received = bytes_read() - before
            if args.network_path and received < n * numel * 4:
                # The replies' bytes came some other way than the socket:
                # TensorPipe's shared-memory or cross-memory channel.
                raise SystemExit(f"rpc_pingpong.py: {n} replies of {numel * 4} bytes, but only "
                                 f"{received} bytes were read from sockets: TensorPipe did not "
                                 f"keep to its TCP transport and basic channel")
            res[f"sync_{numel * 4}B"] = {"p50_us": pct(lat, .5), "p90_us": pct(lat, .9)}
        t = torch.ones(4)
        s = time.perf_counter()
        futs = [rpc.rpc_async("w1", identity, args=(t,)) for _ in range(5000)]
        torch.futures.wait_all(futs)
        res["async_16B_calls_per_s"] = 5000 / (time.perf_counter() - s)
        print(json.dumps(res, indent=1))
        with open(args.out, "w") as f:
            json.dump(res, f)
    rpc.shutdown()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--network_path", action="store_true")
    parser.add_argument("--huge_iters", type=int, default=20)
    parser.add_argument("out", nargs="?", default="pytorch_rpc_pingpong.json")
    args = parser.parse_args()
    if "RANK" in os.environ:
        run(int(os.environ["RANK"]), os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
            args)
    else:
        mp.spawn(run, args=("127.0.0.1", free_port(), args), nprocs=2, join=True)
