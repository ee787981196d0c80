#!/usr/bin/env bash
# Paper-scale simulation (issues 6 and 32): predicted training throughput of AlexNet, VGG-16 and
# Inception-v3 for 1..16 GPUs, per-GPU batch 32, under the data / model / owt / optcnn / refine
# searches, on a machine preset family:
#   paper        the paper's testbed: 4 nodes x 4 P100, NVLink pairs inside a node, one shared
#                100 Gb/s EDR NIC per node (the default)
#   paper-pairs  the same GPUs with a private 100 Gb/s link per GPU pair across nodes (the
#                paper's own device graph)
#   dgx-h100     nodes of 8 H100, NVSwitch ports inside, a 400 Gb/s NIC per GPU
# Throughput = global batch / simulated step time; communication = bytes moved per step (the
# paper's Fig. 8 counts the same). One `plan --search all --json` per model and GPU count.
# Prints one markdown table per model, then the summary row BENCHMARKS.md keeps. A baseline that
# does not fit the devices' memory shows "–" and is no competitor.
#
# Usage: integration/paper_scale.sh [--machine paper|paper-pairs|dgx-h100] [--profile FILE]
#            [--bin path/to/legion-rs] [MODEL ...]      (needs jq)
#   build first: cargo build --release -p legion-cli
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=target/release/legion-rs FAMILY=paper PROFILE=() MODELS=()
while [ $# -gt 0 ]; do
    case "$1" in
        --machine) FAMILY=$2; shift 2 ;;
        --profile) PROFILE=(--profile "$2"); shift 2 ;;
        --bin) BIN=$2; shift 2 ;;
        -h|--help) sed -n 2,17p "$0"; exit 0 ;;
        *) MODELS+=("$1"); shift ;;
    esac
done
[ ${#MODELS[@]} -gt 0 ] || MODELS=(alexnet vgg16 inception_v3)
[ -x "$BIN" ] || { echo "$BIN is missing: cargo build --release -p legion-cli" >&2; exit 1; }
command -v jq >/dev/null || { echo "needs jq" >&2; exit 1; }
BASELINES="data model owt"
SUMMARY=()

for model in "${MODELS[@]}"; do
    echo "### $model on $FAMILY"
    echo
    echo "| GPUs | img/s data | model | owt | optcnn | refine | optcnn / best baseline | refine / best baseline | Eq. 1: optcnn / best baseline | MB moved: owt / optcnn / refine | owt / optcnn bytes | MB between nodes: owt / optcnn / refine |"
    echo "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    first_opt="" first_refine="" first_best="" best_name=""
    for n in 1 2 4 8 16; do
        batch=$((32 * n))
        json=$("$BIN" plan --model "$model" --machine "$FAMILY:$n" --batch "$batch" \
            "${PROFILE[@]}" --paper-space --search all --json)
        field() { jq -r --arg s "$1" ".searches[] | select(.search == \$s) | .$2 // empty" <<<"$json"; }
        ips() { local ms; ms=$(field "$1" simulated_ms); [ -n "$ms" ] && jq -n "$batch * 1000 / $ms" || echo 0; }
        row="| $n"
        best=0 best_eq1=1e18 best_here=""
        for s in $BASELINES; do
            # a baseline the devices' memory cannot hold reports an error and no times: "–"
            eq1=$(field "$s" eq1_ms)
            [ -n "$eq1" ] || { row+=" | –"; continue; }
            v=$(ips "$s")
            row+=" | $(printf '%.0f' "$v")"
            if jq -e -n "$v > $best" >/dev/null; then best=$v best_here=$s; fi
            best_eq1=$(jq -n "[$best_eq1, $eq1] | min")
        done
        opt=$(ips optcnn) refine=$(ips refine)
        row+=" | $(printf '%.0f' "$opt") | $(printf '%.0f' "$refine")"
        row+=" | $(printf '%.3f×' "$(jq -n "$opt / $best")")"
        row+=" | $(printf '%.3f×' "$(jq -n "$refine / $best")")"
        row+=" | $(printf '%.3f×' "$(jq -n "$best_eq1 / $(field optcnn eq1_ms)")")"
        mb() { local b; b=$(field "$1" "${2:-comm_bytes}"); [ -n "$b" ] && printf '%.0f' "$(jq -n "$b / 1e6")" || echo -; }
        row+=" | $(mb owt) / $(mb optcnn) / $(mb refine)"
        owt_b=$(field owt comm_bytes) opt_b=$(field optcnn comm_bytes)
        if jq -e -n "$opt_b > 0" >/dev/null; then
            row+=" | $(printf '%.2f×' "$(jq -n "$owt_b / $opt_b")")"
        else
            row+=" | –"
        fi
        row+=" | $(mb owt inter_node_bytes) / $(mb optcnn inter_node_bytes) / $(mb refine inter_node_bytes) |"
        echo "$row"
        [ -n "$first_opt" ] || { first_opt=$opt first_refine=$refine first_best=$best; }
        last_opt=$opt last_refine=$refine last_best=$best best_name=$best_here
        last_ratio=$(jq -n "$opt / $best") last_refine_ratio=$(jq -n "$refine / $best")
    done
    echo
    SUMMARY+=("| $model | $(printf '%.3f×' "$last_ratio") | $(printf '%.3f×' "$last_refine_ratio") | $(printf '%.2f×' "$(jq -n "$last_opt / $first_opt")") | $(printf '%.2f×' "$(jq -n "$last_refine / $first_refine")") | $(printf '%.2f×' "$(jq -n "$last_best / $first_best")") ($best_name) |")
done
echo "| model ($FAMILY) | optcnn / best baseline at 16 | refine / best baseline at 16 | optcnn 1→16 | refine 1→16 | best baseline 1→16 |"
echo "|---|---:|---:|---:|---:|---:|"
printf '%s\n' "${SUMMARY[@]}"
