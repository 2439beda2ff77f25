"""A model that cannot run: every forward raises the same way. The cause is real, not mocked: the Triton attention
backend asked for on the CPU device (both accepted by the arguments; the first forward raises). Serving it fails at
startup with the model's error, after the warm-up's worker rebuilds, instead of reporting SERVING and failing every
request; an engine core whose steps fail that way marks itself failed and takes no more requests."""
from __future__ import annotations

import logging
import sys
import time

import pytest
from ray import cloudpickle

from pagedserve.common.errors import EngineUnavailableError
from pagedserve.common.sampling_params import SamplingParams
from pagedserve.engine.arg_utils import EngineArgs
from pagedserve.engine.core_types import EngineCoreRequest
from pagedserve.engine.engine_core import WARMUP_ID, EngineCore
from pagedserve.tests.server_thread import ServerThread, free_port


@pytest.fixture(scope="module")
def model_dir(model_factory) -> str:
    return model_factory("gpt2")


def _broken(model_dir: str, **kw) -> EngineArgs:
    return EngineArgs(model=model_dir, device="cpu", attention_backend="triton", seed=0, **kw)


def _fail_an_engine_core(model_dir: str) -> None:
    """The engine-core actor's path: a step raises in this process, its requests end with it."""
    events: list[tuple[bool, str]] = []
    core = EngineCore(_broken(model_dir).create_engine_config(), on_health=lambda ok, why: events.append((ok, why)))
    params = SamplingParams(max_tokens=4, temperature=0.0)
    errors = []
    for i in range(2):
        core.add_request(EngineCoreRequest(f"r{i}", [5, 6, 7], params))
        with pytest.raises(Exception) as e:
            core.step()
        outs = core.fail_step(e.value)
        errors += [o.error for o in outs]
    assert all(err and type(e.value).__name__ in err for err in errors) and len(errors) == 2
    # The second equal failure probed the model alone: it failed too, so the core is failed for good.
    assert core.failed and type(e.value).__name__ in core.failed
    assert events == [(False, core.failed)]
    assert not core.has_unfinished_requests()
    with pytest.raises(EngineUnavailableError, match="replica failed"):
        core.add_request(EngineCoreRequest("late", [5], params))
    with pytest.raises(EngineUnavailableError):
        core.warmup()
    core.shutdown()


def test_an_engine_core_whose_every_step_fails_the_same_way_marks_itself_failed(ray_cluster, model_dir):
    # In a Ray process: this one interprets Triton kernels on CPU (tests/conftest.py), so they would not fail here.
    # pytest's importlib mode names this module so that Ray's worker cannot import it: send its code along.
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    ray_cluster.get(ray_cluster.remote(_fail_an_engine_core).remote(model_dir), timeout=240)


def test_a_step_failure_that_is_the_requests_own_keeps_the_core_serving(model_dir):
    """The probe passes on a model that can run: two equal failures of some requests do not fail the replica."""
    core = EngineCore(EngineArgs(model=model_dir, device="cpu", seed=0).create_engine_config())
    for _ in range(2):
        core.fail_step(RuntimeError("a shape this request alone has"))
    assert core.failed is None
    core.add_request(EngineCoreRequest("ok", [5, 6], SamplingParams(max_tokens=2, temperature=0.0)))
    outs = []
    while core.has_unfinished_requests():
        outs += core.step()
    assert outs[-1].finished and outs[-1].error is None and outs[-1].request_id != WARMUP_ID
    core.shutdown()


@pytest.mark.parametrize("tp", [1, 2])
def test_serve_fails_at_startup_with_the_models_error(ray_cluster, model_dir, tp, caplog):
    """TP 1: the warm-up's step raises in the engine-core actor. TP 2: each rank raises, the core rebuilds the
    workers, the same error again ends the warm-up request and a probe alone fails too (the issue's case)."""
    srv = ServerThread(_broken(model_dir, tensor_parallel_size=tp), http_port=free_port())
    t0 = time.monotonic()
    with caplog.at_level(logging.ERROR), pytest.raises(EngineUnavailableError) as e:
        try:
            srv.start(timeout=240)
        finally:
            if srv._error is None:  # it came up: never hold its placement group through the rest of the session
                srv.stop()
    took = time.monotonic() - t0
    msg = str(e.value)
    assert "replica 0 failed its warm-up" in msg and "RuntimeError" in msg, msg
    assert took < 240
    assert any("failed its warm-up" in r.getMessage() for r in caplog.records)
    srv._thread.join(60)
    assert not srv._thread.is_alive()  # serve() returned: nothing left running
