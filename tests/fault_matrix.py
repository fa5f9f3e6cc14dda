#!/usr/bin/env python3
"""Fault matrix: ddp_rpc across three hosts (network namespaces on a bridge).

Runs ddp_rpc with its roles spread over three namespaces exactly as the
README's multi-host recipe says (RANK / WORLD_SIZE / MASTER_ADDR /
MASTER_PORT, --listen_address), once without a fault and once per fault:
kill -9 and kill -STOP of a trainer, a parameter server, the master and
rank 0 (which hosts the store); one host's link down for 3 s, then up; one
host's link down for good; and, with --elastic, kill -9 and kill -STOP of a
trainer and of a parameter server, and host 2's link (a trainer and a
server) down for good, which must complete with the other trainer and the
lost server's shard restored on the other server, and report what was
lost; a standby trainer (on host 2) called to join, which must join and
train to the end; and kill -9 of rank 0, the store's host, which must end
as without --elastic. Each case must either complete (the master
prints the table) or end with an error naming a worker and a call, within
the RPC timeout + 10 s of the fault, and every process that can end must
have ended 20 s after that. A job that recovers trains on: as long as no
error is reported, it is given that same bound from its last sign of
progress (an iteration of trainer0, the master's table), so a slow machine
is not taken for a hang. A case that lingers prints each process's last
line and saves its threads' stacks (gdb) beside the logs. Prints a table of
cases (seconds from the fault to the first error, and to the last
process's end); leaves no process and no namespace behind. Needs root (ip
netns).

Cases run two at a time by default (--groups), each pair on sets of hosts
of their own: a case spends most of its time waiting for a timeout.

    fault_matrix.py BINARY [--rpc_timeout_s=20] [--cases=a,b,...] [--groups=2]
"""

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time

TRAINERS, PS = 2, 2
# Tensors from 1 KiB up (lookups, dense embedding gradients of 75 KiB) cross
# hosts on the bulk path, so that every fault also lands on its pulls.
BULK_MIN_BYTES = 1024
ITERS = 200  # the fault lands at iteration 20
# However slow the machine, a case ends this long after its fault (the
# 180 iterations after it take 10-15 s here).
MAX_CASE_S = 150
# What gdb may take to save the stacks of a case that lingers, all processes.
STACKS_S = 20
WORLD = TRAINERS + PS + 1
# rank -> host: trainer0 (rank 0, the store) and ps0 on h1; trainer1 and ps1
# on h2; the master on h3.
HOST_OF = {0: 1, 2: 1, 1: 2, 3: 2, 4: 3}
ROLE = {0: "trainer0", 1: "trainer1", 2: "ps0", 3: "ps1", 4: "master"}

CASES = [
    ("none", None, None),
    ("kill -9 trainer1", "KILL", 1),
    ("kill -STOP trainer1", "STOP", 1),
    ("kill -9 ps1", "KILL", 3),
    ("kill -STOP ps1", "STOP", 3),
    ("kill -9 master", "KILL", 4),
    ("kill -STOP master", "STOP", 4),
    ("kill -9 rank 0 (trainer0, store)", "KILL", 0),
    ("kill -STOP rank 0 (trainer0, store)", "STOP", 0),
    ("link of host 2 down 3 s, then up", "FLAP", 2),
    ("link of host 2 down for good", "CUT", 2),
    # With --elastic the job must train on without the lost trainer, and
    # with ps1's shard restored on ps0 (from the replica ps0 holds).
    ("elastic: kill -9 trainer1", "KILL", 1, "elastic"),
    ("elastic: kill -STOP trainer1", "STOP", 1, "elastic"),
    ("elastic: kill -9 ps1", "KILL", 3, "elastic"),
    ("elastic: kill -STOP ps1", "STOP", 3, "elastic"),
    ("elastic: link of host 2 down for good", "CUT", 2, "elastic"),
    # One trainer and a standby (rank 1, on host 2, outside the membership)
    # called to join at iteration 30: it must join over the network and
    # train to the end.
    ("elastic: standby trainer1 joins", None, 1, "elastic", ["--trainers=1", "--add=trainer@iter30"]),
    # The store's host is not elastic: the job ends with an error naming a
    # worker, as without --elastic.
    ("elastic: kill -9 rank 0 (store)", "KILL", 0, "elastic, store lost"),
]
# The master's "All" row (with --elastic after a loss: "All (1 of 2):").
ALL_ROW = re.compile(r"^ *All( \(\d+ of \d+\))?:", re.M)


def sh(*args, check=True):
    return subprocess.run(args, check=check, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True)


