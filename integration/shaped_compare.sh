#!/usr/bin/env bash
# Shaped-network benchmark (strategies over links of known bandwidth): N hosts in network namespaces on this machine, joined through
# a bridge by veth pairs shaped with `tc tbf` at RATE in both directions; `legion-rs up` starts a
# worker in each (run_with = ip netns exec), then `--compare` runs data, model, owt and optcnn on
# that cluster for each model, then `down`. Every namespace, veth and the bridge are removed on
# exit, whatever happens. Needs root and iproute2.
#
# With --ddp, PyTorch DistributedDataParallel (gloo, integration/ddp_peer.py under torchrun) then
# trains each model on the same namespaces and links, with 1 and with D ranks per host, and a
# side-by-side table of both systems' steps follows (DIR/<model>.side-by-side.md). torch and
# torchvision come from LEGION_TORCH_PATH (a pip --target directory) or the python3 in PATH.
#
# Usage: integration/shaped_compare.sh [--hosts N] [--devices-per-host D] [--rate 1gbit]
#            [--steps S] [--out DIR] [--ddp] [MODEL:IMAGE_SIZE:BATCH ...]
#   default models: alexnet:224:32 inception_v3:75:8
#   build first: cargo build --release -p legion-cli -p legion-examples
# Writes DIR/<model>.txt (the table), DIR/<model>.svg and each strategy's measured and simulated
# timelines (DIR/<model>-traces/<strategy>.{measured,simulated}.json), and prints the tables.
set -euo pipefail
cd "$(dirname "$0")/.."

HOSTS=2 DEVICES=2 RATE=1gbit STEPS=3 OUT=target/shaped DDP=0
MODELS=()
while [ $# -gt 0 ]; do
    case "$1" in
        --hosts) HOSTS=$2; shift 2 ;;
        --devices-per-host) DEVICES=$2; shift 2 ;;
        --rate) RATE=$2; shift 2 ;;
        --steps) STEPS=$2; shift 2 ;;
        --out) OUT=$2; shift 2 ;;
        --ddp) DDP=1; shift ;;
        -h|--help) sed -n 2,19p "$0"; exit 0 ;;
        *) MODELS+=("$1"); shift ;;
    esac
