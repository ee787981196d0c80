#!/usr/bin/env python3
"""torchvision's CNNs through legion-rs, beside PyTorch on the same machine: one JSON object per
model, the rows of BENCHMARKS.md's torchvision table.

For each model (default: all of MODELS):
- export: the model with its weights by both of PyTorch's exporters, TorchScript
  (`dynamo=False, training=TrainingMode.PRESERVE`, BatchNorm kept) and dynamo (`dynamo=True`,
  which folds BatchNorm), and whether `legion-rs plan` imports each; the import's parameter count
  against torchvision's;
- gradients: one pass over a random batch (BatchNorm on the batch's statistics; Dropout and
  stochastic depth off, as their masks are each framework's own) by legion-rs in f32
  (`cargo bench -p legion-onnx --bench gradients`) and by PyTorch in f32, each against PyTorch's
  float64 autograd from the same weights and batch: per tensor ‖a − b‖ / ‖b‖ (against the
  largest tensor's norm where the true gradient is zero), the largest and the median over the
  model's tensors, and the losses;
- plan: `legion-rs plan --search optcnn` on the paper's 16 GPUs, and the optcnn and data
  searches on `dgx-h100:8` and `dgx-h100:64`, each at 32 images a device: simulated step and
  search time (a search that fails or runs past --plan-timeout is reported as such);
- CPU step: median training step of `legion-rs train --device cpu` on the TorchScript export and
  of PyTorch (SGD, momentum 0.9, weight decay 5e-4), both on --threads threads, in --rounds
  alternating rounds: the medians of each and of the per-round ratio.

    python3 -m venv /tmp/torchenv && /tmp/torchenv/bin/pip install torch torchvision onnx onnxscript safetensors
    cargo build --release -p legion-cli && cargo bench -p legion-onnx --bench gradients --no-run
    /tmp/torchenv/bin/python integration/torchvision_check.py [MODEL ...] [--batch 8] [--steps 5] > rows.jsonl
    python3 integration/torchvision_check.py --table rows.jsonl    # BENCHMARKS.md's table

Needs torch, torchvision, onnx, onnxscript and safetensors; the binaries are found under
target/release (the gradients bench by its name in target/release/deps).
"""

import argparse
import contextlib
import copy
import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

import torch
import torchvision
from safetensors.torch import load_file, save_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MODELS = {
    "resnet18": lambda: torchvision.models.resnet18(),
    "resnext50_32x4d": lambda: torchvision.models.resnext50_32x4d(),
    "mobilenet_v2": lambda: torchvision.models.mobilenet_v2(),
    "efficientnet_b0": lambda: torchvision.models.efficientnet_b0(),
    "densenet121": lambda: torchvision.models.densenet121(),
    "squeezenet1_0": lambda: torchvision.models.squeezenet1_0(),
    "googlenet": lambda: torchvision.models.googlenet(aux_logits=False, init_weights=True),
    "regnet_y_400mf": lambda: torchvision.models.regnet_y_400mf(),
}


def masks_off(model):
    """Training mode, but Dropout and stochastic depth as the identity (their masks are each
    framework's own draw)."""
    model.train()
    for m in model.modules():
        if isinstance(m, (torch.nn.Dropout, torchvision.ops.StochasticDepth)):
            m.eval()
    return model


def export(model, path, size, dynamo):
    x = torch.zeros(1, 3, size, size)
    # the dynamo exporter reports its passes on stdout, which carries this script's JSON
    with warnings.catch_warnings(), contextlib.redirect_stdout(sys.stderr):
        warnings.simplefilter("ignore")
        if dynamo:
            torch.onnx.export(model, (x,), path, dynamo=True, external_data=False)
        else:
            torch.onnx.export(
                model,
                (x,),
                path,
                dynamo=False,
                opset_version=17,
                training=torch.onnx.TrainingMode.PRESERVE,
                input_names=["data"],
                output_names=["logits"],
                dynamic_axes={"data": {0: "batch"}, "logits": {0: "batch"}},
            )


def run(cmd, timeout):
    """(returncode, stdout, stderr, seconds); returncode None on a timeout."""
    start = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        return p.returncode, p.stdout, p.stderr, time.perf_counter() - start
    except subprocess.TimeoutExpired:
        return None, "", "", time.perf_counter() - start


def imported_params(stderr):
    for line in stderr.splitlines():
        if line.startswith("imported ") and " parameters" in line:
            return int(line.split(" parameters")[0].rsplit(" ", 1)[1])
    return None


