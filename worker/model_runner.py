"""Turns a ``SchedulerOutput`` into one packed, unpadded forward pass plus sampling."""
from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np
import torch

from pagedserve.common.config import EngineConfig
from pagedserve.common.outputs import TokenLogprobs
from pagedserve.common.sampling_params import SamplingParams
from pagedserve.kernels.select import kv_cache_dtype, select_backend
from pagedserve.scheduler.output import ModelRunnerOutput, SchedulerOutput
from pagedserve.worker.cpu import prepare_model, zeros_huge_pages
from pagedserve.worker.forward_context import AttentionMetadata, ForwardContext, set_forward_context
from pagedserve.worker.layers.attention import Attention
from pagedserve.worker.layers.embedding import take_rows
from pagedserve.worker.layers.moe import pack_moe_blocks
from pagedserve.worker.models.loader import load_model
from pagedserve.worker.sampler import SamplingMetadata, sample


@dataclass
class SeqState:
    """What a worker remembers about a sequence between steps."""

    token_ids: list[int]
    prompt_len: int
    block_ids: list[int]
    params: SamplingParams
    seed: int
    need_prompt_logprobs: bool
    plain_greedy: bool = field(init=False)  # argmax of the raw logits is all its sampling needs

    def __post_init__(self) -> None:
        p = self.params
        # (greedy implies best_of == 1, so no completions are ranked by logprob)
        self.plain_greedy = p.is_greedy and p.logprobs is None and p.min_tokens == 0 and not p.has_penalties


@dataclass
class SampleRow:
    """One sampling row: a sequence's next token, or, speculating, the token after its first ``len(drafts)``
    drafts; a best_of request's forked completions get rows of their own from the same logits."""

    seq_id: int
    state: SeqState
    seed: int
    drafts: list[int]
    mask_row: int  # row of the grammar bitmask; -1: unconstrained

    @property
    def num_output_tokens(self) -> int:
        return len(self.state.token_ids) - self.state.prompt_len + len(self.drafts)


@dataclass
class StepInputs:
    seq_ids: list[int]
    input_ids: torch.Tensor
    positions: torch.Tensor
    attn: AttentionMetadata
    logits_seqs: list[tuple[int, int]]  # (seq_id, drafts before it) per row of logits_indices
    logits_indices: torch.Tensor  # token index whose logits each sampling position reads
    prompt_chunks: list[tuple[int, int, int, int]]  # (seq_id, first token index, start pos, length)


