"""Two ranks reduce metrics; rank 1 holds one metric more. reduce_metrics must refuse, naming it, on both ranks."""

from __future__ import annotations


import torch

from fsdptrain.metrics.typed import Mean, Metrics, Sum
from fsdptrain.distributed.collectives import reduce_metrics
from tests.dist.workers.report import dist_worker


@dist_worker()
def main(args, info, record: dict) -> None:
    metrics = {"reward/mean": Mean(torch.tensor(1.0), torch.tensor(2.0)), "batch/num_seqs": Sum(torch.tensor(3.0))}
    if info.rank == 1:
        metrics["actor/extra"] = Mean(torch.tensor(5.0), torch.tensor(1.0))
    same = reduce_metrics(Metrics({k: v for k, v in metrics.items() if k != "actor/extra"}))  # agreeing ranks
    try:
        reduce_metrics(Metrics(metrics))
        error = None
    except RuntimeError as err:
        error = str(err)
    record.update({"error": error, "same_sum": same["batch/num_seqs"].value()})


if __name__ == "__main__":
    main()