def plan(legion, onnx, machine, search, timeout):
    """The search's simulated step and wall time on `machine` at the default batch (32 a device),
    or why there is none."""
    cmd = [legion, "plan", "--model", onnx, "--machine", machine, "--search", search, "--json"]
    code, out, err, secs = run(cmd, timeout)
    if code is None:
        return {"error": f"no answer within {timeout} s"}
    if code != 0:
        return {"error": err.strip().splitlines()[-1] if err.strip() else f"exit {code}"}
    [s] = json.loads(out)["searches"]
    return {"simulated_ms": s["simulated_ms"], "search_ms": s["search_ms"]}


def torch_gradients(model, images, labels, dtype):
    m = copy.deepcopy(model).to(dtype)
    masks_off(m)
    m.zero_grad()
    loss = torch.nn.functional.cross_entropy(m(images.to(dtype)), labels)
    loss.backward()
    return loss.item(), {n: p.grad for n, p in m.named_parameters()}


def errors(got, want):
    """Per tensor ‖a − b‖ / ‖b‖; a tensor whose true gradient is zero (below 1e-6 of the
    largest, as a bias before a BatchNorm has) is measured against the largest instead."""
    largest = max(b.double().norm().item() for b in want.values())
    out = {}
    for name, b in want.items():
        diff = (got[name].double() - b.double()).norm().item()
        norm = b.double().norm().item()
        out[name] = diff / (norm if norm >= 1e-6 * largest else largest)
    return out


def summary(errs):
    worst = max(errs, key=errs.get)
    return {
        "max": errs[worst],
        "worst": worst,
        "median": statistics.median(errs.values()),
        "over_1e-5": sum(1 for e in errs.values() if e > 1e-5),
    }


def torch_step_ms(model, batch, size, steps):
    m = copy.deepcopy(model)
    masks_off(m)
    opt = torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9, weight_decay=5e-4)
    x = torch.randn(batch, 3, size, size)
    y = torch.randint(0, 1000, (batch,))
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        opt.zero_grad()
        torch.nn.functional.cross_entropy(m(x), y).backward()
        opt.step()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times[1:])


def legion_step_ms(legion, onnx, batch, steps, threads):
    env = dict(os.environ, RAYON_NUM_THREADS=str(threads))
    cmd = [legion, "train", "--model", onnx, "--batch", str(batch), "--steps", str(steps)]
    cmd += ["--device", "cpu", "--json"]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if p.returncode != 0:
        return None
    ms = [json.loads(l)["step_ms"] for l in p.stdout.splitlines() if '"step_ms"' in l]
    # the first step warms up; the last one's time ends with the run
    return statistics.median(ms[1:-1] or ms)


def check(name, args, legion, gradients_bin, work):
    torch.manual_seed(0)
    model = masks_off(MODELS[name]())
    row = {"model": name, "torchvision_params": sum(p.numel() for p in model.parameters())}
    files = {}
    for exporter, dynamo in [("torchscript", False), ("dynamo", True)]:
        path = os.path.join(work, f"{name}_{exporter}.onnx")
        try:
            export(model, path, args.image, dynamo)
        except Exception as e:  # noqa: BLE001 - an exporter's failure is a row's result
            row[f"{exporter}_import"] = f"export failed: {type(e).__name__}"
            continue
        code, _, err, _ = run([legion, "plan", "--model", path, "--machine", "paper:2",
                               "--search", "data", "--batch", "2", "--json"], 600)
        row[f"{exporter}_import"] = "yes" if code == 0 else (err.strip().splitlines() or ["no"])[-1]
        row[f"{exporter}_params"] = imported_params(err)
        row[f"{exporter}_warnings"] = sum(1 for l in err.splitlines() if l.startswith("warning:"))
        files[exporter] = path
    onnx = files.get("torchscript")
    if onnx is None:
        return row
    # gradients from the same weights and batch
    images = torch.randn(args.batch, 3, args.image, args.image)
    labels = torch.randint(0, 1000, (args.batch,))
    batch_file, grads_file = os.path.join(work, "batch.safetensors"), os.path.join(work, "g.safetensors")
    save_file({"images": images, "labels": labels.float()}, batch_file)
    code, out, err, secs = run([gradients_bin, onnx, batch_file, grads_file], 1200)
    if code == 0:
        ours = load_file(grads_file)
        loss64, exact = torch_gradients(model, images, labels, torch.float64)
        loss32, torch32 = torch_gradients(model, images, labels, torch.float32)
        row["gradients"] = {
            "tensors": len(exact),
            "missing": sorted(set(exact) - set(ours)),
            "legion_f32": summary(errors(ours, exact)),
            "pytorch_f32": summary(errors(torch32, exact)),
            "loss": {"legion": ours["loss"].item(), "pytorch_f32": loss32, "float64": loss64},
            "seconds": round(secs, 1),
        }
    else:
        row["gradients"] = {"error": (err.strip().splitlines() or [f"exit {code}"])[-1]}
    row["plan_paper_optcnn"] = plan(legion, onnx, "paper", "optcnn", args.plan_timeout)
    for machine in ["dgx-h100:8", "dgx-h100:64"]:
        for search in ["optcnn", "data"]:
            row[f"plan_{machine}_{search}"] = plan(legion, onnx, machine, search, args.plan_timeout)
    if not args.skip_step:
        torch.set_num_threads(args.threads)
        # alternating rounds, so that a slow spell of the machine falls on both
        rounds = []
        for _ in range(args.rounds):
            ours = legion_step_ms(legion, onnx, args.batch, args.steps, args.threads)
            theirs = torch_step_ms(model, args.batch, args.image, args.steps)
            if ours is None:
                break
            rounds.append((ours, theirs))
        if rounds:
            row["cpu_step_ms"] = {
                "legion": statistics.median(r[0] for r in rounds),
                "pytorch": statistics.median(r[1] for r in rounds),
                "ratio": statistics.median(r[0] / r[1] for r in rounds),
                "rounds": len(rounds),
            }
    return row


