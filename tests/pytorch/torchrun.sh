#!/usr/bin/env bash
# torchrun through `rdzv store serve`: two torchrun "nodes" of two workers each on this
# host, with the c10d rendezvous backend on rdzv's store (`--rdzv-conf=is_host=false`),
# a gloo all_reduce in every worker; then the same with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1.
# A third mode, `restart` (`RESTART=1`, or `RESTART=only` for it alone), makes the last
# rank exit in attempt 0 under `--max-restarts=1`: its agent restarts its workers and
# re-rendezvouses, the other agent sees it on the wait list and restarts its own (a
# membership change, not counted as a retry), and all four ranks must finish in round 1.
# It runs with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, because torchrun's default (2.4+,
# checked in 2.15's dynamic_rendezvous.py) cannot restart reliably, with rdzv's store or
# PyTorch's own: node rank 0's agent creates the workers' TCPStore once and hands the
# same one to every attempt, and the workers no longer prefix it by attempt
# (rendezvous.py: "We create a new TCPStore for every retry", which the shared store
# does not do). Gloo's keys (`/default_pg/0//cpu//0/RANK`, each rank's address) from
# attempt 0 are still there in attempt 1, so whichever ranks start first read the dead
# ranks' addresses: connectFullMesh fails ("Connection refused"), or some ranks get
# through init while others wait on a dead address and all_reduce times out (seen
# here: ranks 2-3 "Timed out waiting 60000ms", ranks 0-1 stuck until killed). After
# the failing node's last restart its launcher closes the rendezvous, so the other
# agent, if it re-rendezvouses, raises RendezvousClosedError (the failure seen on
# 2026-11-25). Which happens depends on which node's workers start first. PyTorch
# issues #135712 and #167288 report the same with NCCL; `stale_worker_store.py` shows
# it without torchrun or rdzv. With the share disabled, worker rank 0 hosts a new
# TCPStore in every round, on a port its agent publishes under the round's prefix, so
# no attempt sees another's keys.
# Every store request goes through store_trace_proxy.py, and the operations and key
# shapes each mode sent are printed. Needs a Python with torch (PYTHON=...); never in CI.
# Usage: PYTHON=... RDZV=target/release/rdzv [RESTART=1|only] [KEEP=1 (keep the logs)] \
#   tests/pytorch/torchrun.sh
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
PYTHON="${PYTHON:-python3}"
RDZV="${RDZV:-$here/../../target/release/rdzv}"
if ! "$PYTHON" -c "import torch" 2>/dev/null; then
    echo "skipped: $PYTHON cannot import torch"
    exit 0
fi
TORCHRUN="$(dirname "$PYTHON")/torchrun"
work="$(mktemp -d)"; [ -n "${KEEP:-}" ] && echo "logs in $work"
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; [ -n "${KEEP:-}" ] || rm -rf "$work"; }
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
    if [ "$name" = restart ]; then
        # The restart must really have happened: rank 3 failed in attempt 0 and
        # finished in attempt 1 (its node's restart count), in a world of four.
        grep -q 'rank 3: failing on purpose in attempt 0' "$work/$name".node*.log || ok=0
        grep -q 'OK rank=3 world=4 attempt=1' "$work/$name".node*.log || ok=0
    fi
    if [ $ok = 1 ] && [ "$done_ranks" = 4 ]; then passed=$((passed + 1)); else
        tail -n 30 "$work/$name".node*.log; fi
}

modes=0
if [ "${RESTART:-0}" != only ]; then
    run_mode shared
    run_mode not_shared TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
    modes=2
fi
if [ "${RESTART:-0}" != 0 ]; then
    run_mode restart TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 FAIL_ONCE=1
    modes=$((modes + 1))
fi
echo "torchrun through rdzv: $passed passed, $((modes - passed)) failed"
[ "$passed" = "$modes" ]
