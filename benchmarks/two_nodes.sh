#!/usr/bin/env bash
# Two gloo ranks as two nodes joined by a link of a set bandwidth, on one machine.
#
#   sudo bash benchmarks/two_nodes.sh RATE SCRIPT [ARGS...]
#   e.g. bash benchmarks/two_nodes.sh 1gbit benchmarks/bench_ab.py --engines fsdp2,zero3 --out r.json
#
# Two ranks on one host exchange through the loopback device at memory speed, so every
# benchmark there measures a network faster than any between nodes. This script puts each rank
# in a network namespace of its own ("node" 0 and 1), joins them with a veth pair and limits
# each direction with a token bucket (tc tbf) to RATE (tc's units: 1gbit, 2500mbit, 10gbit;
# "none" leaves the pair unlimited, to see what the namespaces alone cost), then runs
# `torchrun --nnodes=2 --nproc-per-node=1 SCRIPT ARGS` in each, rendezvous over the pair.
# Needs root (ip netns, tc) and the project's virtual environment (./dev venv). Everything it
# made is removed on exit, also on failure or Ctrl-C. Rank 0 runs in the current directory, so
# relative --out paths land here; each node's output goes to the terminal, prefixed.
set -euo pipefail
if [[ $# -lt 2 ]]; then
  sed -n '4,5p' "$0" | sed 's/^# \{0,1\}//' >&2
  exit 2
fi
rate="$1"
shift
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${SHARDWISE_VENV:-$root/.venv}"
[[ -x "$venv/bin/torchrun" ]] || { echo "two_nodes: no $venv/bin/torchrun: run ./dev venv" >&2; exit 2; }
[[ $(id -u) -eq 0 ]] || { echo "two_nodes: needs root (ip netns, tc)" >&2; exit 2; }

prefix="swn$$"
addresses=(10.231.0.1 10.231.0.2)
# Jumbo frames, as cluster fabrics use; the limit is the token bucket, not the frame rate.
mtu=9000
port=29531

cleanup() {
  ip netns del "${prefix}0" 2>/dev/null || true
  ip netns del "${prefix}1" 2>/dev/null || true
}
trap cleanup EXIT INT TERM

echo "two_nodes: nodes ${prefix}0 and ${prefix}1, link $rate" >&2
for node in 0 1; do
  ip netns add "$prefix$node"
  ip -n "$prefix$node" link set lo up
done
ip link add "${prefix}v0" mtu "$mtu" netns "${prefix}0" type veth \
  peer name "${prefix}v1" mtu "$mtu" netns "${prefix}1"
for node in 0 1; do
  ip -n "$prefix$node" addr add "${addresses[$node]}/24" dev "$prefix"v"$node"
  ip -n "$prefix$node" link set "$prefix"v"$node" up
  if [[ "$rate" != none ]]; then
    # A bucket of 4 MiB lets a collective's first megabytes through at once, as a NIC's
    # queues do; beyond it the link runs at RATE.
    ip netns exec "$prefix$node" tc qdisc add dev "$prefix"v"$node" root tbf \
      rate "$rate" burst 4mb latency 100ms
  fi
done

pids=()
for node in 0 1; do
  ip netns exec "$prefix$node" env \
    GLOO_SOCKET_IFNAME="$prefix"v"$node" OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" \
    "$venv/bin/torchrun" --nnodes=2 --nproc-per-node=1 --node-rank="$node" \
    --master-addr="${addresses[0]}" --master-port="$port" "$@" \
    > >(sed -u "s/^/[node $node] /") 2>&1 &
  pids+=($!)
done
# The first node to fail stops the other, which would otherwise wait for it in a collective.
status=0
for _ in "${pids[@]}"; do
  if ! wait -n "${pids[@]}"; then
    status=1
    kill "${pids[@]}" 2>/dev/null || true
    break
  fi
done
exit "$status"
