#!/usr/bin/env bash
# The one-command GPU check, in two halves, because the GPU machine has no Rust toolchain and no
# network:
#
#   integration/gpu-check.sh build [DIR]   here: the stripped release `legion-rs`, legion-cuda's
#                                          test binaries (ops/cuda/gpu-check.sh) and the PyTorch
#                                          peer script into DIR (default target/gpu-check)
#   integration/gpu-check.sh run [DIR]     there: every check in one run, each failure reported,
#                                          exit status 1 if any failed; writes its outputs to
#                                          $OUT (or DIR/out)
#
# The checks, in sections: `kernels` (every Backend primitive on the GPU against the CPU
# kernels, a small model trained three steps on the GPU as on the CPU with the next batch staged
# ahead, `fastest` convolution algorithms against `precise` ones, the NVRTC compile test),
# `equivalence` (every strategy on 4 GPU device actors sharing the GPU against the CPU's single
# device, `precise` algorithms: LeNet-5, AlexNet 64, Inception-v3 75, batch 8, 3 steps),
# `throughput` (one GPU, strict FP32, TF32 and bf16 mixed precision for AlexNet 224 b128, VGG-16
# 224 b64, Inception-v3 299 b64 and ResNet-50 224 b64, side by side with PyTorch in the same run,
# its bf16 being autocast with channels_last; AlexNet again with
# each default turned off: `precise` and `heuristic` algorithms, no prefetch, no step capture
# (CUDA graph replay), synthetic batches drawn on the host instead of by the GPU, each step's loss
# read at its end instead of one step late, the convolutions' bias and ReLU in a kernel of their
# own instead of cuDNN's fused convolution (VGG-16 too), each row saying whether capture
# replayed or why it gave up, where the batches were drawn and when the loss was read; with the
# host's split of each step: enqueuing, staging the next batch, waiting for the GPU), `trace` (AlexNet's,
# ResNet-50's and Inception-v3's one-device step call by call, and PyTorch's kernels in one
# step), `several` (AlexNet on 4 devices sharing the GPU under data, owt and optcnn against
# the simulation priced by those devices' measured tiles and copies, `plan --machine one-gpu:4`),
# `several-bf16` (AlexNet 224 b128 on 4 devices sharing the GPU under data and owt, fp32 beside
# bf16: step time and bytes between devices), `layouts` (PyTorch's bf16 step in NCHW, legion-rs's
# layout, beside channels_last for the four models: what NHWC would gain),
# `profile` (the three models' tiles for the paper's machine, 16 devices at 32 samples each, as
# many as the time left allows: $OUT/profile-paper.json for `plan --machine paper --profile`).
# Not in the default set (the default sections fill the budget: see BENCHMARKS.md), asked for by
# name: `cluster` (worker processes sharing the GPU: `up` of 2, then 4, local `device = "cuda"`
# workers, `train --cluster` under data, owt and optcnn for 3 steps with `--trace`, weights
# against the CPU's one device, `down` leaving no worker process and none holding GPU memory;
# `--gpus 0,0`, two logical GPUs on the one device, against the CPU too; then AlexNet 224 b128 on
# the 2 workers measured against `plan --cluster`, priced by a GPU profile's tiles and staging).
#
# Device time is scarce, so the run keeps to GPU_CHECK_SECONDS (default 540: each command gets
# the smaller of its own limit and what is left, and a section reached with no time left fails
# as skipped), GPU_CHECK_ONLY="SECTION ..." picks sections, and GPU_CHECK_PACK=FILE packs every
# output into one file however the run ends. One device call:
#   R=$OUT; OUT=/tmp/gc GPU_CHECK_SECONDS=540 GPU_CHECK_PACK=$R/gpu-check.tgz \
#       integration/gpu-check.sh run target/gpu-check 2>&1 | tee $R/console.txt
# with `carry: ["target/gpu-check"]` and a timeout_s some 30 s above GPU_CHECK_SECONDS.
set -uo pipefail
cd "$(dirname "$0")/.."
mode="${1:-}"
dir="${2:-target/gpu-check}"

