"""The LM head's gather across TP ranks, on real torch.distributed (gloo, two processes)."""
from __future__ import annotations

import torch.multiprocessing as mp

from pagedserve.tests.dist_ranks import check_last_dim_gather
from pagedserve.tests.server_thread import free_port


def test_last_dim_gather_reuses_its_buffers_across_ranks():
    mp.spawn(check_last_dim_gather, args=(2, free_port()), nprocs=2, join=True)
