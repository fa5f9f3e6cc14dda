"""torch.distributed (gloo) allreduce bus bandwidth, the reference for //benchmarks:allreduce.

Run: .venv/bin/python3 benchmarks/reference/allreduce_gloo.py --nprocs 2 --json out.json
With RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT in the environment it runs that one rank
(allreduce --hosts starts it so, on the namespaces of its own ranks).
Prints one line per size and writes {"<bytes>": {"median_s": t, "busbw_gbps": b}}.
"""
import argparse, json, os, statistics, time
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SIZES = [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]

def iters_for(nbytes):
    # As ddprpc's side (benchmarks/allreduce.cc): at least 9 timed calls.
    return max(9, min(200, (256 << 20) // nbytes))

def run(rank, n, port, out, host="127.0.0.1"):
    dist.init_process_group("gloo", init_method=f"tcp://{host}:{port}", rank=rank, world_size=n)
    res = {}
    for nbytes in SIZES:
        t = torch.ones(nbytes // 4)
        for _ in range(3):
            dist.all_reduce(t)
        times = []
        for _ in range(iters_for(nbytes)):
            dist.barrier()
            s = time.perf_counter(); dist.all_reduce(t); times.append(time.perf_counter() - s)
        med = statistics.median(times)  # the middle two's mean, as ddprpc's side takes it
        res[str(nbytes)] = {"median_s": med, "busbw_gbps": nbytes * 2 * (n - 1) / n / med / 1e9}
        if rank == 0:
            print(f"{nbytes:>10} B  {med * 1e6:10.1f} us  {res[str(nbytes)]['busbw_gbps']:7.3f} GB/s", flush=True)
    if rank == 0 and out:
        json.dump(res, open(out, "w"))
    dist.destroy_process_group()

if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--nprocs", type=int, default=2)
    ap.add_argument("--port", type=int, default=29800)
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    torch.set_num_threads(1)
    if "RANK" in os.environ:
        # One rank of a launcher (allreduce --hosts): RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT.
        assert int(os.environ["WORLD_SIZE"]) == a.nprocs
        run(int(os.environ["RANK"]), a.nprocs, int(os.environ["MASTER_PORT"]), a.json,
            os.environ["MASTER_ADDR"])
        raise SystemExit(0)
    mp.spawn(run, args=(a.nprocs, a.port, a.json), nprocs=a.nprocs, join=True)
