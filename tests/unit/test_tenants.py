"""Tenants without a server: the tenants file (its format and every refusal, naming the entry and never a key), the
key table both protocols authenticate with, the serve flags, each tenant's limits at the gateway (every place given
back, whatever ends the request) and the bounded tenant label of the per-tenant metrics."""
from __future__ import annotations

import argparse
import json

import pytest
from prometheus_client import generate_latest

from pagedserve.cluster.entrypoints.serve import add_arguments
from pagedserve.cluster.entrypoints.serve_options import ServeOptions
from pagedserve.cluster.server.api_keys import KeyTable
from pagedserve.cluster.server.metrics import GatewayMetrics, TenantLabels
from pagedserve.cluster.server.tenants import (
    TenancyOptions,
    TenantConfig,
    Tenants,
    check_header_name,
    parse_tenants,
)
from pagedserve.common.errors import InvalidRequestError, OverloadedError
from pagedserve.engine.core_types import Tenant

SECRET = "sk-never-in-a-message"


def _file(*tenants: dict) -> str:
    return json.dumps({"tenants": list(tenants)})


def test_tenants_file_format():
    got = parse_tenants(_file({"name": "chat", "api_key": "sk-1", "weight": 2, "max_concurrent": 64, "max_queued": 0},
                              {"name": "team/a.b:c@d-e_f"}))
    assert got == (TenantConfig("chat", 2.0, "sk-1", 64, 0), TenantConfig("team/a.b:c@d-e_f"))
    assert got[1].weight == 1.0 and got[1].api_key is None and got[1].max_concurrent is None
    assert SECRET not in repr(TenantConfig("x", api_key=SECRET))
    assert parse_tenants('{"tenants": []}') == ()


@pytest.mark.parametrize("text, message", [
    ("{", "not valid JSON"),
    ("[]", 'expected an object {"tenants": [...]}'),
    ('{"tenants": {}}', 'expected an object {"tenants": [...]}'),
    ('{"tenants": [], "keys": []}', "unknown field(s) 'keys'"),
    (_file("chat"), "tenants[0] must be an object"),
    (_file({"name": "a"}, {"name": "b", "wieght": 2}), "tenants[1]: unknown field(s) 'wieght'; the fields are name,"),
    (_file({"weight": 2}), "tenants[0]: no name"),
    (_file({"name": "has space"}), "tenants[0].name: a tenant name is 1 to 64 letters"),
    (_file({"name": "x" * 65}), "tenants[0].name: a tenant name is"),
    (_file({"name": "-x"}), "tenants[0].name: a tenant name is"),
    (_file({"name": "other"}), "tenants[0].name: a tenant name is"),
    (_file({"name": 7}), "tenants[0].name: a tenant name is"),
    (_file({"name": "a", "weight": 0}), "tenants[0].weight must be a number > 0, got 0"),
    (_file({"name": "a", "weight": -1.5}), "tenants[0].weight must be a number > 0"),
    (_file({"name": "a", "weight": "2"}), "tenants[0].weight must be a number > 0"),
    (_file({"name": "a", "weight": True}), "tenants[0].weight must be a number > 0"),
    ('{"tenants": [{"name": "a", "weight": NaN}]}', "tenants[0].weight must be a number > 0"),
    (_file({"name": "a", "max_concurrent": -1}), "tenants[0].max_concurrent must be an integer >= 0"),
    (_file({"name": "a", "max_queued": 1.5}), "tenants[0].max_queued must be an integer >= 0"),
    (_file({"name": "a", "max_queued": False}), "tenants[0].max_queued must be an integer >= 0"),
    (_file({"name": "a", "api_key": ""}), "tenants[0].api_key must be a non-empty string"),
    (_file({"name": "a", "api_key": "k1,k2"}), "tenants[0].api_key must be a non-empty string without commas"),
    (_file({"name": "a", "api_key": 5}), "tenants[0].api_key must be a non-empty string"),
    (_file({"name": "a"}, {"name": "b"}, {"name": "a"}), "tenants[2]: the name 'a' is also tenants[0]'s"),
    (_file({"name": "a", "api_key": SECRET}, {"name": "b", "api_key": SECRET}),
     "tenants[1]: its api_key is also tenants[0]'s"),
])
def test_tenants_file_refusals_name_the_entry(text, message):
    with pytest.raises(ValueError) as err:
        parse_tenants(text)
    assert message in str(err.value) and SECRET not in str(err.value)


