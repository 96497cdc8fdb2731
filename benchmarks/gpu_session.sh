#!/usr/bin/env bash
# The GPU half of the checks, in the few long calls a lent GPU machine allows. Run from the
# repository root on the GPU machine:
#
#   bash benchmarks/gpu_session.sh all      OUT [--smoke]
#       Ask for an H200 (the device tool's kind nvidia-h200): the 10.8B Llama's model state
#       is 194 GB at 18 bytes a parameter, more than an H100's 80 GB and 125 GiB of host hold.
#       THE call of a lent session, at most 9 minutes: each part under a `timeout` of its own,
#       within what is left of the call's deadline (530 s; GPU_SESSION_SECONDS=... sets
#       another), so a hang cannot eat the rest; in order of value (budget in seconds):
#         versions           nvidia-smi, torch and CUDA                                    15
#         gpu-tests          pytest tests/gpu                                             100
#         bounds             bench_gpu.py bounds: pinned copies each way and both, HybridAdam
#                            and fused AdamW on the host's cores, host memory bandwidth     40
#         offload-2.7b       bench_gpu.py llama: a 2.7B Llama, FSDP2 CPUOffloadPolicy,
#                            shardwise "cpu", the same stepping during backward,
#                            plain torch (ratios to FSDP2)                                170
#         llama-10.8b-ckpt   the 10.8B Llama, checkpointing, "auto" defaults: 1 warm-up and
#                            2 timed steps                                                160
#         llama-10.8b        the same without checkpointing, 1 + 1 steps          what is left
#         largest            the largest 4096-wide Llama the memory holds at 18 bytes a
#                            parameter (at most 16.4B), checkpointing, "auto"     what is left
#         report             bench_gpu.py report: OUT/RESULTS-gpu.md, the block for
#                            benchmarks/RESULTS.md (15 s kept for it)
#       --smoke runs the same wiring on tiny models on any machine (on a CPU: the copies
#       skipped, FSDP2's offload unpinned, tests/gpu skipped), in about 80 s on 2 cores.
#   bash benchmarks/gpu_session.sh env      OUT   versions, then tests/gpu
#   bash benchmarks/gpu_session.sh bounds   OUT   bench_gpu.py bounds alone
#   bash benchmarks/gpu_session.sh llama    OUT ARGS  bench_gpu.py llama ARGS --out OUT/llama.json
#                                                 (e.g. --model 4096x88 --engines
#                                                 shardwise-auto+disk --checkpointing)
#   bash benchmarks/gpu_session.sh report   OUT   bench_gpu.py report OUT
#   bash benchmarks/gpu_session.sh compare  OUT   bench_gpu.py compare (stage 3 vs FSDP2 vs torch)
#   bash benchmarks/gpu_session.sh largest  OUT [ARGS]  bench_gpu.py largest (GPT) for auto, cpu
#                                                 and torch; ARGS go to it (--n-embd, ...)
#   bash benchmarks/gpu_session.sh auto     OUT   bench_auto.py's budget sweep on the GPU
#   bash benchmarks/gpu_session.sh memory   OUT   bench_memory.py compare on the GPU, one rank
#   bash benchmarks/gpu_session.sh smoke    OUT   compare, auto and memory's wiring, tiny
#
# OUT (default $OUT, else /tmp/gpu-session) receives each part's log and JSON (and each llama
# attempt's log and record beside its run's JSON). The packages run from the working tree
# (PYTHONPATH), on the machine's own torch: nothing is installed, since such a machine may
# reach no package index. A copy of the tree without .git names its commit with COMMIT=...
set -uo pipefail

command="bash benchmarks/gpu_session.sh $*"
part=${1:?"usage: gpu_session.sh {all|env|bounds|llama|report|compare|largest|auto|memory|smoke} [OUT] [ARGS...]"}
out=${2:-${OUT:-/tmp/gpu-session}}
shift $(($# < 2 ? $# : 2))
mkdir -p "$out"
root=$(pwd)
export PYTHONPATH="$root/packages/core/src:$root/packages/lightning/src:$root/packages/hf/src:$root/benchmarks:$root/tests${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
python=${PYTHON:-python3}
bench_gpu="$python benchmarks/bench_gpu.py"

run() {  # run NAME COMMAND...: the command's output to the terminal and OUT/NAME.log
    local name=$1
    shift
    echo "== $name: $*"
    "$@" 2>&1 | tee "$out/$name.log"
    local code=${PIPESTATUS[0]}
    echo "== $name: exit $code"
    return "$code"
}

deadline=${GPU_SESSION_SECONDS:-530}  # seconds from the call's start: every part ends by then
reserve=0     # seconds kept back for what comes after the part being budgeted
budget() {  # budget WANT: $b = WANT, or what is left before the deadline less $reserve
    local left=$((deadline - SECONDS - reserve))
    b=$(($1 < left ? $1 : left))
    least=$(($1 < 20 ? $1 : 20))
}
part() {  # part NAME COMMAND...: COMMAND under `timeout $b`, skipped when under $least s
    local name=$1 started=$SECONDS code  # (20 s, or all it asked for); OUT/parts.tsv
    shift
    if ((b < least)); then
        echo "== $name: skipped, $b s left"
        printf '%s\tskipped\t0\t%s\n' "$name" "$b" >>"$out/parts.tsv"
        return 0
    fi
    run "$name" timeout -k 5 "$b" "$@"
    code=$?
    printf '%s\t%s\t%s\t%s\n' "$name" "$code" "$((SECONDS - started))" "$b" >>"$out/parts.tsv"
    return "$code"
}

case $part in
env)
    run versions bash -c "nvidia-smi; $python -c 'import torch; print(torch.__version__, \
torch.version.cuda, torch.cuda.get_device_name(), torch.cuda.get_device_properties(0))'"
    run gpu-tests "$python" -m pytest -q -p no:cacheprovider tests/gpu
    ;;
compare)
    run compare $bench_gpu compare --out "$out/compare.json"
    ;;
