"""``ServeOptions``: the server's own options (the engine's are ``EngineArgs``), their one set of defaults, and the
CLI flags generated from them as ``EngineArgs``' are: one flag per field that has a help entry, in field order.
``serve`` takes them all; ``gateway`` leaves out those of the replicas it does not launch (``serve_only``)."""
from __future__ import annotations

import argparse
import os
import typing
from dataclasses import MISSING, dataclass, field, fields

from pagedserve.cluster.runtime.handoff import DEFAULT_MAX_LOCAL_PREFILL_LENGTH, DisaggConfig
from pagedserve.cluster.runtime.ray_auth import ALLOW_FLAG
from pagedserve.cluster.runtime.replicas import ReplicaRole
from pagedserve.cluster.runtime.routing import (
    DEFAULT_BALANCE_FACTOR,
    POLICIES,
    RoutingPolicy,
    default_policy,
    make_policy,
)
from pagedserve.cluster.server.api_keys import KeyTable, split_api_keys
from pagedserve.cluster.server.api_options import ApiOptions
from pagedserve.cluster.server.openai.tool_parsers import TOOL_PARSER_NAMES
from pagedserve.cluster.server.tenants import (
    DEFAULT_METRICS_MAX_LABELS,
    TenancyOptions,
    check_header_name,
    parse_tenants,
)
from pagedserve.cluster.server.vllm_metrics import COMPAT_MODES

DEFAULT_HTTP_PORT = 8000  # as `vllm serve`: --port is the HTTP API's
DEFAULT_GRPC_PORT = 50051


class _ApiKeys(argparse.Action):
    """``--api-key KEY`` (repeatable, or a comma list) and ``--api-key-file PATH`` gather into one comma-separated
    ``api_key``; given any, they replace $PAGEDSERVE_API_KEY."""

    def __call__(self, parser, ns, value, option_string=None) -> None:
        if option_string == "--api-key-file":
            path = value
            try:
                with open(path) as f:
                    value = ",".join(line.strip() for line in f if line.strip())
            except OSError as e:
                parser.error(f"--api-key-file: {e}")
            if not value:
                parser.error(f"--api-key-file: no key in {path}")
        given = getattr(ns, "_api_keys_given", [])
        ns._api_keys_given = [*given, *split_api_keys(value)]
        setattr(ns, self.dest, ",".join(ns._api_keys_given) or None)


class _TenantsFile(argparse.Action):
    """``--tenants-file PATH``: the file's JSON, checked at once (its errors name the file); it replaces
    $PAGEDSERVE_TENANTS."""

    def __call__(self, parser, ns, path, option_string=None) -> None:
        try:
            with open(path) as f:
                text = f.read()
            parse_tenants(text)
        except (OSError, ValueError) as e:
            parser.error(f"--tenants-file {path}: {e}")
        setattr(ns, self.dest, text)


def _flag(default, help: str | None = None, *, flag: str | None = None, cli_default=MISSING, env: str | None = None,
          serve_only: bool = False, more: tuple[tuple[str, dict], ...] = (), **cli):
    """A field with its flag: ``flag`` (default ``--field-name``), ``cli_default`` (the flag's default where it is
    not the field's), ``env`` (a variable whose value, when the parser is built, is the flag's default), ``more``
    (further flags writing the field: names and their own keywords), and argparse's keywords (``choices``,
    ``action``, ``metavar``, ``aliases``: further names)."""
    meta = {"help": help, "flag": flag, "cli_default": cli_default, "env": env, "serve_only": serve_only,
            "more": more, **cli}
    return field(default=default, metadata=meta)


