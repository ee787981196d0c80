#!/usr/bin/env python3
"""Faults on a cluster of worker processes, each in its own network namespace: what a run that
loses a worker costs.

Builds HOSTS namespaces joined through a bridge by veth pairs (shaped with `tc tbf` at --rate
when given), starts a worker in each with `legion-rs up`, then trains MODEL:
  1. uninterrupted, with recovery off (no snapshots): the reference and its step time;
  2. uninterrupted, with recovery on (a snapshot every --snapshot-every steps): the snapshots'
     cost per step;
  3. once per fault, hitting the second host's worker after step --fault-at: `kill` (SIGKILL),
     `stop` (SIGSTOP: a hung worker), `link` (its veth set down): the time to detect (the
     fault to the recovery starting), the time to recover (to the devices left holding the state
     on the new plan, the search included), the steps trained again, and the final weights'
     difference from run 1's (`cluster_report.py weights`, relative to each tensor's largest
     magnitude).
Every namespace, veth and the bridge are removed on exit. Needs root and iproute2.

    cargo build --release -p legion-cli
    python3 integration/fault_table.py --model alexnet --image-size 224 --batch 32 \\
        --hosts 2 --devices-per-host 2 --steps 30

Prints one markdown table (for BENCHMARKS.md) and, with --json, the raw rows.
"""

import argparse
import json
import math
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
BIN = ROOT / "target" / "release" / "legion-rs"


def sh(*args):
    subprocess.run(args, check=True, capture_output=True)


class Net:
    """Namespaces lgfT-i at 10.77.S.(i+2), a bridge at 10.77.S.1."""

    def __init__(self, hosts, rate):
        self.tag = os.getpid() % 100000
        self.subnet = os.getpid() % 250
        self.bridge = f"lgfb{self.tag}"
        self.namespaces = []
        self.outer = []
        sh("ip", "link", "add", self.bridge, "type", "bridge")
        sh("ip", "addr", "add", f"10.77.{self.subnet}.1/24", "dev", self.bridge)
        sh("ip", "link", "set", self.bridge, "up")
        for i in range(hosts):
            ns, outer, inner = f"lgf{self.tag}-{i}", f"lgfa{self.tag}-{i}", f"lgfc{self.tag}-{i}"
            sh("ip", "netns", "add", ns)
            self.namespaces.append(ns)
            sh("ip", "link", "add", outer, "type", "veth", "peer", "name", inner)
            self.outer.append(outer)
            sh("ip", "link", "set", outer, "master", self.bridge, "up")
            sh("ip", "link", "set", inner, "netns", ns)
            in_ns = ["ip", "netns", "exec", ns]
            sh(*in_ns, "ip", "addr", "add", f"{self.address(i)}/24", "dev", inner)
            sh(*in_ns, "ip", "link", "set", inner, "up")
            sh(*in_ns, "ip", "link", "set", "lo", "up")
            if rate:
                tbf = ["tbf", "rate", rate, "burst", "256kb", "latency", "50ms"]
                sh(*in_ns, "tc", "qdisc", "add", "dev", inner, "root", *tbf)
                sh("tc", "qdisc", "add", "dev", outer, "root", *tbf)

    def address(self, i):
        return f"10.77.{self.subnet}.{i + 2}"

    def close(self):
        for ns in self.namespaces:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)


def up(cluster):
    out = subprocess.run([str(BIN), "up", *cluster], check=True, capture_output=True, text=True)
    return {l.split()[0]: int(l.split()[4]) for l in out.stdout.splitlines()
            if l.startswith("h") and len(l.split()) > 4 and l.split()[4].isdigit()}


def train(cluster, args, init, save, *extra, fault=None):
    """Runs `train --json`; `fault(step)` is called as each step's line arrives. Returns the
    lines (parsed) and the arrival time of each."""
    cmd = [str(BIN), "train", "--device", "cpu", *cluster, "--model", args.model,
           "--image-size", str(args.image_size), "--classes", "10", "--batch", str(args.batch),
           "--steps", str(args.steps), "--strategy", args.strategy, "--verify", "0",
           "--init", str(init), "--save", str(save), "--json", *extra]
    run = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines = []
    for line in run.stdout:
        if not line.startswith("{"):
            continue
        value = json.loads(line)
        lines.append((time.monotonic(), value))
        if fault and "loss" in value and "step" in value:
            fault(value["step"])
    err = run.stderr.read()
    if run.wait() != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{err}")
    return lines


def summary_of(lines):
    return next(v for _, v in lines if v.get("summary"))