case "$mode" in
build)
    set -e
    ops/cuda/gpu-check.sh build "$dir"
    # The equivalence test of the GPU device actors (integration/tests/gpu_equivalence.rs).
    cargo test -p legion-integration --test gpu_equivalence --no-run --message-format=json 2>/dev/null \
        | python3 -c '
import json, sys
for line in sys.stdin:
    message = json.loads(line)
    if message.get("reason") == "compiler-artifact" and message.get("executable") \
            and message["profile"]["test"]:
        print(message["executable"])
' \
        | while read -r executable; do
            cp "$executable" "$dir/gpu_equivalence"
            strip "$dir/gpu_equivalence"
            echo "$dir/gpu_equivalence"
        done
    cargo build --release -p legion-cli --bin legion-rs
    cp target/release/legion-rs "$dir/legion-rs"
    strip "$dir/legion-rs"
    cp integration/pytorch_peer.py "$dir/"
    cp integration/cluster_report.py "$dir/"
    du -sh "$dir"
    ;;
run)
    out="${OUT:-$dir/out}"
    mkdir -p "$out"
    # GPU_CHECK_PACK=FILE: every output packed into FILE when the run ends, however it ends (the
    # device tool returns a few files only, and nothing a killed command did not write).
    if [ -n "${GPU_CHECK_PACK:-}" ]; then
        trap 'tar czf "$GPU_CHECK_PACK" -C "$out" .' EXIT
        trap 'exit 143' TERM INT
    fi
    export LD_LIBRARY_PATH="/usr/lib/x86_64-linux-gnu:/usr/local/cuda-13.0/targets/x86_64-linux/lib:/usr/local/nvidia/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    export RUST_BACKTRACE=1
    # This machine has a GPU, NVRTC and a C++ compiler: a test that skips for want of one fails.
    export LEGION_REQUIRE=gpu,nvrtc,cxx
    python=/opt/torch/.venv/bin/python
    [ -x "$python" ] || python=python3
    # Device time is scarce: the whole run keeps to GPU_CHECK_SECONDS (each command gets the
    # smaller of its own limit and what is left; a section with no time left is reported as
    # skipped, which fails the run), and GPU_CHECK_ONLY picks sections for a rerun.
    deadline=$((SECONDS + ${GPU_CHECK_SECONDS:-540}))
    sections="${GPU_CHECK_ONLY:-kernels equivalence throughput trace several several-bf16 layouts profile}"
    failures=()
    want() { [[ " $sections " == *" $1 "* ]]; }
    # limit SECONDS: what a command may take now; fails when the time is up (then `skip` it:
    # a command substitution's subshell cannot record the failure itself).
    limit() {
        local left=$((deadline - SECONDS))
        [ "$left" -ge 10 ] || return 1
        echo $((left < $1 ? left : $1))
    }
    skip() {
        echo "skipped, out of time: $1"
        failures+=("$1 (skipped: out of time)")
    }
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
    if want kernels || want equivalence; then
        for test in "$dir"/*; do
            name="$(basename "$test")"
            case "$name" in
            legion-rs | pytorch_peer.py | cluster_report.py | out) continue ;;
            gpu_equivalence) want equivalence || continue ;;
            *) want kernels || continue ;;
            esac
            [ -x "$test" ] || continue
            t=$(limit 180) || { skip "$name"; continue; }
            echo "=== $name (at most ${t}s)"
            start=$SECONDS
            if ! timeout "$t" "$test" --nocapture --test-threads=1 >"$out/$name.log" 2>&1; then
                failures+=("$name")
                grep -E "^test .*(FAILED|failed)|panicked|Error|error" "$out/$name.log" | head -20
            fi
            # On the GPU machine a test that skips (no GPU, library or compiler found) failed.
            if grep -q "skipped:" "$out/$name.log"; then
                failures+=("$name (skipped)")
                grep "skipped:" "$out/$name.log" | head -3
            fi
            grep -E "^test result" "$out/$name.log"
            echo "    $((SECONDS - start)) s"
        done
    fi
    if want throughput; then
        # mode: strict FP32, TF32 or bf16 (mixed precision) with the defaults (the `fastest`
        # convolution algorithms, the next batch staged while a step computes, steps after the
        # first replayed as a CUDA graph, each step's loss read one step late), then AlexNet with
        # each default turned off in turn: `--conv-algos precise` and `heuristic`,
        # `--no-prefetch`, `--no-capture`, `--synthetic-on-host`, `--sync-every-step`, and
        # `--no-fused-epilogue` (on VGG-16 too, whose convolutions' outputs are 14 times
        # AlexNet's).
        for mode in fp32 tf32 bf16 fp32-precise fp32-heuristic fp32-no-prefetch fp32-no-capture \
            fp32-synthetic-on-host fp32-sync-every-step fp32-no-fused-epilogue; do
            flags=()
            case "$mode" in
            tf32) flags=(--tf32) ;;
            bf16) flags=(--precision bf16) ;;
            fp32-precise) flags=(--conv-algos precise) ;;
            fp32-heuristic) flags=(--conv-algos heuristic) ;;
            fp32-no-prefetch) flags=(--no-prefetch) ;;
            fp32-no-capture) flags=(--no-capture) ;;
            fp32-synthetic-on-host) flags=(--synthetic-on-host) ;;
            fp32-sync-every-step) flags=(--sync-every-step) ;;
            fp32-no-fused-epilogue) flags=(--no-fused-epilogue) ;;
            esac
            echo "=== throughput, legion-rs --device cuda (one GPU, $mode)"
            runs="alexnet:224:128 vgg16:224:64 inception_v3:299:64 resnet50:224:64"
            [[ "$mode" == fp32-* ]] && runs="alexnet:224:128"
            [[ "$mode" == fp32-no-fused-epilogue ]] && runs="alexnet:224:128 vgg16:224:64"
            for run in $runs; do
                IFS=: read -r model image batch <<<"$run"
                log="$out/legion-$model-$mode.jsonl"
                t=$(limit 60) || { skip "legion-rs $model $mode"; continue; }
                start=$SECONDS
                if timeout "$t" "$dir/legion-rs" train --device cuda \
                    --devices 1 --model "$model" --image-size "$image" --batch "$batch" \
                    --classes 1000 --steps 15 --json "${flags[@]}" >"$log" 2>"$out/legion-$model-$mode.err"
                then
                    "$python" - "$log" "$model" "$image" "$batch" "$mode" <<'PY' | tee -a "$out/throughput-legion.jsonl"
import json, statistics, sys
lines = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
steps = [l for l in lines if "step" in l and not l.get("summary")]
summary = next((l for l in lines if l.get("summary")), {})
ms = statistics.median(s["step_ms"] for s in steps[5:])
host = {k: statistics.median(s.get(k, 0.0) for s in steps[5:])
        for k in ("enqueue_ms", "stage_ms", "wait_ms")}
print(json.dumps({"peer": "legion-rs", "model": sys.argv[2], "image": int(sys.argv[3]),
                  "batch": int(sys.argv[4]), "mode": sys.argv[5], "tf32": sys.argv[5] == "tf32",
                  "precision": sys.argv[5].split("-")[0],
                  "first_step_ms": steps[0]["step_ms"], "median_step_ms": ms,
                  "images_per_sec": int(sys.argv[4]) / ms * 1e3, **host,
                  "capture": summary.get("capture"),
                  "synthetic_on_device": summary.get("synthetic_on_device"),
                  "loss_read_late": summary.get("loss_read_late")}))
PY
                else
                    echo "legion-rs $model $mode failed:"
                    tail -5 "$out/legion-$model-$mode.err"
                    failures+=("legion-rs $model $mode")
                fi
                # A convolution cuDNN refused to fuse runs unfused, correctly but without the gain.
                if grep -q "cuDNN refused the fused bias and ReLU" "$out/legion-$model-$mode.err"; then
                    grep -m 3 "cuDNN refused the fused" "$out/legion-$model-$mode.err"
                    failures+=("legion-rs $model $mode: cuDNN refused a fused convolution")
                fi
                echo "    $((SECONDS - start)) s"
            done
        done
        echo "=== throughput, PyTorch on the same GPU (strict FP32, TF32, then bf16 autocast + channels_last)"
        start=$SECONDS
        if t=$(limit 300); then
            timeout "$t" "$python" "$dir/pytorch_peer.py" alexnet:224:128 vgg16:224:64 \
                inception_v3:299:64 resnet50:224:64 --all | tee -a "$out/throughput-pytorch.jsonl" \
                || failures+=("pytorch")
        else
            skip pytorch
        fi
        echo "    $((SECONDS - start)) s"
        echo "=== legion-rs / PyTorch median step time (same GPU, same run)"
        "$python" - "$out/throughput-legion.jsonl" "$out/throughput-pytorch.jsonl" <<'PY' | tee "$out/throughput.md" || true
import json, sys
def rows(path):
    try:
        return [json.loads(l) for l in open(path)]
    except FileNotFoundError:
        return []
ours, peer = rows(sys.argv[1]), rows(sys.argv[2])
# joined on the precision: fp32 (every fp32-* mode too), tf32, bf16 (PyTorch's autocast)
torch = {(r["model"], r.get("precision", "tf32" if r["tf32"] else "fp32")): r["median_step_ms"]
         for r in peer}
print("| model | mode | legion-rs ms | PyTorch ms | ratio | legion-rs first step ms "
      "| host: enqueue / stage / wait ms | step capture | batches drawn on | loss read |")
print("|---|---|---:|---:|---:|---:|---:|---|---|---|")
for r in sorted(ours, key=lambda r: (r["model"], r["mode"])):
    b = torch.get((r["model"], r.get("precision", "tf32" if r["tf32"] else "fp32")))
    ratio = f"{r['median_step_ms'] / b:.2f}" if b else "-"
    peer_ms = f"{b:.1f}" if b else "-"
    host = " / ".join(f"{r.get(k, 0):.1f}" for k in ("enqueue_ms", "stage_ms", "wait_ms"))
    print(f"| {r['model']} | {r['mode']} | {r['median_step_ms']:.1f} | {peer_ms} | {ratio} | "
          f"{r['first_step_ms']:.0f} | {host} | {r.get('capture') or '-'} | "
          f"{ {True: 'GPU', False: 'host'}.get(r.get('synthetic_on_device'), '-') } | "
          f"{ {True: 'a step late', False: 'every step'}.get(r.get('loss_read_late'), '-') } |")
PY
    fi
    if want trace; then
        echo "=== where one step's time goes: one device (the trainer that throughput measures), the last"
        echo "    of 3 steps traced with CUDA events around each call, strict FP32; then PyTorch's"
        echo "    kernels in one step of the same model (torch.profiler)"
        for run in alexnet:224:128 resnet50:224:64 inception_v3:299:64; do
            IFS=: read -r model image batch <<<"$run"
            name="trace-$model"
            if ! t=$(limit 40); then
                skip "$name"
            elif timeout "$t" "$dir/legion-rs" train --device cuda --devices 1 --model "$model" \
                --image-size "$image" --batch "$batch" --classes 1000 --steps 3 \
                --trace "$out/$name.json" >"$out/$name.log" 2>&1; then
                "$python" - "$out/$name.json" <<'PY' | tee "$out/$name.txt"
import collections, json, sys
doc = json.load(open(sys.argv[1]))
spans = [e for e in doc["traceEvents"] if e.get("ph") == "X"]
by = collections.defaultdict(float)
for e in spans:
    by[(e.get("cat", "?"), e.get("name", "?"))] += e.get("dur", 0) / 1e3
first = min(e["ts"] for e in spans)
last = max(e["ts"] + e["dur"] for e in spans)
print(f"{len(spans)} calls, {sum(by.values()):.2f} ms of device time in a {(last - first) / 1e3:.2f} ms span")
kinds = collections.defaultdict(float)
for (cat, name), ms in by.items():
    kinds[name.split(".")[-1] if cat == "compute" else cat] += ms
print("by kind: " + ", ".join(f"{k} {v:.2f}" for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])[:8]))
for (cat, name), ms in sorted(by.items(), key=lambda kv: -kv[1])[:30]:
    print(f"{ms:9.3f} ms  {cat:8} {name}")
PY
            else
                failures+=("$name")
                tail -5 "$out/$name.log"
            fi
        done
        if t=$(limit 60); then
            timeout "$t" "$python" "$dir/pytorch_peer.py" alexnet:224:128 resnet50:224:64 \
                --warmup 3 --steps 1 --profile "$out/pytorch-kernels.txt" >/dev/null \
                && head -12 "$out/pytorch-kernels.txt" || failures+=("pytorch --profile")
        else
            skip "pytorch --profile"
        fi
    fi
    if want several; then
        echo "=== several devices on one GPU: AlexNet 224 b128 on 4 devices, a stream each: every tile"
        echo "    the search may choose timed, optcnn planned with them, then data, owt and that"
        echo "    optcnn measured against the simulation priced by the same profile (one-gpu:4)"
        p="$out/profile-one-gpu.json"
        common=(--model alexnet --image-size 224 --batch 128 --classes 1000)
        if t=$(limit 60) && timeout "$t" "$dir/legion-rs" profile --device cuda --devices 4 \
            "${common[@]}" --strategies space --warmup 1 --repeats 3 --time-limit 20 --out "$p" \
            >"$out/several-space.txt" 2>&1 \
            && "$dir/legion-rs" plan "${common[@]}" --machine one-gpu:4 --search optcnn \
                --profile "$p" --out "$out/optcnn-one-gpu.json" >/dev/null 2>&1 \
            && t=$(limit 90) && timeout "$t" "$dir/legion-rs" profile --device cuda --devices 4 \
                "${common[@]}" --strategies "data,owt,$out/optcnn-one-gpu.json" --warmup 3 \
                --repeats 10 --merge --out "$p" 2>&1 | tee "$out/several-devices.txt"; then
            tail -2 "$out/several-space.txt"
            for strategy in "--search data" "--search owt" "--strategy $out/optcnn-one-gpu.json --evaluate"; do
                # shellcheck disable=SC2086
                "$dir/legion-rs" plan "${common[@]}" --machine one-gpu:4 $strategy \
                    --profile "$p" --json 2>/dev/null | "$python" -c '
import json, sys
doc = json.load(sys.stdin)
for s in doc["searches"]:
    print("simulated", s["search"], round(s["simulated_ms"], 2), "ms")
' | tee -a "$out/several-devices.txt" || failures+=("plan one-gpu:4 $strategy")
            done
        else
            failures+=("several devices on one GPU")
            tail -3 "$out/several-space.txt"
        fi
    fi
    if want layouts; then
        echo "=== bf16 memory formats: PyTorch autocast bf16 in NCHW (legion-rs's layout) beside its"
        echo "    channels_last run (throughput's, or here without it): what NHWC would gain cuDNN's bf16"
        layouts=nchw
        want throughput || layouts="nchw channels_last"
        for layout in $layouts; do
            if t=$(limit 120); then
                timeout "$t" "$python" "$dir/pytorch_peer.py" alexnet:224:128 vgg16:224:64 \
                    inception_v3:299:64 resnet50:224:64 --bf16 --layout "$layout" \
                    | tee -a "$out/layouts-pytorch.jsonl" || failures+=("pytorch bf16 $layout")
            else
                skip "pytorch bf16 $layout"
            fi
        done
        "$python" - "$out/layouts-pytorch.jsonl" "$out/throughput-pytorch.jsonl" <<'PY' | tee "$out/layouts.md" || true
import json, sys
rows = []
for path in sys.argv[1:]:
    try:
        rows += [json.loads(l) for l in open(path) if l.strip()]
    except FileNotFoundError:
        pass
ms = {(r["model"], r.get("layout")): r["median_step_ms"] for r in rows if r["precision"] == "bf16"}
print("| model | bf16 NCHW ms | bf16 channels_last ms | NCHW / channels_last |")
print("|---|---:|---:|---:|")
for model in dict.fromkeys(r["model"] for r in rows):
    a, b = ms.get((model, "nchw")), ms.get((model, "channels_last"))
    ratio = f"{a / b:.2f}" if a and b else "-"
    print(f"| {model} | {a or '-'} | {b or '-'} | {ratio} |")
PY
    fi
    if want several-bf16; then
        echo "=== bf16 on several devices: AlexNet 224 b128 on 4 devices sharing the GPU, data and owt,"
        echo "    fp32 beside bf16 (bf16 slices between the devices): step ms (median of steps 3-6), bytes"
        for strategy in data owt; do
            for precision in fp32 bf16; do
                name="several-$strategy-$precision"
                t=$(limit 45) || { skip "$name"; continue; }
                if timeout "$t" "$dir/legion-rs" train --device cuda --devices 4 --model alexnet \
                    --image-size 224 --batch 128 --classes 1000 --steps 6 --strategy "$strategy" \
                    --precision "$precision" --json >"$out/$name.jsonl" 2>"$out/$name.log"; then
                    "$python" -c '
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
steps = [r["step_ms"] for r in rows if "step_ms" in r][2:]
last = rows[-1]
print(sys.argv[2], "step", round(statistics.median(steps), 2), "ms,",
      last["plan"]["comm_bytes_per_step"], "bytes between devices per step")
' "$out/$name.jsonl" "$name" || failures+=("$name (report)")
                else
                    failures+=("$name")
                    tail -3 "$out/$name.log"
                fi
            done
        done
    fi
    if want profile; then
        echo "=== GPU profile for the paper's machine: every tile shape the searches may give each layer"
        echo "    on 16 devices at 32 samples each, alone, CUDA events; one file for the three models"
        # Each model gets a share of the time left (and at most its own limit); a model cut short
        # keeps what was timed, and `plan` scales the tiles it lacks from measured ones, counting them.
        for run in alexnet:224:60 vgg16:224:120 inception_v3:299:180; do
            IFS=: read -r model image most <<<"$run"
            # The process needs some seconds beyond timing tiles: start, the copy rates, saving.
            t=$(limit "$most") && [ "$t" -ge 25 ] || { skip "profile $model"; continue; }
            start=$SECONDS
            if ! timeout "$t" "$dir/legion-rs" profile --device cuda --machine paper \
                --strategies space --model "$model" --image-size "$image" --batch 512 \
                --classes 1000 --warmup 1 --repeats 2 --time-limit $((t - 15)) --merge \
                --out "$out/profile-paper.json" >"$out/profile-$model.log" 2>&1; then
                failures+=("profile $model")
            fi
            tail -3 "$out/profile-$model.log"
            echo "    $((SECONDS - start)) s"
        done
        # Planning with it is CPU work, for after the run (the device time is the scarce part):
        echo "    then, on any machine: legion-rs plan --machine paper --search all --batch 512 \\"
        echo "        --model MODEL --image-size SIZE --profile profile-paper.json"
    fi
    if want cluster; then
        echo "=== cluster: worker processes sharing the GPU (up, train --cluster, down), two logical"
        echo "    GPUs on it (--gpus 0,0), and plan --cluster against measured steps"
        cl="$out/cluster"
        mkdir -p "$cl"
        rs="$dir/legion-rs"
        report=("$python" "$dir/cluster_report.py")
        small=(--model alexnet --image-size 64 --classes 10 --batch 8)
        # the CPU's one device, the equivalence suite's reference, from the seeded weights
        "$rs" train --device cpu "${small[@]}" --steps 0 --save "$cl/init.safetensors" >/dev/null 2>&1 \
            && "$rs" train --device cpu "${small[@]}" --steps 3 --init "$cl/init.safetensors" \
                --save "$cl/cpu.safetensors" >"$cl/cpu.log" 2>&1 \
            || failures+=("cluster: the CPU reference")
        # gpu_pids: the processes holding GPU memory (nvidia-smi), one per line
        gpu_pids() { nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null | tr -d ' '; }
        # gpu_mib: the GPU's memory in use, MiB (0 where nvidia-smi cannot say)
        gpu_mib() {
            nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits 2>/dev/null \
                | head -1 | tr -d ' ' | grep -E '^[0-9]+$' || echo 0
        }
        rows=()
        for n in 2 4; do
            hosts="$cl/hosts$n.toml"
            state="$cl/state$n"
            printf '[defaults]\ndevice = "cuda"\ndevices = 1\n' >"$hosts"
            for i in $(seq 0 $((n - 1))); do
                printf '\n[[host]]\nname = "g%d"\naddress = "127.0.0.1"\nport = %d\n' \
                    "$i" $((7470 + 10 * n + i)) >>"$hosts"
            done
            t=$(limit 60) || { skip "cluster up $n"; continue; }
            before=$(gpu_mib)
            start=$SECONDS
            if ! timeout "$t" "$rs" up "$hosts" --state "$state" >"$cl/up$n.txt" 2>&1; then
                failures+=("cluster up $n")
                tail -5 "$cl/up$n.txt"
                timeout 20 "$rs" down "$hosts" --state "$state" >/dev/null 2>&1
                continue
            fi
            pids=$(awk '/^g[0-9]+ / {print $5}' "$cl/up$n.txt")
            echo "    up $n workers: $((SECONDS - start)) s, pids $(echo $pids)"
            for strategy in data owt optcnn; do
                name="n$n-$strategy"
                t=$(limit 90) || { skip "cluster $name"; continue; }
                start=$SECONDS
                if timeout "$t" "$rs" train --cluster "$hosts" --state "$state" "${small[@]}" \
                    --strategy "$strategy" --conv-algos precise --steps 3 \
                    --init "$cl/init.safetensors" --save "$cl/$name.safetensors" \
                    --trace "$cl/$name.trace.json" --json >"$cl/$name.jsonl" 2>"$cl/$name.err"; then
                    diff=$("${report[@]}" weights "$cl/$name.safetensors" "$cl/cpu.safetensors") \
                        || failures+=("cluster $name: weights ${diff:-unreadable} from the CPU's")
                    overlap=$("${report[@]}" trace "$cl/$name.trace.json") || overlap="-"
                    ms=$("${report[@]}" steps "$cl/$name.jsonl" 1) || ms="-"
                    rows+=("| $n | $strategy | ${diff:--} | $ms | $((SECONDS - start)) | $overlap |")
                    echo "    $name: weights ${diff:--} (relative, largest tensor) from the CPU's," \
                        "step ${ms} ms, $((SECONDS - start)) s; $overlap"
                else
                    failures+=("cluster $name")
                    tail -5 "$cl/$name.err"
                fi
            done
            start=$SECONDS
            timeout 30 "$rs" down "$hosts" --state "$state" >"$cl/down$n.txt" 2>&1 \
                || failures+=("cluster down $n")
            sleep 2
            left=""
            held=$(gpu_pids)
            for p in $pids; do
                [ -d "/proc/$p" ] && left+=" $p (running)"
                grep -qx "$p" <<<"$held" && left+=" $p (holding GPU memory)"
            done
            after=$(gpu_mib)
            # the driver may keep a little for itself; a worker's context alone is ~500 MiB
            [ "$after" -gt $((before + 256)) ] && left+=" GPU memory ${before} -> ${after} MiB"
            if [ -n "$left" ]; then
                failures+=("cluster down $n left:$left")
                echo "    down $n: left$left"
            else
                echo "    down $n: $((SECONDS - start)) s, no worker process, none holding GPU" \
                    "memory (GPU memory used ${before} MiB before up, ${after} MiB after down)"
            fi
        done
        # Two logical GPUs on this one: the multi-GPU path, slices between them staged.
        for strategy in data owt; do
            name="gpus00-$strategy"
            t=$(limit 60) || { skip "cluster $name"; continue; }
            start=$SECONDS
            if timeout "$t" "$rs" train --device cuda --devices 2 --gpus 0,0 "${small[@]}" \
                --strategy "$strategy" --conv-algos precise --steps 3 \
                --init "$cl/init.safetensors" --save "$cl/$name.safetensors" \
                --trace "$cl/$name.trace.json" --json >"$cl/$name.jsonl" 2>"$cl/$name.err"; then
                diff=$("${report[@]}" weights "$cl/$name.safetensors" "$cl/cpu.safetensors") \
                    || failures+=("cluster $name: weights ${diff:-unreadable} from the CPU's")
                overlap=$("${report[@]}" trace "$cl/$name.trace.json") || overlap="-"
                ms=$("${report[@]}" steps "$cl/$name.jsonl" 1) || ms="-"
                rows+=("| --gpus 0,0 | $strategy | ${diff:--} | $ms | $((SECONDS - start)) | $overlap |")
                echo "    $name: weights ${diff:--} from the CPU's, step $ms ms; $overlap"
            else
                failures+=("cluster $name")
                tail -5 "$cl/$name.err"
            fi
        done
        {
            echo "| workers | strategy | weights vs CPU (max rel, tensor) | step ms (2nd-3rd) | run s | trace (last step) |"
            echo "|---|---|---:|---:|---:|---|"
            printf '%s\n' "${rows[@]}"
        } | tee "$cl/equivalence.md"
        # Measured against planned: AlexNet 224 b128 on 2 workers, 8 steps each (median after
        # the first 3), and `plan --cluster` priced by a GPU profile of 2 devices' tiles and the
        # staging copies (`several`'s profile is of 4 devices: this one is the run's own).
        big=(--model alexnet --image-size 224 --batch 128 --classes 1000)
        hosts="$cl/hosts2.toml"
        state="$cl/state2"
        p="$cl/profile-2.json"
        if t=$(limit 120) && timeout "$t" "$rs" up "$hosts" --state "$state" >"$cl/up-timing.txt" 2>&1 \
            && t=$(limit 60) && timeout "$t" "$rs" profile --device cuda --devices 2 "${big[@]}" \
                --strategies space --warmup 1 --repeats 3 --time-limit 25 --out "$p" \
                >"$cl/profile-2.log" 2>&1; then
            timing=("| strategy | measured ms | simulated ms | measured / simulated |" "|---|---:|---:|---:|")
            for strategy in data owt optcnn; do
                args=(--strategy "$strategy")
                if [ "$strategy" = optcnn ]; then
                    "$rs" plan --cluster "$hosts" --state "$state" "${big[@]}" --search optcnn \
                        --profile "$p" --out "$cl/optcnn-cluster.json" >/dev/null 2>&1 \
                        || { failures+=("plan --cluster optcnn"); continue; }
                    args=(--strategy "$cl/optcnn-cluster.json")
                fi
                t=$(limit 90) || { skip "cluster timing $strategy"; continue; }
                if timeout "$t" "$rs" train --cluster "$hosts" --state "$state" "${big[@]}" \
                    "${args[@]}" --steps 8 --json >"$cl/timing-$strategy.jsonl" \
                    2>"$cl/timing-$strategy.err"; then
                    ms=$("${report[@]}" steps "$cl/timing-$strategy.jsonl" 3) || ms="-"
                else
                    failures+=("cluster timing $strategy")
                    tail -3 "$cl/timing-$strategy.err"
                    ms="-"
                fi
                plan=(--search "$strategy")
                [ "$strategy" = optcnn ] && plan=(--strategy "$cl/optcnn-cluster.json" --evaluate)
                sim=$("$rs" plan --cluster "$hosts" --state "$state" "${big[@]}" "${plan[@]}" \
                    --profile "$p" --json 2>"$cl/plan-$strategy.err" | "$python" -c '
import json, sys
print(round(json.load(sys.stdin)["searches"][0]["simulated_ms"], 2))') \
                    || { failures+=("plan --cluster $strategy"); sim="-"; }
                ratio=$("$python" -c "import sys; print(f'{float(sys.argv[1]) / float(sys.argv[2]):.2f}')" \
                    "$ms" "$sim" 2>/dev/null) || ratio="-"
                timing+=("| $strategy | $ms | $sim | $ratio |")
            done
            "$rs" plan --cluster "$hosts" --state "$state" "${big[@]}" --search data 2>/dev/null \
                | head -1 | tee "$cl/timing.md"
            printf '%s\n' "${timing[@]}" | tee -a "$cl/timing.md"
        else
            failures+=("cluster timing (up or profile)")
            tail -3 "$cl/up-timing.txt" "$cl/profile-2.log" 2>/dev/null
        fi
        timeout 30 "$rs" down "$hosts" --state "$state" >/dev/null 2>&1 || true
    fi
    if [ ${#failures[@]} -gt 0 ]; then
        echo "FAILED: ${failures[*]}"
        exit 1
    fi
    echo "all GPU checks passed"
    ;;
*)
    sed -n '2,17p' "$0" >&2
    exit 2
    ;;
esac