done
[ ${#MODELS[@]} -gt 0 ] || MODELS=(alexnet:224:32 inception_v3:75:8)
BIN=target/release/legion-rs
for b in "$BIN" target/release/alexnet; do
    [ -x "$b" ] || { echo "$b is missing: cargo build --release -p legion-cli -p legion-examples" >&2; exit 1; }
done
[ "$(id -u)" = 0 ] || { echo "needs root (network namespaces)" >&2; exit 1; }
TORCH_PATH=${LEGION_TORCH_PATH:-}
if [ "$DDP" = 1 ]; then
    PYTHONPATH=$TORCH_PATH python3 -c "import torch, torchvision" 2>/dev/null || {
        echo "--ddp needs torch and torchvision: set LEGION_TORCH_PATH to a pip --target directory" >&2
        exit 1
    }
fi

TAG=$$
SUBNET=$((TAG % 250))
BRIDGE=lgb$((TAG % 100000))
mkdir -p "$OUT"
STATE=$(mktemp -d)
HOSTS_FILE=$STATE/hosts.toml
NAMESPACES=()
INNER=()

cleanup() {
    "$BIN" down "$HOSTS_FILE" --state "$STATE/state" >/dev/null 2>&1 || true
    for ns in "${NAMESPACES[@]}"; do ip netns del "$ns" 2>/dev/null || true; done
    ip link del "$BRIDGE" 2>/dev/null || true
    rm -rf "$STATE"
}
trap cleanup EXIT

ip link add "$BRIDGE" type bridge
ip addr add "10.79.$SUBNET.1/24" dev "$BRIDGE"
ip link set "$BRIDGE" up
: > "$HOSTS_FILE"
for i in $(seq 0 $((HOSTS - 1))); do
    ns=lgn$((TAG % 100000))-$i outer=lga$((TAG % 100000))-$i inner=lgc$((TAG % 100000))-$i
    ip netns add "$ns"
    NAMESPACES+=("$ns")
    INNER+=("$inner")
    ip link add "$outer" type veth peer name "$inner"
    ip link set "$outer" master "$BRIDGE" up
    ip link set "$inner" netns "$ns"
    ip netns exec "$ns" ip addr add "10.79.$SUBNET.$((i + 2))/24" dev "$inner"
    ip netns exec "$ns" ip link set "$inner" up
    ip netns exec "$ns" ip link set lo up
    # Both directions: egress of the namespace's end and of the bridge's end.
    ip netns exec "$ns" tc qdisc add dev "$inner" root tbf rate "$RATE" burst 1mb latency 100ms
    tc qdisc add dev "$outer" root tbf rate "$RATE" burst 1mb latency 100ms
    cat >> "$HOSTS_FILE" <<EOF
[[host]]
name = "h$i"
address = "10.79.$SUBNET.$((i + 2))"
devices = $DEVICES
run_with = ["ip", "netns", "exec", "$ns"]

EOF
done

"$BIN" up "$HOSTS_FILE" --state "$STATE/state"
for spec in "${MODELS[@]}"; do
    IFS=: read -r model size batch <<<"$spec"
    echo
    echo "### $model ${size}x$size, batch $batch, $HOSTS hosts x $DEVICES devices, $RATE links"
    cargo_bin=target/release/$model
    args=(--cluster "$HOSTS_FILE" --state "$STATE/state" --image-size "$size" --batch "$batch"
          --steps "$STEPS" --compare --chart "$OUT/$model.svg" --trace "$OUT/$model-traces")
    "$cargo_bin" "${args[@]}" | tee "$OUT/$model.txt"
    [ "$DDP" = 1 ] || continue
    params=$(sed -n 's/.* classes, \([0-9]*\) parameters.*/\1/p' "$OUT/$model.txt" | head -n 1)
    : > "$OUT/$model.ddp.jsonl"
    for ranks in $(printf '%s\n' 1 "$DEVICES" | sort -un); do
        echo "PyTorch DDP (gloo), $ranks rank(s) per host" >&2
        pids=()
        for i in $(seq 0 $((HOSTS - 1))); do
            ip netns exec "${NAMESPACES[$i]}" env PYTHONPATH="$TORCH_PATH" \
                GLOO_SOCKET_IFNAME="${INNER[$i]}" python3 -m torch.distributed.run \
                --nnodes "$HOSTS" --nproc-per-node "$ranks" --node-rank "$i" \
                --master-addr "10.79.$SUBNET.2" --master-port $((29500 + TAG % 1000)) \
                integration/ddp_peer.py "$spec" --steps "$STEPS" --warmup 2 --expect-params "$params" \
                >> "$OUT/$model.ddp.jsonl" 2> "$STATE/ddp-$i.log" &
            pids+=($!)
        done
        for p in "${pids[@]}"; do
            wait "$p" || { cat "$STATE"/ddp-*.log >&2; echo "DDP with $ranks rank(s) per host failed" >&2; exit 1; }
        done
    done
    python3 - "$OUT/$model.txt" "$OUT/$model.ddp.jsonl" "$HOSTS" "$DEVICES" "$RATE" \
        > "$OUT/$model.side-by-side.md" <<'PY'
import json, re, sys
legion, ddp, hosts, devices, rate = sys.argv[1:]
peers = [json.loads(line) for line in open(ddp) if line.startswith("{")]
best = min(p["median_ms"] for p in peers)
print(f"| system / strategy ({hosts} hosts, {rate} links) | step (median) | moved per step | vs best DDP |")
print("|---|---:|---:|---:|")
for p in sorted(peers, key=lambda p: p["ranks_per_host"]):
    print(f"| PyTorch {p['torch'].split('+')[0]} DDP (gloo), {p['ranks_per_host']} rank(s) per host, "
          f"{p['threads_per_rank']} thread(s) each | {p['median_ms']:,.0f} ms | ring all-reduce of "
          f"{p['param_bytes'] / 1e6:,.0f} MB of gradients | {best / p['median_ms']:.2f}x |")
row = re.compile(r"^(\S+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+ [KMGT]?i?B)\s")
for line in open(legion):
    m = row.match(line)
    if m:
        ms = float(m.group(2))
        print(f"| legion-rs `{m.group(1)}`, {hosts} hosts x {devices} devices | {ms:,.0f} ms | "
              f"{m.group(4)} | {best / ms:.2f}x |")
PY
    cat "$OUT/$model.side-by-side.md"
done
