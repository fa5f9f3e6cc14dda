"""Charts an rpc_rl JSON report: the four metrics against the x axis.

  /usr/bin/python3 benchmarks/reference/plot_rl.py benchmark_report.json [chart.png]

One panel per metric (agent latency, agent throughput, observer latency,
observer throughput); for each engine in the report (ddprpc, and PyTorch when
the report holds its run) a p50 line with a p25..p95-style band from p50 to
p95 and p75/p90 marks. Without a comma-list flag the x axis has one point.
"""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

METRICS = ["agent latency (seconds)", "agent throughput", "observer latency (seconds)",
           "observer throughput"]


def series(results, x_name):
    xs = [r.get(x_name, "") if x_name else "" for r in results]
    return [str(x) for x in xs]


def main():
    if len(sys.argv) < 2:
        raise SystemExit("usage: plot_rl.py REPORT.json [OUT.png]")
    path = sys.argv[1]
    out = sys.argv[2] if len(sys.argv) > 2 else path.rsplit(".", 1)[0] + ".png"
    with open(path) as f:
        report = json.load(f)
    x_name = report.get("x_axis_name") or ""
    engines = [("ddprpc", report.get("benchmark_results") or [], "tab:blue")]
    if report.get("pytorch"):
        engines.append(("PyTorch", report["pytorch"].get("benchmark_results") or [], "tab:orange"))
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    for ax, metric in zip(axes.flat, METRICS):
        for label, results, color in engines:
            if not results:
                continue
            xs = series(results, x_name)
            pos = list(range(len(xs)))
            p50 = [r[metric]["p50"] for r in results]
            p95 = [r[metric]["p95"] for r in results]
            ax.plot(pos, p50, marker="o", color=color, label=f"{label} p50")
            ax.fill_between(pos, p50, p95, color=color, alpha=0.2, label=f"{label} p50..p95")
            ax.set_xticks(pos)
            ax.set_xticklabels(xs)
        ax.set_title(metric)
        ax.set_xlabel(x_name or "run")
        if "throughput" in metric:
            ax.set_ylabel("per second")
        else:
            ax.set_ylabel("seconds")
        ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    args = report.get("benchmark_args", {})
    fig.suptitle("RPC RL benchmark: " + ", ".join(f"{k}={v}" for k, v in args.items()), fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
