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
# The checks: every Backend primitive on the GPU against the CPU kernels (gpu_kernels), a small
# model trained three steps on the GPU as on the CPU (gpu_training), the NVRTC compile test, every
# strategy on 4 GPU device actors sharing the GPU against the CPU's single device (gpu_equivalence:
# LeNet-5, AlexNet 64, Inception-v3 75, batch 8, 3 steps), single-GPU training throughput side by
# side with PyTorch in the same run (strict FP32, then TF32: legion-rs --tf32, torch's allow_tf32)
# for AlexNet 224 b128, VGG-16 224 b64, Inception-v3 299 b64, AlexNet's step on 4 devices sharing
# the GPU under data, owt and optcnn against the simulation priced by those devices' measured
# tiles and copies (`plan --machine one-gpu:4`), and a GPU profile of the three models for the paper's
# machine ($OUT/profile-paper.json: every tile shape of 16 devices at 32 samples each, for
# `plan --machine paper --profile`).
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
    du -sh "$dir"
    ;;
run)
    out="${OUT:-$dir/out}"
    mkdir -p "$out"
    export LD_LIBRARY_PATH="/usr/lib/x86_64-linux-gnu:/usr/local/cuda-13.0/targets/x86_64-linux/lib:/usr/local/nvidia/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    python=/opt/torch/.venv/bin/python
    [ -x "$python" ] || python=python3
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
    failures=()
    for test in "$dir"/*; do
        case "$(basename "$test")" in
        legion-rs | pytorch_peer.py | out) continue ;;
        esac
        [ -x "$test" ] || continue
        echo "=== $(basename "$test")"
        if ! "$test" --nocapture --test-threads=1 2>&1 | tee "$out/$(basename "$test").log"; then
            failures+=("$(basename "$test")")
        fi
    done
    for tf32 in "" --tf32; do
        echo "=== throughput, legion-rs --device cuda (one GPU, ${tf32:-strict FP32})"
        for run in alexnet:224:128 vgg16:224:64 inception_v3:299:64; do
            IFS=: read -r model image batch <<<"$run"
            log="$out/legion-$model${tf32}.jsonl"
            if timeout 300 "$dir/legion-rs" train --device cuda --devices 1 --model "$model" \
                --image-size "$image" --batch "$batch" --classes 1000 --steps 20 --json $tf32 \
                >"$log" 2>"$out/legion-$model$tf32.err"; then
                "$python" - "$log" "$model" "$image" "$batch" "$tf32" <<'PY' | tee -a "$out/throughput-legion.jsonl"
import json, statistics, sys
steps = [json.loads(l) for l in open(sys.argv[1]) if '"step"' in l and '"summary"' not in l]
ms = statistics.median(s["step_ms"] for s in steps[5:])
print(json.dumps({"peer": "legion-rs", "model": sys.argv[2], "image": int(sys.argv[3]),
                  "batch": int(sys.argv[4]), "tf32": sys.argv[5] == "--tf32",
                  "median_step_ms": ms, "images_per_sec": int(sys.argv[4]) / ms * 1e3}))
PY
            else
                echo "legion-rs $model ${tf32:-fp32} failed:"
                tail -5 "$out/legion-$model$tf32.err"
                failures+=("legion-rs $model ${tf32:-fp32}")
            fi
        done
    done
    echo "=== several devices on one GPU: AlexNet 224 b128 on 4 devices, a stream each: measured"
    echo "    steps against the simulation priced by the tiles just measured (one-gpu:4)"
    if timeout 300 "$dir/legion-rs" profile --device cuda --devices 4 --model alexnet --image-size 224 \
        --batch 128 --classes 1000 --strategies data,owt,optcnn --warmup 3 --repeats 10 \
        --out "$out/profile-one-gpu.json" 2>&1 | tee "$out/several-devices.txt"; then
        for strategy in data owt optcnn; do
            "$dir/legion-rs" plan --model alexnet --image-size 224 --batch 128 --classes 1000 \
                --machine one-gpu:4 --search "$strategy" --profile "$out/profile-one-gpu.json" \
                --json 2>/dev/null | "$python" -c '
import json, sys
doc = json.load(sys.stdin)
for s in doc["searches"]:
    print("simulated", s["search"], round(s["simulated_ms"], 2), "ms")
' | tee -a "$out/several-devices.txt" || failures+=("plan one-gpu:4 $strategy")
        done
    else
        failures+=("several devices on one GPU")
    fi
    echo "=== throughput, PyTorch on the same GPU (strict FP32, then TF32)"
    for tf32 in "" --tf32; do
        "$python" "$dir/pytorch_peer.py" alexnet:224:128 vgg16:224:64 inception_v3:299:64 $tf32 \
            | tee -a "$out/throughput-pytorch.jsonl" || failures+=("pytorch ${tf32:-fp32}")
    done
    echo "=== legion-rs / PyTorch median step time (same GPU, same run)"
    "$python" - "$out/throughput-legion.jsonl" "$out/throughput-pytorch.jsonl" <<'PY' || true
import json, sys
def rows(path):
    try:
        return {(r["model"], r["tf32"]): r["median_step_ms"] for r in map(json.loads, open(path))}
    except FileNotFoundError:
        return {}
ours, peer = rows(sys.argv[1]), rows(sys.argv[2])
print("| model | mode | legion-rs ms | PyTorch ms | ratio |")
print("|---|---|---:|---:|---:|")
for key in sorted(set(ours) | set(peer)):
    a, b = ours.get(key), peer.get(key)
    ratio = f"{a / b:.2f}" if a and b else "-"
    fmt = lambda v: f"{v:.1f}" if v else "-"
    print(f"| {key[0]} | {'TF32' if key[1] else 'FP32'} | {fmt(a)} | {fmt(b)} | {ratio} |")
PY
    echo "=== GPU profile for the paper's machine: every tile shape the searches may give each layer on"
    echo "    16 devices at 32 samples each, alone, CUDA events; one file for the three models"
    for run in alexnet:224 vgg16:224 inception_v3:299; do
        IFS=: read -r model image <<<"$run"
        if ! timeout 300 "$dir/legion-rs" profile --device cuda --machine paper --strategies space \
            --model "$model" --image-size "$image" --batch 512 --classes 1000 --warmup 1 \
            --repeats 3 --merge --out "$out/profile-paper.json" 2>&1 | tee "$out/profile-$model.log"; then
            failures+=("profile $model")
        fi
    done
    for run in alexnet:224 vgg16:224 inception_v3:299; do
        IFS=: read -r model image <<<"$run"
        "$dir/legion-rs" plan --model "$model" --image-size "$image" --batch 512 --classes 1000 \
            --machine paper --search all --profile "$out/profile-paper.json" 2>&1 \
            | tail -14 | tee -a "$out/plan-paper-profiled.txt"
    done
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
