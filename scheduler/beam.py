"""Beam search inside the scheduler, with Hugging Face ``generate(num_beams=W)`` semantics.

Every step each live beam returns its top-K next-token logprobs (K = max(2, 1 + #eos) * W, the
worker's ordinary logprobs path). The W best continuations that do not finish become the next
beams: a beam chosen several times forks (sharing its blocks; the shared tail block is copied on
the next write), a beam not chosen is dropped and frees its blocks at once. Continuations that end
(EOS or the length limit) among the top W compete for W finished slots by length-normalised score.
Scores are accumulated in float32, as HF does, so rankings agree.
"""
from __future__ import annotations

import numpy as np

from pagedserve.common.outputs import BeamSearchSequence
from pagedserve.scheduler.request import BeamState, Request, RequestStatus, Sequence

_NEG = np.float32(-1.0e9)


class BeamSearcher:
    def __init__(self, scheduler) -> None:
        self.scheduler = scheduler
        self._touched: dict[str, Request] = {}

    @staticmethod
    def init_state(req: Request, eos_ids: set[int]) -> BeamState:
        bp = req.beam_params
        eos = set() if bp.ignore_eos else set(eos_ids)
        return BeamState(eos, len(req.prompt_token_ids) + bp.max_tokens, max(2, 1 + len(eos)) * bp.beam_width)

    def record(self, req: Request, seq: Sequence, result, row: int) -> None:
        req.beam_state.pending[seq.seq_id] = result.logprobs[row]
        self._touched[req.request_id] = req

    def step_done(self) -> list[Request]:
        touched, self._touched = list(self._touched.values()), {}
        for req in touched:
            st = req.beam_state
            if not req.finished and len(st.pending) == len(req.live_seqs):
                self._advance(req, st)
        return touched

    def _advance(self, req: Request, st: BeamState) -> None:
        bp = req.beam_params
        width = bp.beam_width
        beams = sorted(req.live_seqs, key=lambda s: -s.cumulative_logprob)
        cands: list[tuple[np.float32, int, Sequence]] = []
        for seq in beams:
            top = st.pending[seq.seq_id]
            base = np.float32(seq.cumulative_logprob)
            cands += [(np.float32(lp) + base, t, seq) for t, lp in zip(top.top_ids, top.top_logprobs)]
        st.pending.clear()
        cands.sort(key=lambda c: -c[0])  # stable: ties keep beam order, then the worker's top-k order
        cands = cands[: st.num_candidates]
        cur_len = beams[0].num_tokens
        gen_len = cur_len + 1 - len(req.prompt_token_ids)
        hits = [t in st.eos_ids or cur_len + 1 >= st.max_length for _, t, _ in cands]

        # Finished hypotheses: only continuations ranked among the top W may finish.
        full = len(st.finished) == width
        if st.improvable and not (full and bp.early_stopping is True):
            for (score, tok, parent), hit in list(zip(cands, hits))[:width]:
                if hit:
                    norm = float(score / np.float32(gen_len ** bp.length_penalty))
                    reason = "stop" if tok in st.eos_ids else "length"
                    st.finished.append(BeamSearchSequence(parent.token_ids + [tok], text=None, cum_logprob=float(score),
                                                          score=norm, finish_reason=reason))
            st.finished.sort(key=lambda h: -h.score)
            del st.finished[width:]

        running = sorted(range(len(cands)), key=lambda i: -(cands[i][0] + (_NEG if hits[i] else 0)))[:width]
        best_running = cands[running[0]][0] + (_NEG if hits[running[0]] else 0)
        best_len = (st.max_length - len(req.prompt_token_ids)
                    if bp.early_stopping == "never" and bp.length_penalty > 0 else gen_len)
        worst_finished = st.finished[-1].score if len(st.finished) == width else float(_NEG)
        best_possible = float(best_running / np.float32(best_len ** bp.length_penalty))
        st.improvable = st.improvable and best_possible > worst_finished
        if (not st.improvable or all(hits) or (len(st.finished) == width and bp.early_stopping is True)):
            self._finish(req)
            return
        self._reshape_beams(req, [cands[i] for i in running])

    def _reshape_beams(self, req: Request, chosen: list[tuple[np.float32, int, Sequence]]) -> None:
        sched = self.scheduler
        used: set[int] = set()
        updates: list[tuple[Sequence, int, np.float32]] = []
        for score, tok, parent in chosen:
            if parent.seq_id in used:  # a second continuation of the same beam: fork before appending
                child = parent.fork(sched.next_seq_id(), req.next_seq_index, parent.seed)
                req.next_seq_index += 1
                sched.block_manager.fork(parent, child)
                sched.add_seq(req, child)
                updates.append((child, tok, score))
            else:
                used.add(parent.seq_id)
                updates.append((parent, tok, score))
        for seq, tok, score in updates:
            seq.token_ids.append(tok)
            seq.cumulative_logprob = float(score)
        for seq in list(req.live_seqs):
            if seq.seq_id not in used and all(seq is not s for s, _, _ in updates):
                sched.drop_seq(req, seq)

    def _finish(self, req: Request) -> None:
        req.beam_state.done = True
        sched = self.scheduler
        for seq in req.live_seqs:
            sched.finish_seq(req, seq, RequestStatus.FINISHED_STOPPED)
