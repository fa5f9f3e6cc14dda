"""PyTorch's side of ddp_rpc: the same hybrid DDP + RPC workload on PyTorch's own stack (CPU, Gloo, TensorPipe).

Master + T trainers + P parameter servers; each PS holds an EmbeddingBag(num_embeddings, dim, mode=sum)
created by the master with rpc.remote; each trainer runs the FC stack 512-256-128-(relu)-64-32-8 under
DDP (gloo), looks the embeddings up on every PS by RRef, and trains with dist_autograd +
DistributedOptimizer(SGD, lr=0.05). One iteration = 10 batches of 20..50 indices. Every process runs with
one intra-op thread, as ddprpc's ranks do. Lookups go to all parameter servers at once (rpc_async), the
same program as ddprpc's HybridModel; --lookups sequential runs them one after another, as PyTorch's
original benchmark does. ddp_rpc runs this with --python (.venv's by default) and prints its table beside its own.

    .venv/bin/python3 benchmarks/reference/ddp_rpc.py --trainers 8 --ps 8 --iters 20 --warmup 2 --json out.json
"""
import argparse, json, os, random, sys, time
import numpy as np
import torch, torch.nn as nn
import torch.distributed as dist
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp
from torch.distributed.optim import DistributedOptimizer
from torch.distributed.rpc import RRef
from torch.nn.parallel import DistributedDataParallel as DDP

A = None

class HybridModel(nn.Module):
    def __init__(self, embs, fc_in):
        super().__init__()
        self.embs = embs
        self.fc_in = fc_in
        self.ddp = DDP(nn.Sequential(nn.Linear(fc_in, 256), nn.Linear(256, 128), nn.ReLU(),
                                     nn.Linear(128, 64), nn.Linear(64, 32), nn.Linear(32, 8)))
    def forward(self, indices, offsets):
        if A["lookups"] == "sequential":  # as PyTorch's original benchmark
            outs = [e.rpc_sync().forward(indices, offsets) for e in self.embs]
        else:  # all parameter servers at once, as ddprpc's HybridModel does
            futs = [e.rpc_async().forward(indices, offsets) for e in self.embs]
            outs = torch.futures.wait_all(futs)
        return self.ddp(torch.cat(outs, dim=1))

def emb_params(emb_rref):
    return [RRef(p) for p in emb_rref.local_value().parameters()]

def batches(n_emb):
    for _ in range(10):
        k = random.randint(20, 50)
        idx = torch.LongTensor(k).random_(0, n_emb)
        offs, s = [], 0
        while s < k:
            offs.append(s); s += random.randint(1, 10)
        yield idx, torch.LongTensor(offs), torch.LongTensor(len(offs)).random_(8)

def run_trainer(embs, rank, a):
    random.seed(rank); torch.manual_seed(rank)
    model = HybridModel(embs, a["ps"] * a["dim"])
    prefs = []
    for i, e in enumerate(embs):
        prefs.extend(rpc.rpc_sync(f"ps{i}", emb_params, args=(e,)))
    prefs += [RRef(p) for p in model.parameters()]
    opt = DistributedOptimizer(torch.optim.SGD, prefs, lr=0.05)
    crit = nn.CrossEntropyLoss()
    meas, exs = [], []
    for it in range(a["iters"] + a["warmup"]):
        t0 = time.time(); n = 0
        for idx, offs, tgt in batches(a["emb"]):
            n += len(tgt)
            with dist_autograd.context() as ctx:
                loss = crit(model(idx, offs), tgt)
                dist_autograd.backward(ctx, [loss])
                opt.step(ctx)
        if it >= a["warmup"]:
            meas.append(time.time() - t0); exs.append(n)
    return rank, meas, exs

def pct_line(name, meas, exs):
    m = np.array(meas); e = np.array(exs, dtype=float)
    parts = []
    out = {}
    for p in (50, 75, 90, 95):
        v = float(np.percentile(m, p)); r = float(np.percentile(e / m, 100 - p))
        parts.append(f"p{p}: {v:.3f}s {r:6.0f}/s"); out[f"p{p}"] = {"sec_per_iter": v, "ex_per_sec": r}
    print(f"{name:>9}: " + "  ".join(parts), flush=True)
    return out

