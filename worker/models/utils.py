from __future__ import annotations

from collections.abc import Callable, Iterable

from torch import nn

from pagedserve.worker.models.weights import default_weight_loader

# (fused parameter name, checkpoint name, shard id)
StackedMapping = list[tuple[str, str, object]]


def load_params(model: nn.Module, weights: Iterable[tuple[str, object]], stacked: StackedMapping = (),
                rename: Callable[[str], str | None] = lambda n: n) -> None:
    """Feed checkpoint tensors to each parameter's ``weight_loader``; fail on anything missing.

    ``rename`` maps a checkpoint name to a parameter name, or None to skip it.
    """
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded: set[str] = set()
    for ckpt_name, weight in weights:
        name = rename(ckpt_name)
        if name is None:
            continue
        for fused, part, shard_id in stacked:
            if f".{part}." in name:
                name = name.replace(f".{part}.", f".{fused}.")
                param = params[name]
                param.weight_loader(param, weight, shard_id)
                break
        else:
            if name not in params:
                raise ValueError(f"unexpected weight {ckpt_name!r} in checkpoint")
            param = params[name]
            getattr(param, "weight_loader", default_weight_loader)(param, weight)
        loaded.add(name)
    loaded_ids = {id(params[n]) for n in loaded}  # a tied parameter counts once loaded under any name
    missing = sorted(n for n, p in params.items() if id(p) not in loaded_ids)
    if missing:
        raise ValueError(f"checkpoint is missing weights: {missing[:8]}{' ...' if len(missing) > 8 else ''}")
