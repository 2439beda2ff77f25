"""Mixtral: LLaMA's attention, norms and layer flow with a sparse MoE block (experts split over the TP ranks)
in place of the dense MLP."""
from __future__ import annotations

from torch import nn

from pagedserve.worker.layers.moe import SparseMoeBlock, is_foreign_expert
from pagedserve.worker.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from pagedserve.worker.models.utils import load_params


class MixtralDecoderLayer(LlamaDecoderLayer):
    def make_mlp(self, config, bias: bool, layer_idx: int) -> nn.Module:
        if getattr(config, "hidden_act", "silu") not in ("silu", "swish"):
            raise ValueError(f"unsupported hidden_act {config.hidden_act!r} for Mixtral (silu only)")
        return SparseMoeBlock(config.hidden_size, config.intermediate_size, config.num_local_experts,
                              config.num_experts_per_tok, renormalize=True)


class MixtralModel(LlamaModel):
    decoder_layer_cls = MixtralDecoderLayer  # the one-call C++ layer refuses MoE layers (worker/cpu/decoder_layer.py)


class MixtralForCausalLM(LlamaForCausalLM):
    model_cls = MixtralModel
    # an expert's matrices: checkpoint name -> ours before stacking (gate and up then fuse as in LLaMA)
    expert_names = {".w1.": ".gate_proj.", ".w3.": ".up_proj.", ".w2.": ".down_proj."}

    def checkpoint_name(self, name: str) -> str:
        name = name.replace(".block_sparse_moe.", ".mlp.")
        for theirs, ours in self.expert_names.items():
            name = name.replace(theirs, ours)
        return name

    def load_weights(self, weights) -> None:
        def rename(name: str) -> str | None:
            if "rotary_emb.inv_freq" in name or (self.tie_word_embeddings and name == "lm_head.weight"):
                return None
            name = self.checkpoint_name(name)
            return None if is_foreign_expert(self, name) else name

        load_params(self, weights, self.stacked_params, rename)
