"""Qwen3-MoE: Qwen3 attention (RMSNorm over each q and k head before rope) and, on the layers that
``decoder_sparse_step`` / ``mlp_only_layers`` pick, a sparse MoE block (no shared experts); the other layers keep a
dense SwiGLU MLP."""
from __future__ import annotations

from torch import nn

from pagedserve.worker.layers.moe import SparseMoeBlock
from pagedserve.worker.models.llama import LlamaMLP, LlamaModel
from pagedserve.worker.models.mixtral import MixtralDecoderLayer, MixtralForCausalLM
from pagedserve.worker.models.qwen3 import Qwen3Attention


def is_moe_layer(config, layer_idx: int) -> bool:
    """HF's rule: experts on every ``decoder_sparse_step``-th layer, except those listed in ``mlp_only_layers``."""
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return (layer_idx not in (getattr(config, "mlp_only_layers", None) or [])
            and config.num_experts > 0 and (layer_idx + 1) % step == 0)


class Qwen3MoeDecoderLayer(MixtralDecoderLayer):
    attention_cls = Qwen3Attention

    def make_mlp(self, config, bias: bool, layer_idx: int) -> nn.Module:
        if getattr(config, "hidden_act", "silu") not in ("silu", "swish"):
            raise ValueError(f"unsupported hidden_act {config.hidden_act!r} for Qwen3-MoE (silu only)")
        if not is_moe_layer(config, layer_idx):
            return LlamaMLP(config, bias)
        return SparseMoeBlock(config.hidden_size, config.moe_intermediate_size, config.num_experts,
                              config.num_experts_per_tok, renormalize=bool(config.norm_topk_prob),
                              round_weights=True)


class Qwen3MoeModel(LlamaModel):
    decoder_layer_cls = Qwen3MoeDecoderLayer


class Qwen3MoeForCausalLM(MixtralForCausalLM):
    model_cls = Qwen3MoeModel
    expert_names = {}  # the checkpoint already names them gate_proj / up_proj / down_proj
