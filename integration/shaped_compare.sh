#!/usr/bin/env bash
# Shaped-network benchmark (strategies over links of known bandwidth): N hosts in network namespaces on this machine, joined through
# a bridge by veth pairs shaped with `tc tbf` at RATE in both directions; `legion-rs up` starts a
# worker in each (run_with = ip netns exec), then `--compare` runs data, model, owt and optcnn on
# that cluster for each model, then `down`. Every namespace, veth and the bridge are removed on
# exit, whatever happens. Needs root and iproute2.
#
# Usage: integration/shaped_compare.sh [--hosts N] [--devices-per-host D] [--rate 1gbit]
#            [--steps S] [--out DIR] [MODEL:IMAGE_SIZE:BATCH ...]
#   default models: alexnet:224:32 inception_v3:75:8
#   build first: cargo build --release -p legion-cli -p legion-examples
# Writes DIR/<model>.txt (the table), DIR/<model>.svg and each strategy's measured and simulated
# timelines (DIR/<model>-traces/<strategy>.{measured,simulated}.json), and prints the tables.
set -euo pipefail
cd "$(dirname "$0")/.."

HOSTS=2 DEVICES=2 RATE=1gbit STEPS=3 OUT=target/shaped
MODELS=()
while [ $# -gt 0 ]; do
    case "$1" in
        --hosts) HOSTS=$2; shift 2 ;;
        --devices-per-host) DEVICES=$2; shift 2 ;;
        --rate) RATE=$2; shift 2 ;;
        --steps) STEPS=$2; shift 2 ;;
        --out) OUT=$2; shift 2 ;;
        -h|--help) sed -n 2,14p "$0"; exit 0 ;;
        *) MODELS+=("$1"); shift ;;
    esac
done
[ ${#MODELS[@]} -gt 0 ] || MODELS=(alexnet:224:32 inception_v3:75:8)
BIN=target/release/legion-rs
for b in "$BIN" target/release/alexnet; do
    [ -x "$b" ] || { echo "$b is missing: cargo build --release -p legion-cli -p legion-examples" >&2; exit 1; }
done
[ "$(id -u)" = 0 ] || { echo "needs root (network namespaces)" >&2; exit 1; }

TAG=$$
SUBNET=$((TAG % 250))
BRIDGE=lgb$((TAG % 100000))
mkdir -p "$OUT"
STATE=$(mktemp -d)
HOSTS_FILE=$STATE/hosts.toml
NAMESPACES=()

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
done