largest)
    # Largest first; each attempt in a process of its own (bench_gpu.py), at most ~3 minutes.
    status=0
    for placement in auto cpu torch; do
        run "largest-$placement" $bench_gpu largest --placement "$placement" \
            --attempt-timeout 180 --out "$out/largest-$placement.json" "$@" || status=1
    done
    exit $status
    ;;
memory)
    run memory "$python" benchmarks/bench_memory.py compare --ranks 1 --sizes 117m,168m \
        --engines ddp,fsdp2,zero2,zero3-cuda,zero3-cpu,zero3-auto --attempt-timeout 120 \
        --out "$out/memory.json" --results "$out/RESULTS-memory.md"
    ;;
auto)
    run auto-sweep "$python" benchmarks/bench_auto.py --device cuda --world 1 --dim 1024 \
        --hidden 4096 --blocks 8 --chunk 4194304 --batch 8192 --rounds 8 --copies 2 \
        --results "$out/RESULTS-cuda.md"
    ;;
smoke)
    status=0
    run compare-smoke $bench_gpu compare --smoke --out "$out/compare-smoke.json" || status=1
    run auto-smoke "$python" benchmarks/bench_auto.py --rounds 1 --copies 2 --blocks 2 \
        --results "$out/RESULTS-smoke.md" || status=1
    run memory-smoke "$python" benchmarks/bench_memory.py compare --smoke --ranks 1 \
        --engines ddp,zero3-cuda --steps 1 --out "$out/memory-smoke.json" || status=1
    exit $status
    ;;
bounds)
    run bounds $bench_gpu bounds --out "$out/bounds.json" "$@"
    ;;
llama)
    run llama $bench_gpu llama --out "$out/llama.json" "$@"
    ;;
report)
    run report $bench_gpu report "$out" "$@"
    ;;
all)
    # pytest's own options are cleared (-o addopts): the machine may lack the pytest-timeout
    # plugin the repository's configuration names. Each llama run stops its own attempts 5 s
    # before its part's budget (--budget), its `timeout` behind that.
    smoke=""
    [[ "${1:-}" == "--smoke" ]] && smoke="--smoke"
    rm -f "$out/parts.tsv"
    status=0
    reserve=15
    budget 15
    part versions bash -c "nvidia-smi || true; $python -c 'import torch, transformers; \
print(torch.__version__, torch.version.cuda, transformers.__version__, \
torch.cuda.is_available() and torch.cuda.get_device_name())'" || status=1
    budget 100
    part gpu-tests "$python" -m pytest -q -p no:cacheprovider -o addopts=-ra tests/gpu || status=1
    budget 40
    part bounds $bench_gpu bounds $smoke --out "$out/bounds.json" || status=1
    budget 170
    part offload-2.7b $bench_gpu llama $smoke --model 2.7b \
        --engines fsdp2-offload,shardwise-cpu,shardwise-cpu+early,torch \
        --timeouts 50,45,45,25 --warmup 1 --steps 2 \
        --budget $((b - 5)) --out "$out/offload-2.7b.json" || status=1
    budget 160
    part llama-10.8b-ckpt $bench_gpu llama $smoke --model 10.8b --engines shardwise-auto \
        --checkpointing --warmup 1 --steps 2 --timeouts 155 --budget $((b - 5)) \
        --out "$out/llama-10.8b-ckpt.json" || status=1
    budget 150
    part llama-10.8b $bench_gpu llama $smoke --model 10.8b --engines shardwise-auto \
        --warmup 1 --steps 1 --timeouts 145 --budget $((b - 5)) \
        --out "$out/llama-10.8b.json" || status=1
    # The largest Llama of width 4096 whose model state fits this machine's device and host
    # memory together at the engine's 18 bytes a parameter (bf16 payload, fp32 master, fp32
    # gradient shard, Adam's two moments) less 24 GB (activations with checkpointing, the
    # working set, CUDA's context, the pools): 67 layers (13.8B) on an H200 and 125 GiB, 50
    # (10.4B) on an H100; at most 80 (16.4B, 295 GB of state: past both).
    layers=$("$python" -c 'import os, torch
device = torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else 0
host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
print(max(2, min(80, int(((device + host - 24e9) / 18 - 0.262e9) / 0.2024e9))))' || echo 80)
    budget 300
    part largest $bench_gpu llama $smoke --model "4096x$layers" --engines shardwise-auto \
        --checkpointing --warmup 1 --steps 1 --timeouts 295 --budget $((b - 5)) \
        --out "$out/largest.json" || status=1
    reserve=0
    budget 15
    b=15 least=0  # the report always runs: a few seconds, no device
    part report $bench_gpu report "$out" --command "$command" || status=1
    echo "== all: $SECONDS s; the results block: $out/RESULTS-gpu.md"
    exit $status
    ;;
*)
    echo "unknown part: $part (all, env, bounds, llama, report, compare, largest, auto, memory" \
        "or smoke)" >&2
    exit 2
    ;;
esac
