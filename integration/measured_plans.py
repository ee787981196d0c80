#!/usr/bin/env python3
"""Plans priced by measured costs, side by side with what every strategy measures.

For each setting (model, image size, batch) on the embedded devices:
  1. `--compare --strategies all`: every strategy's measured and simulated step, the error, and
     its difference from one device beside the run's floor;
  2. a default `legion-rs train` (measured costs, verification on) and the same with
     `--verify 0` (the search's own pick): the strategy each keeps, and its step in the table;
then, once, the measuring of a first run against a 100-step run's time (a fresh cost cache), and
a second identical run, which measures nothing new.

    cargo build --release -p legion-cli -p legion-examples
    python3 integration/measured_plans.py --settings alexnet:224:32 inception_v3:75:8 --devices 4

Prints one table per setting (markdown, for BENCHMARKS.md) and, with --json, the raw rows.
"""

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
BIN = ROOT / "target" / "release"


def run_json(cmd, env=None):
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def compare(model, size, batch, devices, steps, env):
    example = BIN / model
    return run_json([str(example), "--compare", "--strategies", "all", "--devices", str(devices),
                     "--image-size", str(size), "--batch", str(batch), "--steps", str(steps),
                     "--json"], env)


def train(model, size, batch, devices, steps, env, *extra):
    lines = run_json([str(BIN / "legion-rs"), "train", "--model", model, "--image-size", str(size),
                      "--classes", "10", "--batch", str(batch), "--devices", str(devices),
                      "--steps", str(steps), "--device", "cpu", "--json", *extra], env)
    return next(l for l in lines if l.get("summary"))


def layers_key(plan):
    return json.dumps(plan["layers"], sort_keys=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--settings", nargs="+", default=["alexnet:224:32"])
    ap.add_argument("--devices", type=int, default=4)
    ap.add_argument("--steps", type=int, default=4, help="--compare's timed steps")
    ap.add_argument("--train-steps", type=int, default=30)
    ap.add_argument("--overhead-steps", type=int, default=100)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    env = dict(os.environ)
    cache = tempfile.mkdtemp(prefix="legion-costs-")
    env["LEGION_RS_COST_CACHE"] = cache
    report = []
    for setting in a.settings:
        model, size, batch = setting.split(":")
        size, batch = int(size), int(batch)
        rows = compare(model, size, batch, a.devices, a.steps, env)
        verified = train(model, size, batch, a.devices, a.train_steps, env)
        own = train(model, size, batch, a.devices, a.train_steps, env, "--verify", "0")
        # which --compare row each kept strategy is: the same layers as a search's plan
        searched = {}
        for strategy in [r["strategy"] for r in rows]:
            s = train(model, size, batch, a.devices, 1, env, "--strategy", strategy, "--verify", "0")
            searched[layers_key(s["plan"])] = strategy
        kept = searched.get(layers_key(verified["plan"]), "another")
        pick = searched.get(layers_key(own["plan"]), "another")
        fastest = min(rows, key=lambda r: r["measured_ms"])
        report.append({"setting": setting, "rows": rows, "verified": verified["plan"],
                       "kept": kept, "search_pick": pick, "fastest": fastest["strategy"]})
        print(f"\n### {model} {size}x{size} b{batch}, {a.devices} devices\n")
        print("| strategy | measured ms | simulated ms | error | max rel diff vs 1 | floor |")
        print("|---|---:|---:|---:|---:|---:|")
        for r in rows:
            mark = " (kept)" if r["strategy"] == kept else ""
            mark += " (search)" if r["strategy"] == pick else ""
            print(f"| {r['strategy']}{mark} | {r['measured_ms']:.1f} | {r['simulated_ms']:.1f} | "
                  f"{100 * r['simulation_error']:+.1f}% | {r['max_rel_diff_from_one_device']:.1e} | "
                  f"{r['floor_rel_diff']:.1e} |")
        within = [abs(r["simulation_error"]) <= 0.05 for r in rows]
        print(f"\nfastest measured: {fastest['strategy']}; kept with verification: {kept}; the "
              f"search's own pick: {pick}; simulated within 5%: {sum(within)} of {len(rows)}")
        v = verified["plan"].get("verification")
        if v:
            print("verification: " + ", ".join(
                f"{c['strategy']} {c['measured_ms']:.0f} ms (sim {c['simulated_ms']:.0f})"
                for c in v["candidates"]) + f"; kept {v['kept']}")
        sys.stdout.flush()
    # The first run's measuring against a run of --overhead-steps, in a cache of its own.
    model, size, batch = a.settings[0].split(":")
    fresh = dict(env, LEGION_RS_COST_CACHE=tempfile.mkdtemp(prefix="legion-costs-"))
    first = train(model, int(size), int(batch), a.devices, a.overhead_steps, fresh, "--verify", "0")
    second = train(model, int(size), int(batch), a.devices, 2, fresh, "--verify", "0")
    costs = first["plan"]["costs"]
    print(f"\nfirst run: measuring {costs['measuring_s']:.1f} s ({costs['new_tiles']} tiles, "
          f"{costs['strategies_run']} strategies) against {first['wall_s']:.1f} s of "
          f"{a.overhead_steps} steps ({100 * costs['measuring_s'] / first['wall_s']:.0f}%); "
          f"second run: {second['plan']['costs']['new_tiles']} new tiles")
    if a.json:
        print(json.dumps(report))


if __name__ == "__main__":
    main()
