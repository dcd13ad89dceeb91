# A torchrun worker: gloo all_reduce and a barrier through the store torchrun gives it.
# With FAIL_ONCE=1 the last rank exits in attempt 0, so that the job restarts.
import os, sys, datetime
import torch, torch.distributed as dist
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
rank = int(os.environ["RANK"]); world = int(os.environ["WORLD_SIZE"])
if os.environ.get("FAIL_ONCE") == "1" and attempt == 0 and rank == world - 1:
    print(f"rank {rank}: failing on purpose in attempt {attempt}", flush=True)
    os._exit(3)
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
t = torch.tensor([rank + 1.0]); dist.all_reduce(t)
assert t.item() == world * (world + 1) / 2, t
dist.barrier()
print(f"OK rank={rank} world={world} attempt={attempt} sum={t.item()} master={os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']} agent_store={os.environ.get('TORCHELASTIC_USE_AGENT_STORE')}", flush=True)
dist.destroy_process_group()