class Hosts:
    """Three namespaces h1..h3 on a bridge, 10.<a>.<b>.1..3/24; `group`
    tells apart the sets of hosts of one run."""

    def __init__(self, group=0):
        tag = (os.getpid() % 25000) * 4 + group
        self.prefix = f"ddpf{tag}"
        self.bridge = f"bf{tag}"
        self.net = f"10.{77 + tag % 100}.{tag % 250}"
        self.ns = {i: f"{self.prefix}h{i}" for i in (1, 2, 3)}
        self.veth = {i: f"vf{tag}{i}" for i in (1, 2, 3)}

    def addr(self, host):
        return f"{self.net}.{host}"

    def up(self):
        sh("ip", "link", "add", self.bridge, "type", "bridge")
        sh("ip", "link", "set", self.bridge, "up")
        for i in (1, 2, 3):
            ns, veth = self.ns[i], self.veth[i]
            sh("ip", "netns", "add", ns)
            sh("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
            sh("ip", "link", "set", veth, "master", self.bridge)
            sh("ip", "link", "set", veth, "up")
            sh("ip", "netns", "exec", ns, "ip", "addr", "add", f"{self.addr(i)}/24", "dev", "eth0")
            sh("ip", "netns", "exec", ns, "ip", "link", "set", "eth0", "up")
            sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")

    def link(self, host, up):
        sh("ip", "link", "set", self.veth[host], "up" if up else "down")

    def down(self):
        for i in (1, 2, 3):
            sh("ip", "netns", "pids", self.ns[i], check=False)
            for pid in sh("ip", "netns", "pids", self.ns[i], check=False).stdout.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            sh("ip", "link", "del", self.veth[i], check=False)
            sh("ip", "netns", "del", self.ns[i], check=False)
        sh("ip", "link", "del", self.bridge, check=False)

    def leftovers(self):
        names = sh("ip", "netns", "list", check=False).stdout
        links = sh("ip", "-o", "link", "show", check=False).stdout
        return [n for n in list(self.ns.values()) if n in names] + \
               [l for l in list(self.veth.values()) + [self.bridge] if f" {l}@" in links or f" {l}:" in links]


def run_case(hosts, binary, case, port, rpc_timeout_s, logdir):
    name, fault, target = case[:3]
    extra = case[4] if len(case) > 4 else []  # after the usual flags: these win
    elastic = len(case) > 3 and case[3].startswith("elastic")
    must_complete = elastic and case[3] == "elastic"
    bound = rpc_timeout_s + 10
    procs, logs = {}, {}
    token = os.urandom(32).hex()  # the job's secret, as the README says
    for rank in range(WORLD):
        host = HOST_OF[rank]
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(WORLD),
                   MASTER_ADDR=hosts.addr(1), MASTER_PORT=str(port), DDPRPC_AUTH_TOKEN=token,
                   DDPRPC_PROGRESS_TTY="1")  # every iteration's progress, not 20 lines
        log = open(os.path.join(logdir, f"{port}_{ROLE[rank]}.log"), "w+")
        logs[rank] = log
        procs[rank] = subprocess.Popen(
            ["ip", "netns", "exec", hosts.ns[host], binary, f"--trainers={TRAINERS}", f"--ps={PS}",
             f"--iters={ITERS}", "--warmup=2", "--pytorch=false", f"--listen_address={hosts.addr(host)}",
             f"--rpc_timeout_s={rpc_timeout_s}", "--timeout_s=120", f"--bulk_min_bytes={BULK_MIN_BYTES}",
             f"--json={os.path.join(logdir, f'{port}.json')}"] + (["--elastic"] if elastic else [])
            + extra,
            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def text(rank):
        logs[rank].flush()
        with open(logs[rank].name, errors="replace") as f:
            return f.read()

    # The fault lands once training is under way.
    t_start = time.time()
    while time.time() - t_start < 60 and "iteration 20/" not in text(0):
        if any(p.poll() is not None for p in procs.values()):
            break
        time.sleep(0.05)
    t_fault = time.time()
    stopped = None
    if fault in ("KILL", "STOP"):
        os.killpg(procs[target].pid, signal.SIGKILL if fault == "KILL" else signal.SIGSTOP)
        if fault == "STOP":
            stopped = target
    elif fault == "FLAP":
        hosts.link(target, False)
        time.sleep(3)
        hosts.link(target, True)
    elif fault == "CUT":
        hosts.link(target, False)

    # Wait for every process that can end (a stopped one cannot) to end,
    # noting when the first error that names a worker appears. The bound
    # runs from the fault, or from the last progress of a job that trains on
    # and has reported no error.
    progress = Progress(text)
    t_error = {}  # kind of error -> when it first appeared
    def note_errors(now):
        for kind in ("call", "worker"):
            if kind not in t_error and first_error(text, stopped, kind):
                t_error[kind] = now
    def deadline():
        if t_error:
            return t_fault + bound + 20
        return min(progress.since(t_fault) + bound + 20, t_fault + MAX_CASE_S)
    while time.time() < deadline():
        if fault:
            note_errors(time.time())
        if all(p.poll() is not None for r, p in procs.items() if r != stopped):
            break
        time.sleep(0.05)
    t_end = time.time()
    quiet_s = t_end - progress.since(t_fault)
    if fault:
        note_errors(t_end)
    # An error naming the call, else one naming the worker that was lost.
    kind = "call" if "call" in t_error else "worker"
    # Each process still running that could have ended, with its last line.
    last_lines = {ROLE[r]: last_line(text(r)) for r, p in procs.items()
                  if p.poll() is None and r != stopped}
    lingering = list(last_lines)
    if lingering:  # gdb stops each in turn: its peers may fail after this
        save_stacks(procs, stopped, port, logdir)
    for r, p in procs.items():
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
    if fault == "CUT":
        hosts.link(target, True)

    master = text(4)
    completed = procs[4].returncode == 0 and ALL_ROW.search(master) is not None
    message = "" if completed else first_error(text, stopped, kind)
    for log in logs.values():
        log.close()
    return {
        "case": name,
        "outcome": "completed" if completed else "error",
        "to_error": None if completed or kind not in t_error else t_error[kind] - t_fault,
        "to_end": t_end - t_fault if fault else t_end - t_start,
        "lingering": lingering,
        "last_lines": last_lines,
        "quiet_s": quiet_s,
        "after_fault_s": t_end - t_fault,  # for "none": after iteration 20
        "message": message[:300],
        "bound": bound,
        "elastic": must_complete,
        "lost_reported": all(lost in master for lost in expected_losses(fault, target, extra))
                         if elastic else False,
    }


def expected_losses(fault, target, extra):
    """What the master of an elastic run must report lost (or joined): the
    workers of the host cut off, or the one killed or stopped (or the
    standby)."""
    if any(a.startswith("--add") for a in extra):
        return [f"trainers joined: {ROLE[target]} at iteration"]
    ranks = [r for r, h in HOST_OF.items() if h == target] if fault == "CUT" else [target]
    out = []
    for r in ranks:
        role = ROLE[r]
        out.append(f"trainers lost: {role}" if role.startswith("trainer")
                   else f"parameter servers lost: {role}")
    return out


class Progress:
    """When the job last moved: trainer0's iteration count rose, or the
    master printed its table."""

    def __init__(self, text):
        self.text = text
        self.iteration = -1
        self.table = False
        self.at = None

    def since(self, t_fault):
        """The time of the last progress seen (t_fault if none since)."""
        now = time.time()
        found = re.findall(r"iteration (\d+)/", self.text(0))
        iteration = int(found[-1]) if found else -1
        table = ALL_ROW.search(self.text(4)) is not None
        if iteration > self.iteration or (table and not self.table):
            if self.iteration >= 0 or self.table:  # not the first look
                self.at = now
            self.iteration, self.table = iteration, table
        return max(t_fault, self.at or t_fault)


def last_line(text):
    """A log's last non-empty line (progress lines end in carriage returns)."""
    lines = [l.strip() for l in re.split(r"[\r\n]+", text) if l.strip()]
    return re.sub(r"\x1b\[K", "", lines[-1])[:160] if lines else ""


def save_stacks(procs, stopped, port, logdir):
    """Every thread's stack of each process still running, for the logs,
    within STACKS_S in all."""
    until = time.time() + STACKS_S
    for r, p in procs.items():
        if p.poll() is not None or r == stopped:
            continue
        try:
            out = subprocess.run(["gdb", "-p", str(p.pid), "-batch", "-ex", "thread apply all bt"],
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                 errors="replace", timeout=max(1, until - time.time())).stdout
        except (OSError, subprocess.TimeoutExpired) as e:
            out = f"gdb: {e}"
        with open(os.path.join(logdir, f"{port}_{ROLE[r]}.stacks"), "w") as f:
            f.write(out)


def first_error(text, stopped, kind):
    """The first error naming a worker and a call ("call"; the master's
    first), or naming the worker a rank lost ("worker"); "" if none yet."""
    if kind == "call":
        pattern = re.compile(r"(\w+(?:\.\w+)*\('[^']*'\) on worker '\w+'[^\n]*)")
        for rank in [4, 0, 1, 2, 3]:
            if rank == stopped:
                continue
            m = pattern.search(text(rank))
            if m:
                return f"{ROLE[rank]}: {m.group(1)}"
        return ""
    # Without the master, the others report the worker they lost.
    for rank in [0, 1, 2, 3, 4]:
        if rank == stopped:
            continue
        m = re.search(r"[^\n]*worker '\w+'[^\n]*(?:unreachable|failed)[^\n]*", text(rank))
        if m:
            return f"{ROLE[rank]}: {m.group(0).split('] ')[-1]}"
    return ""


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("binary")
    parser.add_argument("--rpc_timeout_s", type=int, default=20)
    parser.add_argument("--cases", default="", help="comma-separated case numbers (1-based)")
    parser.add_argument("--groups", type=int, default=2,
                        help="cases run at once, each on three namespaces of its own (1-4)")
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("fault_matrix: needs root for ip netns", file=sys.stderr)
        return 1
    binary = os.path.abspath(args.binary)
    cases = CASES
    if args.cases:
        cases = [CASES[int(i) - 1] for i in args.cases.split(",")]
    groups = [Hosts(g) for g in range(max(1, min(4, args.groups)))]
    # Bazel's timeout sends SIGTERM: clean up (finally below) before going.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit("fault_matrix: terminated"))
    logdir = os.environ.get("TEST_UNDECLARED_OUTPUTS_DIR") or tempfile.mkdtemp(prefix="fault_matrix.")
    results = [None] * len(cases)
    pending = list(enumerate(cases))
    lock = threading.Lock()

    def work(hosts):
        # Each group's cases one after another; an exception fails the run
        # (its case has no result), not the other groups.
        while True:
            with lock:
                if not pending:
                    return
                i, case = pending.pop(0)
            print(f"fault_matrix: case {i + 1}/{len(cases)}: {case[0]}", file=sys.stderr, flush=True)
            try:
                results[i] = run_case(hosts, binary, case, 29600 + i, args.rpc_timeout_s, logdir)
            except Exception as e:  # noqa: BLE001: reported below, as a failure
                results[i] = {"case": case[0], "crashed": repr(e)}

    try:
        for hosts in groups:
            hosts.up()
        threads = [threading.Thread(target=work, args=(hosts,), daemon=True) for hosts in groups]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        for hosts in groups:
            hosts.down()
    left = [name for hosts in groups for name in hosts.leftovers()]

    print(f"\nddp_rpc {TRAINERS} trainers + {PS} PS + master on 3 hosts (network namespaces), "
          f"RPC timeout {args.rpc_timeout_s} s")
    print(f"{'case':38} {'outcome':10} {'s to error':>10} {'s to end':>8}  message")
    print("-" * 120)
    failed = []
    for r in results:
        if r is None or "crashed" in r:
            failed.append(f"{r['case'] if r else '?'}: the harness failed: {r and r.get('crashed')}")
            continue
        to_error = "-" if r["to_error"] is None else f"{r['to_error']:.1f}"
        print(f"{r['case']:38} {r['outcome']:10} {to_error:>10} {r['to_end']:8.1f}  {r['message']}")
        if r["case"] == "none" and r["outcome"] != "completed":
            failed.append(f"{r['case']}: the job without a fault did not complete")
        if r["elastic"] and (r["outcome"] != "completed" or not r["lost_reported"]):
            failed.append(f"{r['case']}: the elastic job did not complete without the lost workers "
                          f"(outcome {r['outcome']}, lost workers reported: {r['lost_reported']})")
        if r["outcome"] == "error" and not r["message"]:
            failed.append(f"{r['case']}: ended without an error naming a worker")
        if r["to_error"] is not None and r["to_error"] > r["bound"]:
            failed.append(f"{r['case']}: the error came after {r['to_error']:.1f} s "
                          f"(bound: RPC timeout + 10 s = {r['bound']} s)")
        if r["lingering"]:
            failed.append(f"{r['case']}: still running {r['after_fault_s']:.0f} s after the fault, "
                          f"{r['quiet_s']:.0f} s after the job's last progress: "
                          f"{', '.join(r['lingering'])}; their last lines (stacks in the logs):")
            failed.extend(f"  {role}: {line}" for role, line in r["last_lines"].items())
    if left:
        failed.append(f"left behind: {left}")
    print(f"logs: {logdir}")
    for f in failed:
        print(f"FAIL {f}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