def table(path):
    """BENCHMARKS.md's table from this script's JSON lines."""
    def why(v):
        e = v.get("error", "")
        if "within" in e:
            return "> " + e.split("within ")[1].split(" s")[0] + " s"
        return "no fit" if "fits the devices' memory" in e else "failed"

    def ms(v):
        return f"{v['simulated_ms']:.1f}" if "simulated_ms" in v else why(v)

    def imported(row, exporter):
        got = row.get(f"{exporter}_import")
        if got != "yes":
            return "no"
        return "yes, BN folded (warned)" if row.get(f"{exporter}_warnings") else "yes"

    print("| model | TorchScript export | dynamo export | params = torchvision | gradients vs "
          "float64, max / median (PyTorch f32's) | `plan` optcnn on `paper`, s | dgx-h100:8 "
          "optcnn / data ms | dgx-h100:64 optcnn / data ms | CPU step legion-rs / PyTorch ms |")
    print("|---|---|---|---|---|---:|---|---|---|")
    for line in open(path):
        r = json.loads(line)
        g = r.get("gradients", {})
        if "legion_f32" in g:
            ours, theirs = g["legion_f32"], g["pytorch_f32"]
            grads = (f"{ours['max']:.1e} / {ours['median']:.1e} "
                     f"({theirs['max']:.1e} / {theirs['median']:.1e})")
        else:
            grads = g.get("error", "—")
        paper = r.get("plan_paper_optcnn", {})
        paper = f"{paper['search_ms'] / 1e3:.2f}" if "search_ms" in paper else why(paper)
        step = r.get("cpu_step_ms") or {}
        ratio = step.get("ratio") or (step["legion"] / step["pytorch"] if step.get("legion") else 0)
        step = (f"{step['legion']:.0f} / {step['pytorch']:.0f} ({ratio:.2f}×)"
                if step.get("legion") else "—")
        same = "yes" if r.get("torchscript_params") == r["torchvision_params"] else "no"
        print(f"| {r['model']} | {imported(r, 'torchscript')} | {imported(r, 'dynamo')} | "
              f"{same} ({r['torchvision_params']:,}) | {grads} | {paper} | "
              f"{ms(r['plan_dgx-h100:8_optcnn'])} / {ms(r['plan_dgx-h100:8_data'])} | "
              f"{ms(r['plan_dgx-h100:64_optcnn'])} / {ms(r['plan_dgx-h100:64_data'])} | {step} |")


def main():
    if sys.argv[1:2] == ["--table"]:
        return table(sys.argv[2])
    p = argparse.ArgumentParser()
    p.add_argument("models", nargs="*", default=list(MODELS))
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--image", type=int, default=224)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--plan-timeout", type=int, default=120)
    p.add_argument("--skip-step", action="store_true")
    p.add_argument("--rounds", type=int, default=3,
                   help="alternating legion-rs / PyTorch CPU step rounds (the medians are reported)")
    args = p.parse_args()
    legion = os.path.join(ROOT, "target/release/legion-rs")
    benches = [f for f in glob.glob(os.path.join(ROOT, "target/release/deps/gradients-*"))
               if os.access(f, os.X_OK) and not f.endswith(".d")]
    if not os.path.exists(legion) or not benches:
        sys.exit("build first: cargo build --release -p legion-cli && "
                 "cargo bench -p legion-onnx --bench gradients --no-run")
    gradients_bin = max(benches, key=os.path.getmtime)
    with tempfile.TemporaryDirectory() as work:
        for name in args.models:
            print(json.dumps(check(name, args, legion, gradients_bin, work)), flush=True)


if __name__ == "__main__":
    main()