@dataclass
class ServeOptions:
    """A field made with ``_flag`` has a flag; ``name_replicas`` has none (``serve`` sets it)."""

    host: str = _flag("0.0.0.0")
    # The OpenAI-compatible HTTP API; 0: none. `pagedserve serve --port` defaults to 8000; code that builds its own
    # options (the demo, tests) opts in.
    http_port: int = _flag(0, "port of the OpenAI-compatible HTTP API (0: off); same key, TLS files and limits as "
                              "gRPC", flag="--port", cli_default=DEFAULT_HTTP_PORT)
    grpc_port: int = _flag(DEFAULT_GRPC_PORT, "port of the gRPC API")
    api_key: str | None = _flag(
        None, "require 'authorization: Bearer KEY' with one of the keys given (repeat the flag, or a comma list; "
              "default: $PAGEDSERVE_API_KEY)", env="PAGEDSERVE_API_KEY", action=_ApiKeys,
        more=(("--api-key-file", {"metavar": "PATH", "help": "the keys from a file, one per line (a mounted secret "
                                                             "rather than the environment)"}),))
    # The tenants file's JSON (see tenants.parse_tenants), not its path: the options travel to gateway processes.
    tenants: str | None = _flag(
        None, 'named tenants, as JSON: {"tenants": [{"name": "chat", "api_key": "sk-...", "weight": 2.0, '
              '"max_concurrent": 64, "max_queued": 256}, ...]} (only name required); each api_key is accepted as '
              "well as --api-key's and names its tenant (default: $PAGEDSERVE_TENANTS, the same JSON)",
        flag="--tenants-file", env="PAGEDSERVE_TENANTS", action=_TenantsFile, metavar="PATH")
    tenant_header: str | None = _flag(
        None, "a trusted header (and gRPC metadata key), e.g. x-tenant-id, naming the tenant of a request whose API "
              "key names none (ignored unless given: set it only where a proxy in front sets the header)",
        metavar="NAME")
    tenant_max_concurrent: int = _flag(0, "generation requests in flight per tenant (0: no limit; a tenant's "
                                          "max_concurrent overrides it); beyond it HTTP 429 / RESOURCE_EXHAUSTED at "
                                          "once", metavar="N")
    tenant_max_queued: int = _flag(0, "generation requests per tenant let in but without a first token yet (0: no "
                                      "limit; a tenant's max_queued overrides it); beyond it HTTP 429 / "
                                      "RESOURCE_EXHAUSTED at once", metavar="N")
    tenant_metrics_max_labels: int = _flag(
        DEFAULT_METRICS_MAX_LABELS, "tenants besides the default and the tenants file's that get a tenant label of "
                                    "their own on the per-tenant metrics (the first seen); later ones share 'other'",
        metavar="N")
    ssl_certfile: str | None = _flag(None)
    ssl_keyfile: str | None = _flag(None)
    max_concurrent_requests: int = _flag(4096, "generation requests in flight at once over all protocols; beyond it "
                                               "RESOURCE_EXHAUSTED (HTTP 429) at once")
    drain_timeout: float = _flag(30.0, "seconds running requests get on SIGTERM")
    served_model_name: str | None = _flag(None, "the model_name label and GetModelInfo name")
    metrics_port: int = _flag(9400, "Prometheus /metrics port (0: off)")
    metrics_compat: str = _flag("vllm", "vllm: also export the series vLLM's dashboards and autoscalers read "
                                        "(vllm:*), with vLLM's names and labels; none: only pagedserve_*",
                                choices=COMPAT_MODES)
    # A file, or an inline template.
    chat_template: str | None = _flag(None, "chat template file (Jinja) for /v1/chat/completions, overriding the "
                                            "tokenizer's")
    strict_request_fields: bool = _flag(False, "HTTP: refuse unknown request fields (400) instead of ignoring them "
                                               "with a warning, as vLLM")
    enable_prompt_tokens_details: bool = _flag(
        False, "report the prompt tokens served from the prefix cache in usage (HTTP "
               "prompt_tokens_details.cached_tokens, gRPC cached_prompt_tokens); off: one tenant would see what "
               "another has cached")
    disable_fastapi_docs: bool = _flag(False, "serve no /docs, /redoc or /openapi.json on the HTTP port")
    enable_auto_tool_choice: bool = _flag(False, "chat: with tool_choice 'auto' (the default when tools are given), "
                                                 "parse the model's text for tool calls with --tool-call-parser")
    tool_call_parser: str | None = _flag(None, "how the model writes tool calls (vLLM's names)",
                                         choices=TOOL_PARSER_NAMES)
    allow_unauthenticated_ray: bool = _flag(False, "serve from a Ray cluster reachable beyond loopback even though "
                                                   "its token authentication is off (refused by default)",
                                            flag=ALLOW_FLAG)
    routing_policy: str | None = _flag(None, "how requests pick a replica (default: prefix-aware with more than one "
                                             "replica, else least-loaded)", choices=POLICIES)
    routing_balance_factor: float = _flag(
        DEFAULT_BALANCE_FACTOR, "prefix-aware: a replica's score is its uncached prompt tokens plus this times its "
                                "queued and running work in tokens; higher spreads a hot prefix sooner, 0 routes by "
                                "cache alone")
    data_parallel_size: int = _flag(1, "model replicas (each its own TP group)", serve_only=True, aliases=["-dp"])
    prefill_replicas: int = _flag(0, "disaggregated serving: replicas that only prefill (a prompt's KV and first "
                                     "token) and hand each request to a decode replica; 0: every replica runs whole "
                                     "requests (--data-parallel-size)", serve_only=True)
    decode_replicas: int = _flag(0, "disaggregated serving: replicas that decode the requests the prefill replicas "
                                    "hand off, and run whole the ones not worth handing off", serve_only=True)
    max_local_prefill_length: int = _flag(
        DEFAULT_MAX_LOCAL_PREFILL_LENGTH, "disaggregated serving: a prompt with at most this many tokens uncached on "
                                          "its decode replica is prefilled there, not on a prefill replica")
    max_waiting_requests: int | None = _flag(None, "per replica; beyond it requests get RESOURCE_EXHAUSTED",
                                             serve_only=True)
    step_timeout: float = _flag(120.0, "seconds an engine step may make no progress before the engine is restarted "
                                       "(its requests resume); 0: never", serve_only=True)
    autoscale: str | None = _flag(
        None, "change the number of replicas with the load: min=1,max=4[,waiting=4][,kv_usage=0.8][,ttft_p90=2]"
              "[,prefill_tokens=8192][,interval=5][,scale_out_cooldown=30][,scale_in_cooldown=300] (targets per "
              "replica, prefill_tokens for a prefill pool; off: the same decision is only exported, as "
              "pagedserve_desired_replicas)", serve_only=True, metavar="POLICY")
    # 1: the gateway runs in serve's own process.
    api_server_count: int = _flag(1, "gateway processes sharing the gRPC and HTTP ports (SO_REUSEPORT), all routing "
                                     "to the same replicas; gateway i serves /metrics on --metrics-port + i",
                                  serve_only=True)
    # Launch the replicas as detached named actors that `pagedserve gateway` can attach to. `pagedserve serve` does;
    # code that builds its own options (the demo, tests, several servers of one model in one cluster) opts in.
    name_replicas: bool = False

    def __post_init__(self) -> None:
        if self.prefill_replicas < 0 or self.decode_replicas < 0:
            raise ValueError("--prefill-replicas and --decode-replicas must be >= 0")
        if self.prefill_replicas and (self.decode_replicas < 1 or self.data_parallel_size != 1):
            raise ValueError("--prefill-replicas needs --decode-replicas >= 1, and replaces --data-parallel-size")
        if self.decode_replicas and not self.prefill_replicas:
            raise ValueError("--decode-replicas needs --prefill-replicas >= 1 (without, use --data-parallel-size)")
        if self.routing_policy is not None and self.routing_policy not in POLICIES:
            raise ValueError(f"routing_policy must be one of {', '.join(POLICIES)}, got {self.routing_policy!r}")
        # A bad tenants file, tenant header, tenant limit or key fails here, before anything starts.
        KeyTable.build(self.api_key, self.tenancy.tenants)

    @property
    def tenancy(self) -> TenancyOptions:
        try:
            tenants = parse_tenants(self.tenants) if self.tenants else ()
        except ValueError as e:
            raise ValueError(f"the tenants (--tenants-file or $PAGEDSERVE_TENANTS): {e}") from None
        header = check_header_name(self.tenant_header) if self.tenant_header else None
        return TenancyOptions(tenants, header, self.tenant_max_concurrent, self.tenant_max_queued,
                              self.tenant_metrics_max_labels)

    @property
    def keys(self) -> KeyTable:
        """The API keys both protocols accept: --api-key's (and its file's) and the tenants'."""
        return KeyTable.build(self.api_key, self.tenancy.tenants)

    @property
    def api_options(self) -> ApiOptions:
        return ApiOptions(self.strict_request_fields, self.disable_fastapi_docs, self.enable_prompt_tokens_details,
                          self.enable_auto_tool_choice, self.tool_call_parser)

    @property
    def replica_roles(self) -> list[ReplicaRole]:
        """Each replica's role, in index order: prefill replicas first."""
        if not self.prefill_replicas:
            return [ReplicaRole.BOTH] * self.data_parallel_size
        return [ReplicaRole.PREFILL] * self.prefill_replicas + [ReplicaRole.DECODE] * self.decode_replicas

    @property
    def disagg(self) -> DisaggConfig:
        return DisaggConfig(max_local_prefill_length=self.max_local_prefill_length)

    def make_policy(self, num_replicas: int) -> RoutingPolicy:
        return make_policy(self.routing_policy or default_policy(num_replicas), self.routing_balance_factor)

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, serve: bool) -> None:
        """The "server" group: every flag for ``serve``, those but the ``serve_only`` ones for ``gateway``."""
        group = parser.add_argument_group("server")
        hints = typing.get_type_hints(cls)
        for f in fields(cls):
            if "help" in f.metadata and (serve or not f.metadata["serve_only"]):
                _add_flag(group, f.name, hints[f.name], f.default, dict(f.metadata))

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace, **overrides) -> ServeOptions:
        """The options the flags in ``ns`` set (a gateway's lack the ``serve_only`` ones: those keep their defaults)."""
        given = {f.name: getattr(ns, f.name) for f in fields(cls) if hasattr(ns, f.name)}
        return cls(**{**given, **overrides})


def _add_flag(group: argparse._ArgumentGroup, name: str, hint, default, meta: dict) -> None:
    kind = next(t for t in typing.get_args(hint) or (hint,) if t is not type(None))
    flag, cli_default, env = meta.pop("flag"), meta.pop("cli_default"), meta.pop("env")
    more, aliases = meta.pop("more"), meta.pop("aliases", [])
    del meta["serve_only"]
    kw = {"dest": name, "default": default if cli_default is MISSING else cli_default, **meta}
    if env is not None:
        kw["default"] = os.environ.get(env)
    if kind is bool:
        kw["action"] = "store_true"
    elif "action" not in kw and kind is not str:
        kw["type"] = kind
    group.add_argument(flag or f"--{name.replace('_', '-')}", *aliases, **kw)
    for extra, extra_kw in more:
        group.add_argument(extra, dest=name, action=kw["action"], **extra_kw)
