"""Train a small GPT-2 on several CPU processes (gloo) with a remat plan, under FSDP2 or DDP.

    torchrun --standalone --nproc_per_node=2 examples/distributed_train.py --fsdp
    torchrun --standalone --nproc_per_node=2 examples/distributed_train.py --ddp --budget 0.7

Every rank builds the same weights (seed 0) and trains on its own batch. remat
profiles the model as it is trained (sharded by FSDP2, or inside DDP), rank 0
plans for the per-rank budget, and every rank applies that same plan. Each rank
then reports its measured peak next to the plan's prediction, and the ranks
train for a few steps.
"""

from __future__ import annotations

import argparse
import gc
import os

import torch
import torch.distributed as dist
from torch import nn

import remat
from remat.zoo import build


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--fsdp", action="store_true", help="shard with FSDP2's fully_shard (the default)")
    mode.add_argument("--ddp", action="store_true", help="replicate with DistributedDataParallel")
    parser.add_argument("--budget", default="0.6", help="per-rank peak budget: bytes, '20MiB' or a fraction")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    return parser.parse_args()


def model_and_batch(args: argparse.Namespace, rank: int) -> tuple[nn.Module, dict, list[str]]:
    sizes = {
        "layers": args.layers,
        "hidden": args.hidden,
        "heads": 4,
        "vocab": 1024,
        "seq": args.seq,
        "batch": args.batch,
    }
    zoo = build("gpt2", **sizes, seed=0)  # identical weights on every rank
    ids = torch.randint(0, sizes["vocab"], (args.batch, args.seq), generator=torch.Generator().manual_seed(1 + rank))
    return zoo.model, {"input_ids": ids, "labels": ids.clone()}, list(zoo.blocks)  # each rank its own data


def distribute(model: nn.Module, blocks: list[str], fsdp: bool) -> nn.Module:
    if not fsdp:
        return nn.parallel.DistributedDataParallel(model)
    from torch.distributed.fsdp import fully_shard

    modules = dict(model.named_modules())
    for name in blocks:  # one FSDP unit per block, so that remat's checkpoints sit inside the units
        fully_shard(modules[name])
    return fully_shard(model)


def report(lines: list[str]) -> None:
    """Print every rank's line from rank 0, in rank order."""
    gathered: list[list[str] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, lines)
    if dist.get_rank() == 0:
        for rank_lines in gathered:
            print("\n".join(rank_lines or []), flush=True)


def main() -> None:
    args = parse_args()
    dist.init_process_group("gloo")
    train(args)
    # FSDP2's modules hold the process group in reference cycles, which only the collector frees: collected
    # here, the group's last reference goes in destroy_process_group and gloo stops its threads there, not
    # while the interpreter is being torn down (where gloo can abort a finished run).
    gc.collect()
    dist.barrier()  # no rank closes its connections while another is still printing or reducing
    dist.destroy_process_group()


def train(args: argparse.Namespace) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))  # ranks share this machine's cores
    torch.manual_seed(rank)  # GPT-2's dropout masks: reproducible runs, --fsdp and --ddp alike
    fsdp = not args.ddp
    model, batch, blocks = model_and_batch(args, rank)
    model = distribute(model, blocks, fsdp)

    # Every rank calls it: FSDP2's profile runs collectives; rank 0 plans and sends the plan.
    plan = remat.distributed.auto(model, batch, args.budget, repeat=1)
    if rank == 0:
        print(f"{'FSDP2' if fsdp else 'DDP'} on {world} ranks. {plan.summary()}", flush=True)
    peak = remat.measure(model, batch, warmup=1, repeat=1).peak_bytes
    report(
        [
            f"rank {rank}: peak {peak / 2**20:.2f} MiB measured, {plan.predicted_peak_bytes / 2**20:.2f} MiB "
            f"predicted, budget {plan.budget_bytes / 2**20:.2f} MiB"
        ]
    )

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(args.steps):
        optimizer.zero_grad(set_to_none=True)
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        loss = loss.detach()
        dist.all_reduce(loss)  # the mean loss over ranks, for printing
        if rank == 0:
            print(f"step {step}: loss {loss.item() / world:.4f}", flush=True)


if __name__ == "__main__":
    main()
