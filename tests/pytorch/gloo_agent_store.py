# 4-rank gloo process group whose store is `rdzv store serve` (agent-store mode).
import os, sys, datetime
import torch, torch.distributed as dist
import torch.multiprocessing as mp
def run(rank, world, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="True",
                      TORCHELASTIC_RESTART_COUNT="0")
    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=30))
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    assert t.item() == sum(range(1, world + 1)), t
    dist.barrier()
    if rank == 0:
        print("gloo all_reduce over rdzv store: OK, sum =", t.item(), flush=True)
    dist.destroy_process_group()
if __name__ == "__main__":
    mp.spawn(run, args=(4, int(sys.argv[1])), nprocs=4)