class ModelRunner:
    def __init__(self, config: EngineConfig, device: torch.device) -> None:
        self.config = config
        self.device = device
        self.block_size = config.cache_config.block_size
        self.model = load_model(config.model_config, device)
        self.backend = select_backend(config.attention_backend, device, config.model_config.dtype)
        pack_moe_blocks(self.model, self.backend)  # before prepare_model packs the remaining linears
        prepare_model(self.model, self.backend)
        self.attn_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        self.states: dict[int, SeqState] = {}
        self.k_caches: list[torch.Tensor] = []
        self.v_caches: list[torch.Tensor] = []
        self.cpu_k_caches: list[torch.Tensor] = []  # swap space
        self.cpu_v_caches: list[torch.Tensor] = []
        self.vocab_size = config.model_config.vocab_size

    # ---- KV cache ----------------------------------------------------------------------------
    @property
    def kv_cache_dtype(self) -> torch.dtype:
        return kv_cache_dtype(self.config.cache_config.cache_dtype, self.config.model_config.dtype)

    def kv_bytes_per_block(self) -> int:
        a = self.attn_layers[0]
        return 2 * len(self.attn_layers) * self.block_size * a.num_kv_heads * a.head_size * self.kv_cache_dtype.itemsize

    def init_kv_cache(self, num_blocks: int, num_cpu_blocks: int = 0) -> None:
        dtype = self.kv_cache_dtype
        self.k_caches, self.v_caches, self.cpu_k_caches, self.cpu_v_caches = [], [], [], []
        pin = self.device.type == "cuda"
        for layer in self.attn_layers:
            shape = (num_blocks, self.block_size, layer.num_kv_heads, layer.head_size)
            if self.device.type == "cpu":
                layer.k_cache, layer.v_cache = zeros_huge_pages(shape, dtype), zeros_huge_pages(shape, dtype)
            else:
                layer.k_cache = torch.zeros(shape, dtype=dtype, device=self.device)
                layer.v_cache = torch.zeros(shape, dtype=dtype, device=self.device)
            self.k_caches.append(layer.k_cache)
            self.v_caches.append(layer.v_cache)
            cpu_shape = (num_cpu_blocks, *shape[1:])
            # Swap space is only read where it was written: leave it untouched until used.
            self.cpu_k_caches.append(torch.empty(cpu_shape, dtype=dtype, pin_memory=pin))
            self.cpu_v_caches.append(torch.empty(cpu_shape, dtype=dtype, pin_memory=pin))

    def _move_blocks(self, sched: SchedulerOutput) -> None:
        """Swap out, then swap in, then copy-on-write: all before this step's forward writes."""
        for pairs, src, dst in ((sched.blocks_to_swap_out, (self.k_caches, self.v_caches),
                                 (self.cpu_k_caches, self.cpu_v_caches)),
                                (sched.blocks_to_swap_in, (self.cpu_k_caches, self.cpu_v_caches),
                                 (self.k_caches, self.v_caches))):
            if pairs:
                mapping = torch.tensor(pairs, dtype=torch.long)
                for s_caches, d_caches in zip(src, dst):
                    for s_cache, d_cache in zip(s_caches, d_caches):
                        self.backend.swap_blocks(s_cache, d_cache, mapping)
        if sched.blocks_to_copy:
            self.backend.copy_blocks(self.k_caches, self.v_caches,
                                     torch.tensor(sched.blocks_to_copy, dtype=torch.long, device=self.device))

    # ---- per-step state ----------------------------------------------------------------------
    def _update_states(self, sched: SchedulerOutput) -> dict[int, int]:
        for seq_id in sched.finished_seq_ids:
            self.states.pop(seq_id, None)
        starts: dict[int, int] = {}
        for d in sched.scheduled_new_seqs:
            self.states[d.seq_id] = SeqState(list(d.token_ids), d.prompt_len, list(d.block_ids),
                                             d.sampling_params, d.seed, d.need_prompt_logprobs)
            starts[d.seq_id] = d.num_computed_tokens
        for d in sched.scheduled_cached_seqs:
            st = self.states[d.seq_id]
            st.token_ids.extend(d.new_token_ids)
            del st.block_ids[d.num_kept_blocks:]
            st.block_ids.extend(d.new_block_ids)
            starts[d.seq_id] = d.num_computed_tokens
        return starts

    def prepare_inputs(self, sched: SchedulerOutput) -> StepInputs:
        starts = self._update_states(sched)
        seq_ids = list(starts)
        n = len(seq_ids)
        input_ids: list[int] = []
        query_lens = np.empty(n, dtype=np.int64)
        seq_lens = np.empty(n, dtype=np.int64)
        logits_seqs: list[tuple[int, int]] = []
        logits_idx: list[int] = []
        prompt_chunks: list[tuple[int, int, int, int]] = []
        max_blocks = 0
        for i, seq_id in enumerate(seq_ids):
            st = self.states[seq_id]
            start, q = starts[seq_id], sched.num_scheduled_tokens[seq_id]
            end = start + q
            input_ids.extend(st.token_ids[start:end])
            drafts = sched.spec_token_ids.get(seq_id, ())
            if drafts:  # run after the last token; not part of the state until the scheduler keeps them
                input_ids.extend(drafts[: max(0, end - len(st.token_ids))])
            query_lens[i], seq_lens[i] = q, end
            if end == len(st.token_ids) + len(drafts):
                for j in range(len(drafts) + 1):
                    logits_seqs.append((seq_id, j))
                    logits_idx.append(len(input_ids) - 1 - len(drafts) + j)
            if st.need_prompt_logprobs and start < st.prompt_len - 1:
                prompt_chunks.append((seq_id, len(input_ids) - q, start, min(end, st.prompt_len - 1) - start))
            max_blocks = max(max_blocks, len(st.block_ids))
        block_tables = np.zeros((n, max_blocks), dtype=np.int32)
        for i, seq_id in enumerate(seq_ids):
            ids = self.states[seq_id].block_ids
            block_tables[i, : len(ids)] = ids
        cu = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(query_lens, out=cu[1:])
        row = np.repeat(np.arange(n), query_lens)
        positions = np.arange(len(input_ids)) - cu[row] + (seq_lens - query_lens)[row]
        slots = block_tables[row, positions // self.block_size].astype(np.int64) * self.block_size \
            + positions % self.block_size
        dev = self.device
        attn = AttentionMetadata(
            slot_mapping=torch.from_numpy(slots).to(dev),
            block_tables=torch.from_numpy(block_tables).to(dev),
            query_start_loc=torch.from_numpy(cu.astype(np.int32)).to(dev),
            seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(dev))
        return StepInputs(seq_ids, torch.tensor(input_ids, dtype=torch.long, device=dev),
                          torch.from_numpy(positions).to(dev), attn, logits_seqs,
                          torch.tensor(logits_idx, dtype=torch.long, device=dev), prompt_chunks)

    def _sampling_metadata(self, rows: list[SampleRow], sched: SchedulerOutput) -> SamplingMetadata:
        dev = self.device
        if not sched.grammar_rows and all(r.state.plain_greedy for r in rows):
            # Greedy sampling reads no per-row setting: skip the per-row columns.
            zeros = torch.zeros(len(rows), dtype=torch.long, device=dev)
            return SamplingMetadata(temperature=torch.zeros(len(rows), device=dev), all_greedy=True, top_k=None,
                                    top_p=None, min_p=None, seeds=zeros, counters=zeros)
        params = [r.state.params for r in rows]
        temps = [0.0 if p.is_greedy else p.temperature for p in params]
        vocab = self.vocab_size

        def col(values, dtype, unused) -> torch.Tensor | None:
            if all(v == unused for v in values):
                return None
            return torch.tensor(values, dtype=dtype, device=dev)

        md = SamplingMetadata(
            temperature=torch.tensor(temps, dtype=torch.float32, device=dev),
            all_greedy=all(t == 0.0 for t in temps),
            top_k=col([p.top_k if p.top_k > 0 else vocab for p in params], torch.long, vocab),
            top_p=col([p.top_p for p in params], torch.float32, 1.0),
            min_p=col([p.min_p for p in params], torch.float32, 0.0),
            seeds=torch.tensor([r.seed for r in rows], dtype=torch.long),
            counters=torch.tensor([r.num_output_tokens for r in rows], dtype=torch.long),
            max_num_logprobs=max((p.logprobs for p in params if p.logprobs is not None), default=-1))
        if md.max_num_logprobs < 0 and any(p.best_of > p.n for p in params):
            md.max_num_logprobs = 0  # best_of ranks completions by cumulative logprob
        if md.max_num_logprobs >= 0:  # cumulative logprobs are reported only for these rows' requests
            wanted = [i for i, p in enumerate(params) if p.logprobs is not None or p.best_of > p.n]
            if len(wanted) < len(params):
                md.logprob_rows = torch.tensor(wanted, dtype=torch.long, device=dev)
        if any(p.has_penalties for p in params):
            md.repetition_penalty = torch.tensor([p.repetition_penalty for p in params], device=dev)
            md.presence_penalty = torch.tensor([p.presence_penalty for p in params], device=dev)
            md.frequency_penalty = torch.tensor([p.frequency_penalty for p in params], device=dev)
            md.prompt_tokens = _pad([r.state.token_ids[: r.state.prompt_len] for r in rows], dev)
            md.output_tokens = _pad([r.state.token_ids[r.state.prompt_len:] + r.drafts for r in rows], dev)
        masked = [i for i, r in enumerate(rows) if r.mask_row >= 0]
        if masked:
            bitmask = sched.grammar_bitmask
            if isinstance(bitmask, Future):
                bitmask = bitmask.result()
            words = torch.from_numpy(bitmask[[rows[i].mask_row for i in masked]])
            md.token_bitmask = (torch.tensor(masked, device=dev), words.to(dev))
        banned_rows, toks = [], []
        for i, r in enumerate(rows):
            p = r.state.params
            if r.num_output_tokens < p.min_tokens:
                stops = set(p.stop_token_ids) | p.all_stop_token_ids
                banned_rows += [i] * len(stops)
                toks += sorted(stops)
        if banned_rows:
            md.banned = (torch.tensor(banned_rows, device=dev), torch.tensor(toks, device=dev))
        return md

    # ---- the step ----------------------------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        self._move_blocks(sched)
        if sched.is_empty:
            self._update_states(sched)
            return ModelRunnerOutput([], [])
        t0 = time.perf_counter()
        inp = self.prepare_inputs(sched)
        with set_forward_context(ForwardContext(self.backend, inp.attn)):
            return self._forward_and_sample(sched, inp, t0)

    def _forward_and_sample(self, sched: SchedulerOutput, inp: StepInputs, t0: float) -> ModelRunnerOutput:
        t1 = time.perf_counter()
        hidden = self.model(inp.input_ids, inp.positions)
        out = ModelRunnerOutput([seq_id for seq_id, _ in inp.logits_seqs], [])
        if inp.prompt_chunks:
            out.prompt_logprobs = self._prompt_logprobs(hidden, inp)
        if inp.logits_seqs:
            logits = self.model.compute_logits(take_rows(hidden, inp.logits_indices))
        self._sync()
        t2 = time.perf_counter()
        out.timings = {"prepare": t1 - t0, "forward": t2 - t1, "sample": 0.0}
        if not inp.logits_seqs:
            return out
        rows = self._sample_rows(inp, sched)
        if len(rows) > len(inp.logits_seqs):
            repeat = torch.tensor([1 + len(sched.fork_seeds.get(s, ())) if j == 0 else 1
                                   for s, j in inp.logits_seqs], device=logits.device)
            logits = logits.repeat_interleave(repeat, dim=0)
            out.seq_ids = [r.seq_id for r in rows]
        states = [r.state for r in rows]
        md = self._sampling_metadata(rows, sched)
        res = sample(logits, md)
        out.sampled_token_ids = res.token_ids.tolist()
        out.timings["sample"] = time.perf_counter() - t2
        if res.logprobs is not None:
            out.sampled_logprobs = res.logprobs.tolist()
            ranks = res.ranks.tolist()
            top_ids = res.top_ids.tolist() if res.top_ids is not None else None
            top_lps = res.top_logprobs.tolist() if res.top_logprobs is not None else None
            for i, st in enumerate(states):
                k = st.params.logprobs
                if k is not None:
                    out.logprobs[i] = TokenLogprobs(out.sampled_token_ids[i], out.sampled_logprobs[i], ranks[i],
                                                    top_ids[i][:k] if k else [], top_lps[i][:k] if k else [])
        return out

    def _sample_rows(self, inp: StepInputs, sched: SchedulerOutput) -> list[SampleRow]:
        if not (sched.spec_token_ids or sched.grammar_rows or sched.fork_seeds):  # a row per sequence, as is
            states = self.states
            return [SampleRow(seq_id, states[seq_id], states[seq_id].seed, [], -1) for seq_id, _ in inp.logits_seqs]
        rows = []
        for seq_id, j in inp.logits_seqs:
            st = self.states[seq_id]
            drafts = sched.spec_token_ids.get(seq_id, [])[:j]
            first = sched.grammar_rows.get(seq_id, -1)
            mask_row = first + j if first >= 0 else -1
            # The scheduler's forks get a row each from the same logits (and their parent's grammar row).
            seeds = (st.seed, *sched.fork_seeds.get(seq_id, ())) if j == 0 else (st.seed,)
            rows += [SampleRow(seq_id, st, seed, drafts, mask_row) for seed in seeds]
        return rows

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _prompt_logprobs(self, hidden: torch.Tensor, inp: StepInputs) -> dict[int, list[TokenLogprobs]]:
        result = {}
        for seq_id, first, start, length in inp.prompt_chunks:
            if length <= 0:
                continue
            st = self.states[seq_id]
            logprobs = torch.log_softmax(self.model.compute_logits(hidden[first: first + length]).float(), dim=1)
            targets = torch.tensor(st.token_ids[start + 1: start + 1 + length], device=self.device)
            chosen = logprobs.gather(1, targets.unsqueeze(1))
            ranks = ((logprobs > chosen).sum(dim=1) + 1).tolist()
            k = st.params.prompt_logprobs
            top_lp, top_ids = logprobs.topk(k, dim=1) if k else (None, None)
            result[seq_id] = [
                TokenLogprobs(t, lp, r, top_ids[j].tolist() if k else [], top_lp[j].tolist() if k else [])
                for j, (t, lp, r) in enumerate(zip(targets.tolist(), chosen.squeeze(1).tolist(), ranks))]
        return result


def _pad(lists: list[list[int]], device: torch.device) -> torch.Tensor:
    width = max(1, max(len(x) for x in lists))
    out = torch.full((len(lists), width), -1, dtype=torch.long)
    for i, x in enumerate(lists):
        if x:
            out[i, : len(x)] = torch.tensor(x)
    return out.to(device)
