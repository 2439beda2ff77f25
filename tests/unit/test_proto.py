"""The committed stubs match the .proto, and the proto mirrors every SamplingParams field."""
from __future__ import annotations

import os
import re
from dataclasses import fields

from pagedserve.cluster.client import build_request
from pagedserve.cluster.server.grpc_api.protocol import params_from_proto
from pagedserve.common.sampling_params import SamplingParams
from pagedserve.proto import generate as gen
from pagedserve.proto.fields import SAMPLING_FIELDS

# Version stamps differ between grpcio-tools releases without changing the stubs' meaning.
_STAMP = re.compile(r"^.*(Protobuf Python Version|ValidateProtobufRuntimeVersion|GRPC_GENERATED_VERSION = |"
                    r"_runtime_version\.Domain|^\s+\d+,\s*$|^\s+'',\s*$).*$", re.M)


def _normalized(path: str) -> str:
    with open(path) as f:
        return _STAMP.sub("", f.read())


def test_stubs_are_up_to_date(tmp_path):
    fresh = gen.generate(str(tmp_path))
    for path in fresh:
        committed = os.path.join(gen.STUB_DIR, os.path.basename(path))
        assert os.path.exists(committed), f"{committed} missing: run python -m pagedserve.proto.generate"
        assert _normalized(path) == _normalized(committed), \
            f"{committed} is stale: run python -m pagedserve.proto.generate"


def test_proto_mirrors_sampling_params():
    engine = {f.name for f in fields(SamplingParams) if f.name != "all_stop_token_ids"}
    assert not engine - set(SAMPLING_FIELDS), "SamplingParams fields missing from the proto"
    kw = dict(n=2, best_of=3, temperature=0.5, top_p=0.9, top_k=7, min_p=0.1, repetition_penalty=1.2,
              presence_penalty=0.3, frequency_penalty=-0.2, seed=11, stop=["x", "yz"], stop_token_ids=[4],
              include_stop_str_in_output=True, ignore_eos=True, max_tokens=9, min_tokens=2, logprobs=3,
              prompt_logprobs=1, skip_special_tokens=False, spaces_between_special_tokens=False, stream_interval=4)
    parsed = params_from_proto(build_request("hello", stream=False, **kw))
    for k, v in kw.items():
        got = getattr(parsed.params, k)
        assert got == v or abs(got - v) < 1e-6, k
    assert parsed.prompt == "hello" and parsed.stream is False


def test_structured_outputs_cross_the_wire():
    """Each kind, and disable_any_whitespace (vLLM's option for compact JSON), arrive as the engine's params."""
    cases = [({"json": {"type": "object"}, "disable_any_whitespace": True}, "json", '{"type": "object"}', True),
             ({"json_object": True}, "json_object", True, False),
             ({"regex": "a+b"}, "regex", "a+b", False),
             ({"choice": ["x", "y"]}, "choice", ["x", "y"], False),
             ({"grammar": 'start: "a"'}, "grammar", 'start: "a"', False)]
    for so, kind, value, compact in cases:
        parsed = params_from_proto(build_request("hi", structured_outputs=so)).params.structured_outputs
        assert (parsed.kind, getattr(parsed, kind), parsed.disable_any_whitespace) == (kind, value, compact)
