# Agent-store mode in PyTorch: torch.distributed.rendezvous("env://") with
# TORCHELASTIC_USE_AGENT_STORE=True and TORCHELASTIC_RESTART_COUNT=N wraps its TCPStore
# client in PrefixStore("/worker/attempt_N"). Writes "from_torch" through that store and
# reads "from_rdzv", which run.sh sets with rdzv's client under the prefix, so that both
# sides are shown to compose keys the same way. argv: port, attempt.
import os, sys
import torch.distributed as dist
port, attempt = sys.argv[1], sys.argv[2]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK="0", WORLD_SIZE="1",
                  TORCHELASTIC_USE_AGENT_STORE="True", TORCHELASTIC_RESTART_COUNT=attempt)
store, rank, world = next(dist.rendezvous("env://"))
store.set("from_torch", "t")
assert store.get("from_rdzv") == b"r", "rdzv's key not under the prefix"
del os.environ["TORCHELASTIC_RESTART_COUNT"]
try:
    next(dist.rendezvous("env://")); raise SystemExit("expected KeyError")
except KeyError as e:
    assert "TORCHELASTIC_RESTART_COUNT" in str(e), e
print("agent-store prefix: OK", flush=True)
