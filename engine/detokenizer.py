"""Incremental detokenization and stop-string matching for one completion.

Text is emitted only once it is stable: a token whose bytes end inside a UTF-8 character (decoding
to U+FFFD) is held back until the character completes, and with stop strings the last
``max_stop_str_len - 1`` characters are held back so a stop string never leaks half-way.
"""
from __future__ import annotations

from pagedserve.common.sampling_params import SamplingParams

_CONTEXT_TOKENS = 5  # prompt tokens decoded alongside, so leading-space rules see real context


def rust_backend(tokenizer):
    """The ``tokenizers.Tokenizer`` behind a fast HF tokenizer when decoding with it directly gives the same text,
    else None. Streaming decodes twice per generated token, and transformers' ``decode`` spends ~4x the Rust
    decode's time converting arguments (``to_py_obj``)."""
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # another transformers layout: keep its decode
        return None
    cls = type(tokenizer)
    if (isinstance(tokenizer, TokenizersBackend) and cls.decode is PreTrainedTokenizerBase.decode
            and cls._decode is TokenizersBackend._decode and not tokenizer.clean_up_tokenization_spaces):
        return tokenizer._tokenizer
    return None


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.backend = rust_backend(tokenizer)
        self.params = params
        self.ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        if self._decode(self.ids).endswith("\ufffd"):
            # The prompt ends inside a UTF-8 character: its bytes would merge with the first output token's
            # and shift the text; decode the output on its own, as a one-shot decode would.
            self.ids = []
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""
        self.num_sent_chars = 0  # of self.text, already handed out as deltas
        self.num_output_tokens = 0
        self.stop_reason: str | None = None

    def _decode(self, ids: list[int]) -> str:
        if self.backend is not None:
            return self.backend.decode(ids, skip_special_tokens=self.params.skip_special_tokens)
        return self.tokenizer.decode(ids, skip_special_tokens=self.params.skip_special_tokens,
                                     spaces_between_special_tokens=self.params.spaces_between_special_tokens)

    def add_tokens(self, token_ids: list[int]) -> bool:
        """Append tokens; True once a stop string matched (text is then truncated)."""
        for t in token_ids:
            self.ids.append(t)
            self.num_output_tokens += 1
            prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
            full = self._decode(self.ids[self.prefix_offset:])
            if len(full) > len(prefix) and not full.endswith("\ufffd"):
                delta = full[len(prefix):]
                self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
                self.text += delta
                if self._check_stop(len(delta)):
                    return True
        return False

    def _check_stop(self, delta_len: int) -> bool:
        p = self.params
        if not p.stop or self.num_output_tokens < p.min_tokens:
            return False
        start = max(0, len(self.text) - delta_len - p.max_stop_str_len + 1)
        for s in p.stop:
            idx = self.text.find(s, start)
            if idx != -1:
                self.stop_reason = s
                self.text = self.text[: idx + (len(s) if p.include_stop_str_in_output else 0)]
                return True
        return False

    def flush(self) -> None:
        """At the end, emit whatever was held back waiting for more bytes."""
        rest = self._decode(self.ids[self.prefix_offset:])
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        if len(rest) > len(prefix):
            self.text += rest[len(prefix):]
            self.read_offset = len(self.ids)

    def take_delta(self, finished: bool) -> str:
        hold = 0 if finished or self.stop_reason else max(self.params.max_stop_str_len - 1, 0)
        end = max(self.num_sent_chars, len(self.text) - hold)
        delta = self.text[self.num_sent_chars:end]
        self.num_sent_chars = end
        return delta
