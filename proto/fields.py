"""What both ends of the wire agree on besides the messages: how ``pb.SamplingParams`` carries each sampling
field, and the enum values by name. The client builds requests with these; the server parses them back."""
from __future__ import annotations

from pagedserve.proto.v1 import generation_pb2 as pb

# Proto3 ``optional`` fields (unset = the engine's default), repeated fields, and plain fields.
OPTIONAL_SAMPLING_FIELDS = ["n", "best_of", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                            "presence_penalty", "frequency_penalty", "seed", "max_tokens", "logprobs",
                            "prompt_logprobs", "skip_special_tokens", "spaces_between_special_tokens",
                            "stream_interval"]
REPEATED_SAMPLING_FIELDS = ["stop", "stop_token_ids"]
PLAIN_SAMPLING_FIELDS = ["include_stop_str_in_output", "ignore_eos", "min_tokens"]
MESSAGE_SAMPLING_FIELDS = ["structured_outputs"]
SAMPLING_FIELDS = OPTIONAL_SAMPLING_FIELDS + REPEATED_SAMPLING_FIELDS + PLAIN_SAMPLING_FIELDS + MESSAGE_SAMPLING_FIELDS
STRUCTURED_OUTPUT_KINDS = ["json", "json_object", "regex", "choice", "grammar"]

FINISH_REASONS = {None: pb.FINISH_REASON_UNSPECIFIED, "stop": pb.FINISH_REASON_STOP,
                  "length": pb.FINISH_REASON_LENGTH, "abort": pb.FINISH_REASON_ABORT}
FINISH_NAMES = {v: k for k, v in FINISH_REASONS.items()}

EARLY_STOPPING = {False: pb.EARLY_STOPPING_FALSE, True: pb.EARLY_STOPPING_TRUE, "never": pb.EARLY_STOPPING_NEVER}
EARLY_STOPPING_VALUES = {**{v: k for k, v in EARLY_STOPPING.items()}, pb.EARLY_STOPPING_UNSPECIFIED: False}
