#!/usr/bin/env bash
# torchrun through `rdzv store serve`: two torchrun "nodes" of two workers each on this
# host, with the c10d rendezvous backend on rdzv's store (`--rdzv-conf=is_host=false`),
# a gloo all_reduce in every worker; then the same with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1.
# (A third mode, `restart`, makes the last rank fail in attempt 0 under `--max-restarts=1`.
# It depends on timing inside torchrun, with PyTorch's own c10d store as with rdzv's, so
# it is not run by default: `RESTART=1` runs it. On the 2-core development machine
# (2026-11-25, PyTorch 2.15) one run passed, node 1's workers restarted as attempt 1 and
# joined node 0's attempt-0 workers in their all_reduce, since 2.4+ no longer prefixes
# the agent store by attempt; the run before failed with node 0's agent raising
# RendezvousClosedError while re-rendezvousing, after node 1's restarted workers failed.)
# Every store request goes through store_trace_proxy.py, and the operations and key
# shapes each mode sent are printed. Needs a Python with torch (PYTHON=...); never in CI.
# Usage: PYTHON=... RDZV=target/release/rdzv tests/pytorch/torchrun.sh
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
PYTHON="${PYTHON:-python3}"
RDZV="${RDZV:-$here/../../target/release/rdzv}"
if ! "$PYTHON" -c "import torch" 2>/dev/null; then
    echo "skipped: $PYTHON cannot import torch"
    exit 0
fi
TORCHRUN="$(dirname "$PYTHON")/torchrun"
work="$(mktemp -d)"
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; rm -rf "$work"; }
trap cleanup EXIT
free_port() { "$PYTHON" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

passed=0
run_mode() {
    local name="$1"; shift
    local port proxy log
    port=$(free_port); proxy=$(free_port); log="$work/$name.trace"
    "$RDZV" store serve --host 127.0.0.1 --port "$port" >/dev/null 2>&1 & pids+=($!)
    "$PYTHON" "$here/store_trace_proxy.py" "$proxy" "127.0.0.1:$port" "$log" >/dev/null & pids+=($!)
    sleep 0.7
    local nodes=()
    for n in 0 1; do
        env "$@" timeout 180 "$TORCHRUN" --nnodes=2 --nproc-per-node=2 --rdzv-backend=c10d \
            --rdzv-endpoint="127.0.0.1:$proxy" --rdzv-conf=is_host=false --rdzv-id="$name" \
            --max-restarts=1 "$here/torchrun_worker.py" >"$work/$name.node$n.log" 2>&1 &
        nodes+=($!)
    done
    local ok=1
    for p in "${nodes[@]}"; do wait "$p" || ok=0; done
    local done_ranks
    touch "$work/$name.node0.log" "$work/$name.node1.log"
    # Two workers share a log file, so a line may hold two reports: count them by rank.
    done_ranks=$({ grep -ho 'OK rank=[0-9]* world=4 attempt=[0-9]*' "$work/$name".node*.log || true; } | sort -u | wc -l)
    echo "== $name: torchrun exit $([ $ok = 1 ] && echo 0 || echo 'non-zero'), $done_ranks of 4 ranks finished"
    grep -ho 'OK rank=[0-9]* world=4 attempt=[0-9]* sum=[0-9.]* master=[^ ]* agent_store=[A-Za-z]*\|rank [0-9]*: failing on purpose.*' \
        "$work/$name".node*.log | sort | sed 's/^/   /' || true
    echo "   store operations (count, query, key shape):"
    sed -E 's/^[0-9]+ //; s/[0-9]+/N/g' "$log" | sort | uniq -c | sort -rn | sed 's/^/   /'
    if [ $ok = 1 ] && [ "$done_ranks" = 4 ]; then passed=$((passed + 1)); else
        tail -n 30 "$work/$name".node*.log; fi
}

run_mode shared
run_mode not_shared TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
modes=2
if [ "${RESTART:-0}" = 1 ]; then run_mode restart FAIL_ONCE=1; modes=3; fi
echo "torchrun through rdzv: $passed passed, $((modes - passed)) failed"
[ "$passed" = "$modes" ]
