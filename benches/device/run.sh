#!/usr/bin/env bash
# The GPU host check. Runs what benches/device/prepare.sh built into .device/, and writes
# each step's output to $OUT (the tool brings it back) and a one-line verdict per step to
# stdout. Each step has its own time limit, so one hang cannot eat the others' time.
#
#   1. the host: GPU, driver, `rdzv rdma probe`;
#   2. the CUDA tests with RDZV_REQUIRE_CUDA=1 (a skip is a failure there);
#   3. `rdzv bench rpc` of the CUDA channels (with the cuda-d2d, h2d-pinned and
#      d2h-pinned limit rows of the same run) and of CPU tensors;
#   4. the store against PyTorch's libuv server (benches/compare_pytorch.py), one
#      interleaved run: latency, throughput at 1/64/512/2048 connections, storms.
#
# Usage (device tool): bash benches/device/run.sh [STEPS]   STEPS: e.g. "host,cuda,rpc,store"
# Every step's limit added up is more than one device call's 10 minutes, so run it as two
# calls, `run.sh host,cuda` (at most about 8.5 minutes) then `run.sh rpc,store` (at most
# about 7.5); a host where nothing hangs takes much less.
set -uo pipefail
cd "$(dirname "$0")/../.."
bin=.device/bin
out="${OUT:-/tmp/device-out}"
mkdir -p "$out"
steps="${1:-host,cuda,rpc,store}"
python="${PYTHON:-python3}"
[ -x "$bin/rdzv" ] || { echo "no $bin/rdzv: run benches/device/prepare.sh here and carry .device"; exit 2; }
echo "commit $(cat .device/commit 2>/dev/null || echo '?'), started $(date -u +%H:%M:%S)"

run() { # $1 = name, $2 = seconds, the rest = the command; logs to $out/$1.log
    local name="$1" limit="$2" started=$SECONDS rc
    shift 2
    timeout --kill-after=5 "$limit" "$@" >"$out/$name.log" 2>&1
    rc=$?
    printf '%-28s rc=%-3s %4ss  %s\n' "$name" "$rc" "$((SECONDS - started))" \
        "$(grep -E 'test result|passed|FAILED|error' "$out/$name.log" | tail -n 1 | cut -c1-90)"
}

want() { [[ ",$steps," == *",$1,"* ]]; }

if want host; then
    run host-nvidia-smi 20 nvidia-smi
    run host-probe 30 "$bin/rdzv" rdma probe
    run host-torch 60 "$python" -c 'import torch; print(torch.__version__, torch.cuda.is_available())'
    nproc >"$out/host-nproc.log"
fi
if want cuda; then
    export RDZV_REQUIRE_CUDA=1
    [ -x "$bin/rdzv_rdma_lib" ] && run cuda-rdma-lib 90 "$bin/rdzv_rdma_lib" cuda:: --test-threads=1
    [ -x "$bin/cuda_agent" ] && run cuda-agent 240 "$bin/cuda_agent" --nocapture --test-threads=1
    [ -x "$bin/rpc_cuda" ] && run cuda-rpc-stand-in 60 "$bin/rpc_cuda" --test-threads=1
    unset RDZV_REQUIRE_CUDA
fi
if want rpc; then
    run rpc-cuda 150 "$bin/rdzv" bench rpc --transport shm --channel cuda_ipc,cuda_basic \
        --device cuda:0 --big-iters 10
    run rpc-cpu 60 "$bin/rdzv" bench rpc --transport tcp,shm --sizes 0,1M,64M --big-iters 10
fi
if want store; then
    sysctl -qw net.core.somaxconn=65535 2>/dev/null || true
    run store-vs-pytorch 240 env PYTHON="$python" "$python" benches/compare_pytorch.py \
        --rdzv "$bin/rdzv" --rounds 3 --secs 2 --conns 1,64,512,2048 \
        --storm-ranks 4096,16384 --our-storm-ranks 16384 --json-out "$out/store.jsonl"
fi
echo "done $(date -u +%H:%M:%S); logs: $(ls "$out" | tr '\n' ' ')"