def median_step_ms(lines, skip=2):
    ms = sorted(v["step_ms"] for _, v in lines if "step_ms" in v and v["step"] > skip)
    return ms[len(ms) // 2] if ms else float("nan")


def weights_diff(a, b):
    out = subprocess.run([sys.executable, str(ROOT / "integration" / "cluster_report.py"),
                          "weights", str(a), str(b), "1e9"], capture_output=True, text=True)
    return out.stdout.strip()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="alexnet")
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--strategy", default="optcnn")
    ap.add_argument("--hosts", type=int, default=2)
    ap.add_argument("--devices-per-host", type=int, default=2)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--snapshot-every", default="auto")
    ap.add_argument("--fault-at", type=int, default=14)
    ap.add_argument("--rate", default=None, help="shape every veth to this rate (`1gbit`)")
    ap.add_argument("--faults", nargs="+", default=["kill", "stop", "link"])
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if not BIN.exists():
        raise SystemExit(f"{BIN} is missing: cargo build --release -p legion-cli")
    net = Net(args.hosts, args.rate)
    work = pathlib.Path(tempfile.mkdtemp())
    hosts = work / "hosts.toml"
    hosts.write_text("".join(
        f'[[host]]\nname = "h{i}"\naddress = "{net.address(i)}"\n'
        f"devices = {args.devices_per_host}\n"
        f'run_with = ["ip", "netns", "exec", "{ns}"]\n\n'
        for i, ns in enumerate(net.namespaces)))
    cluster = [str(hosts), "--state", str(work / "state")]
    victim = "h1"
    rows = []
    try:
        pids = up(cluster)
        init = work / "init.safetensors"
        subprocess.run([str(BIN), "train", "--model", args.model, "--image-size",
                        str(args.image_size), "--classes", "10", "--batch", str(args.batch),
                        "--steps", "0", "--save", str(init)], check=True, capture_output=True)
        reference = work / "reference.safetensors"
        plain = train(["--cluster", *cluster], args, init, reference, "--no-recover")
        snapshotted = train(["--cluster", *cluster], args, init, work / "snap.safetensors",
                            "--snapshot-every", str(args.snapshot_every))
        snap = summary_of(snapshotted)
        step_ms = median_step_ms(plain)
        snapshot_ms = 1e3 * snap["snapshot_s"] / max(snap["snapshots"], 1)
        # what `auto` keeps: the fewest steps whose time is 20 snapshots' (the 5% budget)
        every = (int(args.snapshot_every) if args.snapshot_every != "auto"
                 else max(1, math.ceil(snapshot_ms / (0.05 * step_ms))))
        print(f"step {step_ms:.0f} ms (median, recovery off); a snapshot {snapshot_ms:.0f} ms, "
              f"every {every} steps ({args.snapshot_every}): {snapshot_ms / every:.0f} ms a "
              f"step ({100 * snapshot_ms / every / step_ms:.1f}%)", file=sys.stderr)
        for fault in args.faults:
            pids = up(cluster)
            hit = {}

            def at(step, fault=fault):
                if step == args.fault_at and not hit:
                    hit["t"] = time.monotonic()
                    if fault == "kill":
                        os.kill(pids[victim], signal.SIGKILL)
                    elif fault == "stop":
                        os.kill(pids[victim], signal.SIGSTOP)
                    else:
                        sh("ip", "link", "set", net.outer[1], "down")

            out = work / f"{fault}.safetensors"
            lines = train(["--cluster", *cluster], args, init, out,
                          "--snapshot-every", str(args.snapshot_every), fault=at)
            arrived, event = next((t, v["recovered"]) for t, v in lines if "recovered" in v)
            detect = arrived - hit["t"] - event["seconds"]
            rows.append({"fault": fault, "detect_s": detect, "recover_s": event["seconds"],
                         "search_s": event["search_s"], "restore_s": event["restore_s"],
                         "steps_lost": event["steps_lost"], "devices_left": event["devices"],
                         "diff": weights_diff(out, reference).split()[0]})
            # the victim goes for good before the next fault's `up`
            if fault == "link":
                sh("ip", "link", "set", net.outer[1], "up")
            try:
                os.kill(pids[victim], signal.SIGKILL)
            except ProcessLookupError:
                pass
            time.sleep(0.5)
    finally:
        subprocess.run([str(BIN), "down", *cluster], capture_output=True)
        net.close()
    print("| fault | detect | recover (search, restoring the state) | steps trained again | "
          "devices left | final difference from the uninterrupted run |")
    print("|---|---:|---:|---:|---:|---|")
    for r in rows:
        print(f"| {r['fault']} | {r['detect_s']:.1f} s | {r['recover_s']:.2f} s "
              f"({r['search_s']:.2f}, {r['restore_s']:.2f}) | {r['steps_lost']} | "
              f"{r['devices_left']} | {r['diff']} |")
    if args.json:
        print(json.dumps({"step_ms": step_ms, "snapshot_ms": snapshot_ms, "rows": rows}))


if __name__ == "__main__":
    main()