def worker(rank, world, a):
    global A
    A = a
    torch.set_num_threads(1)  # every process single-threaded, as ddprpc's ranks are
    T, P = a["trainers"], a["ps"]
    host = a.get("master_addr", "127.0.0.1")
    # The network path: TCP only (no shared memory, no cross-memory copies),
    # given to the constructor (assigning opts._transports afterwards only
    # adds a Python attribute that nothing reads).
    restrict = {"_transports": ["uv"], "_channels": ["basic"]} if a["network_path"] else {}
    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://{host}:{a['port']}", num_worker_threads=16,
                                           rpc_timeout=600, **restrict)
    if rank == T + P:
        rpc.init_rpc("master", rank=rank, world_size=world, rpc_backend_options=opts)
        t0 = time.time()
        embs = [rpc.remote(f"ps{i}", nn.EmbeddingBag, args=(a["emb"], a["dim"]),
                           kwargs={"mode": "sum", "sparse": bool(a["sparse"])}) for i in range(P)]
        futs = [rpc.rpc_async(f"trainer{r}", run_trainer, args=(embs, r, a)) for r in range(T)]
        res = {}; allm = []; alle = []
        for f in futs:
            r, m, e = f.wait()
            res[f"trainer{r}"] = pct_line(f"Trainer{r}", m, e)
            allm.append(m); alle.append(e)
        # "All": per-iteration time is the slowest trainer's; examples are summed across trainers.
        m_all = np.max(np.array(allm), axis=0); e_all = np.sum(np.array(alle), axis=0)
        res["all"] = pct_line("All", m_all, e_all)
        res["wall_s"] = time.time() - t0; res["config"] = a
        if a["json"]:
            json.dump(res, open(a["json"], "w"), indent=1)
    elif rank < T:
        dist.init_process_group("gloo", rank=rank, world_size=T, init_method=f"tcp://{host}:{a['port'] + 1}")
        rpc.init_rpc(f"trainer{rank}", rank=rank, world_size=world, rpc_backend_options=opts)
    else:
        rpc.init_rpc(f"ps{rank - T}", rank=rank, world_size=world, rpc_backend_options=opts)
    rpc.shutdown()

if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--trainers", type=int, default=8); ap.add_argument("--ps", type=int, default=8)
    ap.add_argument("--emb", type=int, default=300); ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--iters", type=int, default=100); ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--port", type=int, default=29700); ap.add_argument("--json", default="")
    ap.add_argument("--lookups", choices=["concurrent", "sequential"], default="concurrent")
    ap.add_argument("--sparse", type=int, default=0, help="1: EmbeddingBag(sparse=True)")
    ap.add_argument("--network_path", action="store_true",
                    help="TensorPipe's TCP transport and basic channel only (what crosses hosts)")
    a = vars(ap.parse_args())
    torch.set_num_threads(1)
    world = a["trainers"] + a["ps"] + 1
    if "RANK" in os.environ:
        # One rank of a launcher (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), e.g. ddp_rpc's
        # own with --hosts: the store on MASTER_ADDR:MASTER_PORT, the trainers' Gloo group on
        # the next port.
        a["master_addr"] = os.environ["MASTER_ADDR"]
        a["port"] = int(os.environ["MASTER_PORT"])
        rank = int(os.environ["RANK"])
        assert int(os.environ["WORLD_SIZE"]) == world, "WORLD_SIZE must be trainers + ps + 1"
        if rank == 0:
            print(f"PyTorch {torch.__version__} hybrid DDP+RPC reference: {a['trainers']} trainers, {a['ps']} PS, fc_in={a['ps']*a['dim']}, {'sparse' if a['sparse'] else 'dense'} embedding gradients", flush=True)
        t0 = time.time()
        worker(rank, world, a)
        if rank == world - 1:
            print(f"wall {time.time() - t0:.1f}s", flush=True)
        sys.exit(0)
    print(f"PyTorch {torch.__version__} hybrid DDP+RPC reference: {a['trainers']} trainers, {a['ps']} PS, fc_in={a['ps']*a['dim']}, {'sparse' if a['sparse'] else 'dense'} embedding gradients", flush=True)
    t0 = time.time()
    mp.spawn(worker, args=(world, a), nprocs=world, join=True)
    print(f"wall {time.time() - t0:.1f}s", flush=True)
