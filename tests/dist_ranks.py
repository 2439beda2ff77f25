"""What each process of a torch.distributed test runs: ``torch.multiprocessing.spawn`` pickles the function by its
module's name, which a test module (imported by pytest under the checkout's directory name) does not have."""
from __future__ import annotations

import torch
import torch.distributed as dist

from pagedserve.worker.parallel_state import LastDimGather, all_gather_last_dim, init_tensor_parallel


def _rank_rows(rank: int, rows: int, step: int) -> torch.Tensor:
    return torch.arange(rows * 5, dtype=torch.float32).view(rows, 5) + 1000 * rank + 100 * step


def check_last_dim_gather(rank: int, world: int, port: int) -> None:
    """Up to max_rows rows the result lands in the kept buffer, beyond in a new tensor; the values are every
    rank's rows side by side, as ``all_gather_last_dim``'s."""
    init_tensor_parallel(rank, world, f"tcp://127.0.0.1:{port}", "gloo")
    try:
        gather = LastDimGather(max_rows=8)
        kept = None
        for step, rows in enumerate((3, 8, 1, 9)):
            x = _rank_rows(rank, rows, step)
            got = gather(x)
            want = torch.cat([_rank_rows(r, rows, step) for r in range(world)], dim=-1)
            assert torch.equal(got, want), (rank, rows)
            assert torch.equal(got, all_gather_last_dim(x))
            if rows <= 8:
                kept = kept or got.data_ptr()
                assert got.data_ptr() == kept, "up to max_rows rows, the result lands in the kept buffer"
            else:
                assert got.data_ptr() != kept
    finally:
        dist.destroy_process_group()