def test_key_table_names_each_keys_tenant():
    keys = KeyTable.build("k1,k2,k1", parse_tenants(_file({"name": "chat", "api_key": "sk-c"}, {"name": "free"})))
    assert [(k.secret, k.tenant) for k in keys.keys] == [("k1", None), ("k2", None), ("sk-c", "chat")]
    assert keys.match("k2") == 1 and keys.match(None, "sk-c") == 2 and keys.match("wrong", "") is None
    assert keys.match() is None and keys.match("k") is None and keys.match("k10") is None
    assert keys.tenant(2) == "chat" and keys.tenant(0) is None and keys.tenant(None) is None
    assert SECRET not in repr(KeyTable.build(SECRET)) and not KeyTable.build() and KeyTable.build(" , ").keys == ()
    with pytest.raises(ValueError, match="also given by --api-key") as err:
        KeyTable.build(f"k1,{SECRET}", [TenantConfig("chat", api_key=SECRET)])
    assert SECRET not in str(err.value)


def test_header_names():
    assert check_header_name("X-Tenant-Id") == "x-tenant-id"
    for bad in ("authorization", "x-api-key", "x tenant", "x-tenant-bin", "grpc-tenant", "", "x_tenant", "-x"):
        with pytest.raises(ValueError, match="--tenant-header"):
            check_header_name(bad)


def test_serve_flags(tmp_path, monkeypatch):
    env = _file({"name": "env-tenant", "api_key": "sk-env"})
    monkeypatch.setenv("PAGEDSERVE_TENANTS", env)
    p = argparse.ArgumentParser()
    add_arguments(p)
    opts = ServeOptions.from_cli_args(p.parse_args([]))
    assert opts.tenants == env and opts.tenancy.tenants == (TenantConfig("env-tenant", api_key="sk-env"),)
    assert opts.tenancy.header is None and opts.tenancy.metrics_max_labels == 16
    assert opts.keys.match("sk-env") == 0  # a tenant's key alone: keys are required

    path = tmp_path / "tenants.json"
    path.write_text(_file({"name": "chat", "api_key": "sk-c", "max_concurrent": 2}))
    ns = p.parse_args(["--tenants-file", str(path), "--api-key", "k1", "--tenant-header", "X-Tenant-Id",
                       "--tenant-max-concurrent", "8", "--tenant-max-queued", "4", "--tenant-metrics-max-labels", "3"])
    opts = ServeOptions.from_cli_args(ns)
    assert opts.tenancy == TenancyOptions((TenantConfig("chat", api_key="sk-c", max_concurrent=2),), "x-tenant-id",
                                          8, 4, 3)  # the file replaced the environment's tenants
    assert [k.tenant for k in opts.keys.keys] == [None, "chat"]

    path.write_text(_file({"name": "a", "weight": 0}))
    for bad in (["--tenants-file", str(path)], ["--tenants-file", str(tmp_path / "missing.json")]):
        with pytest.raises(SystemExit):
            p.parse_args(bad)
    for kw, message in [(dict(tenants="{"), "the tenants (--tenants-file or $PAGEDSERVE_TENANTS): not valid JSON"),
                        (dict(tenant_header="authorization"), "--tenant-header"),
                        (dict(tenant_max_queued=-1), "--tenant-max-queued must be >= 0"),
                        (dict(api_key="sk-env"), "also given by --api-key")]:
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("$", r"\$")):
            ServeOptions(**{"tenants": env, **kw})


def test_tenant_labels_are_bounded_and_never_move():
    labels = TenantLabels(["default", "chat"], 2)
    assert [labels(n) for n in ("a", "chat", "b", "c", "default", "a", "d", "b")] == \
        ["a", "chat", "b", "other", "default", "a", "other", "b"]
    assert TenantLabels(["default"], 0)("a") == "other"


def _series(metrics: GatewayMetrics) -> str:
    return generate_latest(metrics.registry).decode()


