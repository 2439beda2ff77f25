"""Tensor parallelism on Ray actors (gloo on CPU): greedy outputs equal HF for every family."""
from __future__ import annotations

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.tests.utils import (
    assert_all_blocks_free,
    assert_greedy_equals_hf,
    hf_greedy,
    load_as_rank,
    load_hf_reference,
    random_prompts,
)


@pytest.mark.parametrize("arch, tp", [("llama-gqa8", 1), ("llama-gqa8", 2), ("llama-gqa8", 4), ("gpt2", 2),
                                      ("gpt_neox", 4), ("opt", 2), ("mistral-swa", 2), ("qwen2-swa", 2)])
def test_tp_greedy_matches_hf(ray_cluster, model_factory, arch, tp):
    model_dir = model_factory(arch)
    llm = LLM(model_dir, tensor_parallel_size=tp, distributed_executor_backend="ray")
    try:
        assert_greedy_equals_hf(llm, model_dir, random_prompts(6, seed=80 + tp), 16)
        assert_all_blocks_free(llm)
    finally:
        llm.shutdown()
    assert not [pg for pg in ray_cluster.util.placement_group_table().values() if pg["state"] == "CREATED"]


def test_unsplittable_config_fails_before_any_actor(ray_cluster, model_factory):
    before = len(ray_cluster.util.placement_group_table())
    with pytest.raises(ValueError, match="num_attention_heads .* not divisible by tensor_parallel_size"):
        LLM(model_factory("llama"), tensor_parallel_size=3)
    with pytest.raises(ValueError, match="num_key_value_heads"):  # 3 KV heads can neither split nor replicate 2 ways
        LLM(model_factory("llama-gqa8", hidden_size=96, num_attention_heads=12, num_key_value_heads=3),
            tensor_parallel_size=2)
    assert len(ray_cluster.util.placement_group_table()) == before


def test_rank_loads_only_its_shard(model_factory, monkeypatch):
    """Rank 1 of 2 holds exactly its rows/columns of each matrix (read through safetensors slices)."""
    model_dir = model_factory("llama-gqa8")
    model, full = load_as_rank(model_dir, monkeypatch, rank=1, tp=2)
    layer = model.model.layers[0]
    qkv = layer.self_attn.qkv_proj.weight
    q, k = full["model.layers.0.self_attn.q_proj.weight"], full["model.layers.0.self_attn.k_proj.weight"]
    assert torch.equal(qkv[:64], q[64:128])  # 4 of 8 heads x 16
    assert torch.equal(qkv[64:80], k[16:32])  # the second of 2 KV heads
    down = layer.mlp.down_proj.weight
    assert down.shape == (64, 64) and torch.equal(down, full["model.layers.0.mlp.down_proj.weight"][:, 64:])
    emb = model.model.embed_tokens.weight  # vocab 331 padded to 2 x 166: rows 166..330, then one zero row
    assert torch.equal(emb[:165], full["model.embed_tokens.weight"][166:]) and not emb[165].any()


def test_worker_death_resumes_in_flight_requests_exactly(ray_cluster, model_factory):
    """A TP worker killed mid-flight: the group is rebuilt and every request starts over from its tokens, ending
    with exactly the tokens it would have had (greedy against HF; seeded sampling and n=2 against an undisturbed
    run of the same requests)."""
    from pagedserve import EngineArgs, LLMEngine

    model_dir = model_factory("llama-gqa8")
    prompts = random_prompts(4, seed=90)
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    seeded = SamplingParams(temperature=1.0, seed=7, n=2, max_tokens=20, ignore_eos=True, logprobs=1)

    def run(kill_after: int | None) -> dict:
        engine = LLMEngine.from_engine_args(EngineArgs(model=model_dir, tensor_parallel_size=2))
        try:
            for i, p in enumerate(prompts):
                engine.add_request(str(i), {"prompt_token_ids": p}, greedy)
            engine.add_request("seeded", {"prompt_token_ids": prompts[0]}, seeded)
            finished, steps = {}, 0
            while engine.has_unfinished_requests():
                if steps == kill_after:
                    ray_cluster.kill(engine.core.executor.workers[1], no_restart=True)
                finished.update({o.request_id: o for o in engine.step() if o.finished})
                steps += 1
                assert steps < 200, "no progress"
            assert engine.core.num_worker_restarts == (0 if kill_after is None else 1)
            assert_all_blocks_free(engine)
            return finished
        finally:
            engine.core.shutdown()

    killed, calm = run(kill_after=3), run(kill_after=None)
    hf = load_hf_reference(model_dir)
    for i, p in enumerate(prompts):
        assert killed[str(i)].outputs[0].finish_reason == "length"
        assert killed[str(i)].outputs[0].token_ids == hf_greedy(model_dir, p, 20, hf)[0]
    assert [c.token_ids for c in killed["seeded"].outputs] == [c.token_ids for c in calm["seeded"].outputs]
    for a, b in zip(killed["seeded"].outputs, calm["seeded"].outputs):
        assert a.cumulative_logprob == pytest.approx(b.cumulative_logprob, abs=1e-4)


def test_compiled_graph_broadcast_matches(ray_cluster, model_factory):
    """The Ray Compiled Graph broadcast (the GPU default) gives the same tokens as plain actor calls."""
    from pagedserve import EngineArgs, LLMEngine
    from pagedserve.engine.executor.ray_executor import RayExecutor

    model_dir = model_factory("llama-gqa8")
    engine = LLMEngine.from_engine_args(EngineArgs(model=model_dir, tensor_parallel_size=2),
                                        lambda cfg: RayExecutor(cfg, use_compiled_graph=True))
    try:
        prompts = random_prompts(3, seed=95)
        for i, p in enumerate(prompts):
            engine.add_request(str(i), {"prompt_token_ids": p}, SamplingParams(temperature=0, max_tokens=8))
        outs = {}
        while engine.has_unfinished_requests():
            outs.update({o.request_id: o for o in engine.step()})
        assert engine.core.executor.dag is not None
        hf = load_hf_reference(model_dir)
        for i, p in enumerate(prompts):
            assert outs[str(i)].outputs[0].token_ids == hf_greedy(model_dir, p, 8, hf)[0]
    finally:
        engine.core.shutdown()
