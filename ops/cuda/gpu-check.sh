#!/usr/bin/env bash
# The GPU check of legion-cuda, in two halves, because the GPU machine has no Rust toolchain:
#
#   ops/cuda/gpu-check.sh build [DIR]   here: builds the crate's test binaries and copies them,
#                                       stripped (~3 MB each), into DIR (default target/gpu-check,
#                                       which git ignores: carry it to the GPU machine)
#   ops/cuda/gpu-check.sh run [DIR]     there: runs them with the CUDA libraries on the loader's
#                                       path; exits non-zero when any test fails
#
# The library folders are those GPU-NOTES.md found working together (one cuDNN copy only).
set -euo pipefail
cd "$(dirname "$0")/../.."
mode="${1:-}"
dir="${2:-target/gpu-check}"

case "$mode" in
build)
    mkdir -p "$dir"
    rm -f "$dir"/*
    cargo test -p legion-cuda --no-run --message-format=json 2>/dev/null \
        | python3 -c '
import json, sys
for line in sys.stdin:
    message = json.loads(line)
    if message.get("reason") == "compiler-artifact" and message.get("executable") \
            and message["profile"]["test"]:
        print(message["target"]["name"], message["executable"])
' \
        | while read -r name executable; do
            cp "$executable" "$dir/$name"
            strip "$dir/$name"
            echo "$dir/$name"
        done
    ;;
run)
    export LD_LIBRARY_PATH="/usr/lib/x86_64-linux-gnu:/usr/local/cuda-13.0/targets/x86_64-linux/lib:/usr/local/nvidia/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    # A test that skips here for want of the GPU, NVRTC or a C++ compiler fails (legion_ops::require).
    export LEGION_REQUIRE=gpu,nvrtc,cxx
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
    status=0
    for test in "$dir"/*; do
        echo "=== $(basename "$test")"
        "$test" --nocapture --test-threads=1 || status=1
    done
    exit $status
    ;;
*)
    sed -n '2,10p' "$0" >&2
    exit 2
    ;;
esac