def test_tenant_limits_and_every_place_given_back():
    metrics = GatewayMetrics("m")
    assert 'pagedserve_tenant_requests_total{model_name="m",tenant="default"} 0.0' in _series(metrics)
    tenants = Tenants(TenancyOptions(parse_tenants(_file({"name": "chat", "weight": 2.0, "max_concurrent": 2},
                                                         {"name": "batch", "max_queued": 1},
                                                         {"name": "default", "max_concurrent": 0})),
                                     "x-tenant-id", max_concurrent=3, max_queued=0, metrics_max_labels=1), metrics)
    text = _series(metrics)
    for name in ("default", "chat", "batch"):  # every configured tenant's series at zero from the start
        assert f'pagedserve_tenant_rejected_requests_total{{model_name="m",reason="queued",tenant="{name}"}} 0.0' \
            in text
        assert f'pagedserve_tenant_queue_time_seconds_count{{model_name="m",tenant="{name}"}} 0.0' in text

    chat = [tenants.admit("chat"), tenants.admit("chat")]
    assert chat[0].tenant == Tenant("chat", 2.0) and chat[0].label == "chat"
    with pytest.raises(OverloadedError, match=r"tenant 'chat' is at its limit of 2 requests in flight"):
        tenants.admit("chat")
    chat[0].started()
    with pytest.raises(OverloadedError):  # started or not, still in flight
        tenants.admit("chat")
    assert tenants.usage("chat") == (2, 1)
    chat[0].release()
    chat[0].release()  # once only
    with tenants.admit("chat") as third:
        assert tenants.usage("chat") == (2, 2)
    third.release()
    chat[1].started()
    chat[1].release()
    assert tenants.usage("chat") == (0, 0)

    batch = tenants.admit("batch")
    with pytest.raises(OverloadedError, match="1 requests waiting for their first token"):
        tenants.admit("batch")
    batch.started()
    batch.started()
    more = []
    for _ in range(2):
        more.append(tenants.admit("batch"))
        more[-1].started()
    with pytest.raises(OverloadedError, match="limit of 3 requests in flight"):  # --tenant-max-concurrent
        tenants.admit("batch")
    for t in (batch, *more):
        t.release()
    assert tenants.usage("batch") == (0, 0)

    defaults = [tenants.admit("default") for _ in range(10)]  # its own max_concurrent 0: no limit
    for t in defaults:
        t.release()

    # A tenant the header names: the default limits, weight 1, forgotten once idle; labels past the first other.
    first, second = tenants.admit("team-a"), tenants.admit("team-b")
    assert first.tenant == Tenant("team-a", 1.0) and (first.label, second.label) == ("team-a", "other")
    first.release()
    second.release()
    assert tenants.usage("team-a") == (0, 0) and set(tenants._states) == {"default", "chat", "batch"}

    text = _series(metrics)
    assert 'pagedserve_tenant_rejected_requests_total{model_name="m",reason="concurrent",tenant="chat"} 2.0' in text
    assert 'pagedserve_tenant_rejected_requests_total{model_name="m",reason="queued",tenant="batch"} 1.0' in text
    assert 'pagedserve_tenant_rejected_requests_total{model_name="m",reason="concurrent",tenant="batch"} 1.0' in text
    assert 'pagedserve_tenant_requests_total{model_name="m",tenant="chat"} 3.0' in text
    assert 'pagedserve_tenant_requests_total{model_name="m",tenant="other"} 1.0' in text
    assert 'pagedserve_tenant_queue_time_seconds_count{model_name="m",tenant="chat"} 2.0' in text  # started only
    assert 'pagedserve_tenant_queue_time_seconds_count{model_name="m",tenant="batch"} 3.0' in text


def test_which_tenant_a_request_is():
    tenants = Tenants(TenancyOptions(header="x-tenant-id"), GatewayMetrics("m"))
    assert tenants.resolve("chat", "team-a") == "chat"  # the key's tenant first
    assert tenants.resolve(None, "team-a") == "team-a"
    assert tenants.resolve(None, None) == tenants.resolve(None, "") == "default"
    for bad in ("x" * 65, "two words", "other", "é"):
        with pytest.raises(InvalidRequestError, match="x-tenant-id: a tenant name is"):
            tenants.resolve(None, bad)
