#!/usr/bin/env bash
# Paper-scale simulation (issue 6): predicted training throughput of AlexNet, VGG-16 and
# Inception-v3 on the paper's testbed (4 nodes x 4 P100, NVLink + 100 Gb/s EDR IB) for
# 1..16 GPUs, per-GPU batch 32, under the data / model / owt / optcnn searches.
# Throughput = global batch / simulated step time. Prints one markdown table per model.
#
# Usage: integration/paper_scale.sh [path/to/legion-rs]   (needs jq)
#   build first: cargo build --release -p legion-cli
set -euo pipefail
BIN=${1:-target/release/legion-rs}
SEARCHES="data model owt optcnn"

for model in alexnet vgg16 inception_v3; do
  echo "### $model"
  echo
  echo "| GPUs | data | model | owt | optcnn | optcnn / best baseline | same under Eq.1 | optcnn scaling vs 1 GPU | optcnn Eq.1 ms | optcnn sim ms |"
  echo "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
  opt1=""
  for n in 1 2 4 8 16; do
    batch=$((32 * n))
    row="| $n"
    best=0 best_eq1=1e18
    for s in $SEARCHES; do
      json=$("$BIN" plan --model "$model" --machine "paper:$n" --batch "$batch" --search "$s" --json)
      sim=$(jq '.searches[0].simulated_ms' <<<"$json")
      eq1=$(jq '.searches[0].eq1_ms' <<<"$json")
      ips=$(jq -n "$batch * 1000 / $sim")
      row+=" | $(printf '%.0f' "$ips")"
      if [ "$s" != optcnn ]; then
        best=$(jq -n "[$best, $ips] | max")
        best_eq1=$(jq -n "[$best_eq1, $eq1] | min")
      fi
    done
    [ -z "$opt1" ] && opt1=$ips
    row+=" | $(printf '%.3f×' "$(jq -n "$ips / $best")")"
    row+=" | $(printf '%.3f×' "$(jq -n "$best_eq1 / $eq1")")"
    row+=" | $(printf '%.2f×' "$(jq -n "$ips / $opt1")")"
    row+=" | $(printf '%.1f' "$eq1") | $(printf '%.1f' "$sim") |"
    echo "$row"
  done
  echo
done
