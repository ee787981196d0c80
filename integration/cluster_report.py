#!/usr/bin/env python3
"""What the `cluster` section of gpu-check.sh reads from a run's files (standard library only, so
that it runs on the GPU machine as is):

  cluster_report.py weights A.safetensors B.safetensors [TOLERANCE]
      the largest per-tensor difference of A from B, relative to B's largest magnitude (as
      `assert_same_tensors` of the Rust tests), and the tensor; exit 1 above TOLERANCE (1e-4) or
      when the two do not hold the same tensors
  cluster_report.py trace TRACE.json
      a `train --trace` step: its span, compute time, transfer time and the share of the
      transfers that overlapped some device's compute
  cluster_report.py steps RUN.jsonl [SKIP]
      the median `step_ms` of a `train --json` run's steps after the first SKIP (default 2)
"""
import array
import json
import statistics
import struct
import sys


def load_safetensors(path):
    with open(path, "rb") as f:
        blob = f.read()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8 : 8 + n])
    base = 8 + n
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        code = {"F32": "f", "F64": "d"}.get(info["dtype"])
        if code is None:
            raise SystemExit(f"{path}: tensor {name}: dtype {info['dtype']} not read here")
        start, end = info["data_offsets"]
        values = array.array(code)
        values.frombytes(blob[base + start : base + end])
        if sys.byteorder != "little":
            values.byteswap()
        tensors[name] = values
    return tensors


def weights(a_path, b_path, tolerance=1e-4):
    a, b = load_safetensors(a_path), load_safetensors(b_path)
    if a.keys() != b.keys():
        print(f"different tensors: {sorted(a.keys() ^ b.keys())}")
        return 1
    worst, where = 0.0, "-"
    for name in sorted(b):
        x, y = a[name], b[name]
        if len(x) != len(y):
            print(f"{name}: {len(x)} values against {len(y)}")
            return 1
        scale = max(max((abs(v) for v in y), default=0.0), 1e-12)
        diff = max((abs(p - q) for p, q in zip(x, y)), default=0.0)
        if diff / scale > worst:
            worst, where = diff / scale, name
    print(f"{worst:.2e} {where}")
    return 0 if worst <= tolerance else 1


def merged(intervals):
    out = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return out


def overlap(interval, union):
    start, end = interval
    return sum(max(0.0, min(end, b) - max(start, a)) for a, b in union)


def trace(path):
    doc = json.load(open(path))
    spans = [e for e in doc["traceEvents"] if e.get("ph") == "X"]
    if not spans:
        print("no events")
        return 1
    compute = [(e["ts"], e["ts"] + e["dur"]) for e in spans if e.get("cat") == "compute"]
    moved = [(e["ts"], e["ts"] + e["dur"]) for e in spans if e.get("cat") == "transfer"]
    union = merged(compute)
    transfer_us = sum(end - start for start, end in moved)
    hidden_us = sum(overlap(m, union) for m in moved)
    first = min(e["ts"] for e in spans)
    last = max(e["ts"] + e["dur"] for e in spans)
    share = f"{100 * hidden_us / transfer_us:.0f}%" if transfer_us > 0 else "-"
    print(
        f"span {(last - first) / 1e3:.2f} ms, compute {sum(b - a for a, b in union) / 1e3:.2f} ms, "
        f"{len(moved)} transfers {transfer_us / 1e3:.2f} ms, overlapping compute {share}"
    )
    return 0


def steps(path, skip=2):
    lines = [json.loads(l) for l in open(path) if l.startswith("{")]
    times = [l["step_ms"] for l in lines if "step_ms" in l and not l.get("summary")]
    if len(times) <= skip:
        print(f"{len(times)} steps, none after the first {skip}")
        return 1
    print(f"{statistics.median(times[skip:]):.2f}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) < 3 or sys.argv[1] not in ("weights", "trace", "steps"):
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    command, args = sys.argv[1], sys.argv[2:]
    if command == "weights":
        sys.exit(weights(args[0], args[1], *(float(t) for t in args[2:3])))
    if command == "trace":
        sys.exit(trace(args[0]))
    sys.exit(steps(args[0], *(int(s) for s in args[1:2])))
