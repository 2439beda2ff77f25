"""Mixtral: LLaMA's attention, norms and layer flow with a sparse MoE block (experts split over the TP ranks)
in place of the dense MLP."""
from __future__ import annotations

from torch import nn

from pagedserve.worker.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagedserve.worker.layers.layernorm import RMSNorm
from pagedserve.worker.layers.moe import SparseMoeBlock, is_foreign_expert
from pagedserve.worker.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from pagedserve.worker.models.utils import load_params


class MixtralDecoderLayer(LlamaDecoderLayer):
    """LLaMA's decoder layer (its forward) built from :meth:`make_attention` and :meth:`make_mlp`."""

    def __init__(self, config, layer_idx: int) -> None:
        nn.Module.__init__(self)
        self.self_attn = self.make_attention(config)
        self.mlp = self.make_mlp(config, layer_idx)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def make_attention(self, config) -> nn.Module:
        return LlamaAttention(config, qkv_bias=False, o_bias=False)

    def make_mlp(self, config, layer_idx: int) -> nn.Module:
        if getattr(config, "hidden_act", "silu") not in ("silu", "swish"):
            raise ValueError(f"unsupported hidden_act {config.hidden_act!r} for Mixtral (silu only)")
        return SparseMoeBlock(config.hidden_size, config.intermediate_size, config.num_local_experts,
                              config.num_experts_per_tok, renormalize=True)


class MixtralModel(LlamaModel):
    """LLaMA's model (its forward) over ``layer_cls`` layers."""

    layer_cls = MixtralDecoderLayer

    def __init__(self, config) -> None:
        nn.Module.__init__(self)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(self.layer_cls(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.cpu_layers = None  # the one-call C++ layer refuses MoE layers (worker/cpu/decoder_layer.py)


class MixtralForCausalLM(LlamaForCausalLM):
    model_cls = MixtralModel
    # an expert's matrices: checkpoint name -> ours before stacking (gate and up then fuse as in LLaMA)
    expert_names = {".w1.": ".gate_proj.", ".w3.": ".up_proj.", ".w2.": ".down_proj."}

    def __init__(self, config) -> None:
        nn.Module.__init__(self)
        self.model = self.model_cls(config)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.tie_to(self.model.embed_tokens)

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
