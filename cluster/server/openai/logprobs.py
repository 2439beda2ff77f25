"""Engine logprob dicts (token id -> ``Logprob``: the top k plus the chosen token) in the shapes of the HTTP API:
the completions API's parallel lists, the chat API's ``content`` entries, vLLM's ``prompt_logprobs``."""
from __future__ import annotations

from collections.abc import Callable

from pagedserve.cluster.server.openai.chat_protocol import ChatLogprob, ChatLogprobContent
from pagedserve.cluster.server.openai.completion_protocol import CompletionLogProbs
from pagedserve.cluster.server.openai.protocol import LogprobEntry
from pagedserve.common.outputs import Logprob

FLOOR = -9999.0  # JSON has no -inf: a token with zero probability gets this (as in vLLM)


def clamp(lp: float) -> float:
    return lp if lp > FLOOR else FLOOR  # NaN too


def _ranked(entry: dict[int, Logprob]) -> list[tuple[int, Logprob]]:
    return sorted(entry.items(), key=lambda x: x[1].rank if x[1].rank is not None else 0)


class CompletionLogprobsBuilder:
    """Appends to one choice's ``CompletionLogProbs``; ``text_offset`` counts on across streamed chunks."""

    def __init__(self, k: int, decode: Callable[[int], str], offset: int = 0) -> None:
        self.k = k
        self.decode = decode
        self.offset = offset

    def build(self, token_ids: list[int], entries: list[dict[int, Logprob] | None]) -> CompletionLogProbs:
        out = CompletionLogProbs()
        for tok, entry in zip(token_ids, entries):
            if entry is None:  # the first prompt token, which has nothing before it
                text, lp, top = self.decode(tok), None, None
            else:
                chosen = entry[tok]
                text = chosen.decoded_token if chosen.decoded_token is not None else self.decode(tok)
                lp = clamp(chosen.logprob)
                top = {}
                for t, e in _ranked(entry):
                    if t == tok or (e.rank is not None and e.rank <= self.k):
                        key = e.decoded_token if e.decoded_token is not None else self.decode(t)
                        top.setdefault(key, clamp(e.logprob))
            out.tokens.append(text)
            out.token_logprobs.append(lp)
            out.top_logprobs.append(top)
            out.text_offset.append(self.offset)
            self.offset += len(text)
        return out


def chat_logprobs(token_ids: list[int], entries: list[dict[int, Logprob]], k: int,
                  decode: Callable[[int], str]) -> list[ChatLogprobContent]:
    out = []
    for tok, entry in zip(token_ids, entries):
        chosen = entry[tok]
        text = chosen.decoded_token if chosen.decoded_token is not None else decode(tok)
        top = []
        for t, e in _ranked(entry):
            if e.rank is not None and e.rank <= k:
                s = e.decoded_token if e.decoded_token is not None else decode(t)
                top.append(ChatLogprob(token=s, logprob=clamp(e.logprob), bytes=list(s.encode("utf-8", "replace"))))
        out.append(ChatLogprobContent(token=text, logprob=clamp(chosen.logprob),
                                      bytes=list(text.encode("utf-8", "replace")), top_logprobs=top))
    return out


def prompt_logprobs_json(entries: list[dict[int, Logprob] | None]) -> list[dict[str, LogprobEntry] | None]:
    return [None if e is None else {str(t): LogprobEntry(logprob=clamp(lp.logprob), rank=lp.rank,
                                                         decoded_token=lp.decoded_token)
                                    for t, lp in _ranked(e)}
            for e in entries]
