#!/usr/bin/python3
"""Renders Chrome trace-event JSON (rpc::profiler::Profile::export_chrome_trace)
as a PNG timeline beside it: one lane per node and thread, operators as bars
(nested operators stacked below their parent), RPCs as async bars on the
caller's "rpc" lane.

  plot_trace.py [--same_scale=N] trace.json [trace.json ...]

--same_scale=N: the first N traces share one time axis, so their lengths
compare at a glance (e.g. num_worker_threads 1 vs 8).
"""
import json
import sys
import zlib

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def load(path):
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    names = {}
    bars = {}  # (pid, lane name) -> [(start_us, dur_us, name)]
    begins = {}
    for e in events:
        ph = e.get("ph")
        if ph == "M" and e.get("name") == "process_name":
            names[e["pid"]] = e["args"]["name"]
        elif ph == "X":
            bars.setdefault((e["pid"], "thread %d" % e["tid"]), []).append(
                (e["ts"], e["dur"], e["name"]))
        elif ph == "b":
            begins[(e.get("cat"), e["id"])] = e
        elif ph == "e":
            b = begins.pop((e.get("cat"), e["id"]), None)
            if b:
                bars.setdefault((b["pid"], "rpc"), []).append(
                    (b["ts"], e["ts"] - b["ts"], b["name"]))
    return names, bars


def levels(items):
    """Greedy stacking: each bar on the first level free at its start."""
    ends, out = [], []
    for start, dur, name in sorted(items, key=lambda x: (x[0], -x[1])):
        for i, end in enumerate(ends):
            if end <= start + 1e-6:
                ends[i] = start + dur
                out.append((i, start, dur, name))
                break
        else:
            ends.append(start + dur)
            out.append((len(ends) - 1, start, dur, name))
    return len(ends), out


def color(name):
    short = name.split("#remote_op: ")[-1]
    return plt.get_cmap("tab20")(zlib.crc32(short.encode()) % 20)


def plot(path, xmax=None):
    names, bars = load(path)
    lanes = sorted(bars, key=lambda k: (k[0], k[1] != "rpc", k[1]))
    stacked = [(k,) + levels(bars[k]) for k in lanes]
    rows = sum(n for _, n, _ in stacked)
    fig, ax = plt.subplots(figsize=(14, 1.2 + 0.32 * max(rows, 1)))
    y, ticks, labels = 0, [], []
    end_max = 0.0
    for (pid, lane), n, items in stacked:
        for level, start, dur, name in items:
            ax.broken_barh([(start / 1000.0, max(dur / 1000.0, 1e-4))],
                           (y + level + 0.1, 0.8),
                           facecolors=color(name) if lane != "rpc" else "#bbbbbb",
                           edgecolor="black", linewidth=0.2)
            end_max = max(end_max, (start + dur) / 1000.0)
            if lane == "rpc":
                ax.text(start / 1000.0, y + level + 0.5, " " + name, va="center",
                        fontsize=6, clip_on=True)
        ticks.append(y + n / 2.0)
        labels.append("%s\n%s" % (names.get(pid, "node %d" % pid), lane))
        y += n
        ax.axhline(y, color="#888888", linewidth=0.5)
    seen = {}
    for (pid, lane), n, items in stacked:
        if lane == "rpc":
            continue
        for _, _, _, name in items:
            short = name.split("#remote_op: ")[-1]
            seen.setdefault(short, color(name))
    handles = [matplotlib.patches.Patch(color=c, label=n) for n, c in list(seen.items())[:16]]
    if handles:
        ax.legend(handles=handles, loc="upper right", fontsize=6, ncol=2)
    ax.set_yticks(ticks)
    ax.set_yticklabels(labels, fontsize=7)
    ax.set_ylim(y, 0)
    ax.set_xlim(0, xmax if xmax else end_max * 1.02)
    ax.set_xlabel("ms since the profile started (caller's clock)")
    ax.set_title(path.rsplit("/", 1)[-1], fontsize=9)
    fig.tight_layout()
    out = path[:-5] + ".png" if path.endswith(".json") else path + ".png"
    fig.savefig(out, dpi=110)
    plt.close(fig)
    print("wrote %s" % out)
    return end_max


def main(argv):
    same = 0
    paths = []
    for a in argv:
        if a.startswith("--same_scale="):
            same = int(a.split("=", 1)[1])
        else:
            paths.append(a)
    xmax = None
    if same > 1:
        ends = []
        for p in paths[:same]:
            _, bars = load(p)
            ends.append(max(((s + d) / 1000.0 for v in bars.values() for s, d, _ in v), default=0))
        xmax = max(ends) * 1.02
    for i, p in enumerate(paths):
        plot(p, xmax if i < same else None)


if __name__ == "__main__":
    main(sys.argv[1:])
