"""Tenants at the gateway: who each generation request is for, and how many of a tenant's requests it lets in.

A request's tenant is the tenant its API key names (a key of the tenants file, ``--tenants-file`` or
$PAGEDSERVE_TENANTS), else the value of the trusted header the operator names (``--tenant-header``, the same name as
gRPC metadata; ignored unless configured), else the default tenant. Its name and weight go with the request to the
replicas' scheduler (``--fairness tokens`` shares tokens between tenants by weight, ``scheduler/request_queue.py``).

Here each tenant has at most ``max_concurrent`` requests in flight and ``max_queued`` of them without a first output
yet (``--tenant-max-concurrent``, ``--tenant-max-queued``, or the tenant's own in the file; 0: no limit). One more is
refused at once, before it is tokenized, with OverloadedError (HTTP 429 with Retry-After, gRPC RESOURCE_EXHAUSTED
with retry-after metadata). A request counts as one whatever its prompts and ``n``."""
from __future__ import annotations

import json
import math
import re
import time
from dataclasses import dataclass, field

from pagedserve.cluster.server.metrics import OTHER_TENANTS, GatewayMetrics
from pagedserve.common.errors import InvalidRequestError, OverloadedError
from pagedserve.engine.core_types import DEFAULT_TENANT, Tenant

MAX_NAME_CHARS = 64
TENANT_NAME = re.compile(rf"[A-Za-z0-9][A-Za-z0-9_.:@/-]{{0,{MAX_NAME_CHARS - 1}}}")
NAME_RULE = (f"1 to {MAX_NAME_CHARS} letters, digits or _.:@/- starting with a letter or digit, and not "
             f"{OTHER_TENANTS!r} (the metrics' label of the tenants past --tenant-metrics-max-labels)")
HEADER_NAME = re.compile(r"[a-z0-9][a-z0-9-]*")
# Headers a tenant header cannot be: the credentials, and what HTTP/2 and gRPC reserve.
RESERVED_HEADERS = {"authorization", "x-api-key", "content-type", "content-length", "host", "te", "user-agent"}
FILE_FIELDS = ("name", "api_key", "weight", "max_concurrent", "max_queued")
DEFAULT_METRICS_MAX_LABELS = 16


@dataclass(frozen=True)
class TenantConfig:
    """One entry of the tenants file."""

    name: str
    weight: float = 1.0  # its share under --fairness tokens
    api_key: str | None = field(default=None, repr=False)  # requests presenting this key are this tenant's
    max_concurrent: int | None = None  # None: --tenant-max-concurrent; 0: no limit
    max_queued: int | None = None  # None: --tenant-max-queued; 0: no limit


def valid_tenant_name(name: object) -> bool:
    return isinstance(name, str) and TENANT_NAME.fullmatch(name) is not None and name != OTHER_TENANTS


def check_tenant_name(name: object, where: str) -> str:
    if not valid_tenant_name(name):
        raise ValueError(f"{where}: a tenant name is {NAME_RULE}, got {name!r}")
    return name


def _count(entry: dict, key: str, where: str) -> int | None:
    value = entry.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{where}.{key} must be an integer >= 0 (0: no limit), got {value!r}")
    return value


def _entry(entry: object, where: str) -> TenantConfig:
    if not isinstance(entry, dict):
        raise ValueError(f"{where} must be an object with the fields {', '.join(FILE_FIELDS)}")
    unknown = [k for k in entry if k not in FILE_FIELDS]
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {', '.join(map(repr, unknown))}; the fields are "
                         f"{', '.join(FILE_FIELDS)}")
    if "name" not in entry:
        raise ValueError(f"{where}: no name")
    name = check_tenant_name(entry["name"], f"{where}.name")
    weight = entry.get("weight", 1.0)
    if not isinstance(weight, int | float) or isinstance(weight, bool) or not math.isfinite(weight) or weight <= 0:
        raise ValueError(f"{where}.weight must be a number > 0, got {weight!r}")
    key = entry.get("api_key")
    if key is not None and (not isinstance(key, str) or not key or key != key.strip() or "," in key):
        raise ValueError(f"{where}.api_key must be a non-empty string without commas or surrounding whitespace")
    return TenantConfig(name, float(weight), key, _count(entry, "max_concurrent", where),
                        _count(entry, "max_queued", where))


def parse_tenants(text: str) -> tuple[TenantConfig, ...]:
    """The tenants file's JSON: ``{"tenants": [{"name": "chat", "api_key": "sk-...", "weight": 2.0,
    "max_concurrent": 64, "max_queued": 256}, ...]}`` (only ``name`` required). Raises ValueError naming the entry
    and the field: not JSON, unknown fields, a bad name or weight, a name or key given twice. The name "default"
    configures the default tenant (the requests no key or header names)."""
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"not valid JSON: {e}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("tenants"), list):
        raise ValueError('expected an object {"tenants": [...]}')
    if unknown := [k for k in doc if k != "tenants"]:
        raise ValueError(f"unknown field(s) {', '.join(map(repr, unknown))}; the file holds only \"tenants\"")
    tenants = tuple(_entry(e, f"tenants[{i}]") for i, e in enumerate(doc["tenants"]))
    names: dict[str, int] = {}
    keys: dict[str, int] = {}
    for i, t in enumerate(tenants):
        if t.name in names:
            raise ValueError(f"tenants[{i}]: the name {t.name!r} is also tenants[{names[t.name]}]'s")
        names[t.name] = i
        if t.api_key is not None:
            if t.api_key in keys:  # never the key itself in a message
                raise ValueError(f"tenants[{i}]: its api_key is also tenants[{keys[t.api_key]}]'s")
            keys[t.api_key] = i
    return tenants


def check_header_name(name: str) -> str:
    """``--tenant-header``'s name, lowercased (as HTTP/2 and gRPC metadata carry it); raises ValueError."""
    low = name.strip().lower()
    if HEADER_NAME.fullmatch(low) is None or low.endswith("-bin") or low.startswith(("grpc-", ":")) \
            or low in RESERVED_HEADERS:
        raise ValueError(f"--tenant-header: {name!r} cannot carry a tenant name (letters, digits and '-'; not a "
                         "credential, binary or reserved header)")
    return low


@dataclass(frozen=True)
class TenancyOptions:
    """The tenants and their limits, from ``serve``'s flags."""

    tenants: tuple[TenantConfig, ...] = ()
    header: str | None = None  # lowercased (check_header_name)
    max_concurrent: int = 0  # per tenant; 0: no limit
    max_queued: int = 0
    metrics_max_labels: int = DEFAULT_METRICS_MAX_LABELS

    def __post_init__(self) -> None:
        for name in ("max_concurrent", "max_queued", "metrics_max_labels"):
            if getattr(self, name) < 0:
                raise ValueError(f"--tenant-{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")


@dataclass
class _TenantState:
    tenant: Tenant
    max_concurrent: int
    max_queued: int
    configured: bool  # the default tenant or one of the file: kept while idle
    in_flight: int = 0
    queued: int = 0  # of in_flight, those without a first output yet


class TenantTicket:
    """One request's place among its tenant's: queued until ``started`` (its first output), held until ``release``
    (also on leaving its ``with`` block); both idempotent. Event loop only."""

    def __init__(self, tenants: Tenants, state: _TenantState, label: str) -> None:
        self._tenants = tenants
        self._state = state
        self.tenant = state.tenant
        self.label = label  # the tenant's metrics label
        self._admitted = time.monotonic()
        self._queued = True
        self._released = False

    def started(self) -> None:
        if self._queued and not self._released:
            self._queued = False
            self._state.queued -= 1
            self._tenants.metrics.tenant_queue_time(self.label).observe(time.monotonic() - self._admitted)

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        if self._queued:
            self._queued = False
            self._state.queued -= 1
        self._state.in_flight -= 1
        self._tenants.forget_if_idle(self._state)

    def __enter__(self) -> TenantTicket:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class Tenants:
    """Each tenant's requests in flight at this gateway (event loop only). Tenants a header names that the file does
    not are tracked while they have requests, with the default limits and weight 1."""

    def __init__(self, options: TenancyOptions, metrics: GatewayMetrics) -> None:
        self.options = options
        self.metrics = metrics
        configured = {t.name: t for t in options.tenants}
        default = configured.get(DEFAULT_TENANT.name, TenantConfig(DEFAULT_TENANT.name, DEFAULT_TENANT.weight))
        self._states = {t.name: self._state(t, True) for t in (default, *options.tenants)}
        metrics.configure_tenants(list(self._states), options.metrics_max_labels)

    def _state(self, config: TenantConfig, configured: bool) -> _TenantState:
        o = self.options
        return _TenantState(
            Tenant(config.name, config.weight),
            o.max_concurrent if config.max_concurrent is None else config.max_concurrent,
            o.max_queued if config.max_queued is None else config.max_queued, configured)

    @property
    def header(self) -> str | None:
        """The trusted header (and gRPC metadata key) naming the tenant, if the operator configured one."""
        return self.options.header

    def resolve(self, key_tenant: str | None, header_value: str | None) -> str:
        """The tenant of a request: its API key's (``key_tenant``), else the header's value (only pass it when
        ``header`` is configured), else the default tenant. A bad header value is InvalidRequestError (400)."""
        if key_tenant is not None:
            return key_tenant
        if header_value:
            if not valid_tenant_name(header_value):
                raise InvalidRequestError(f"{self.header}: a tenant name is {NAME_RULE}")
            return header_value
        return DEFAULT_TENANT.name

    def admit(self, name: str) -> TenantTicket:
        """A place for one more of ``name``'s requests, or OverloadedError at its limit (counted as rejected)."""
        state = self._states.get(name)
        if state is None:
            state = self._states[name] = self._state(TenantConfig(name), False)
        label = self.metrics.tenant_label(name)
        if state.max_concurrent and state.in_flight >= state.max_concurrent:
            self._reject(state, label, "concurrent", f"{state.max_concurrent} requests in flight "
                                                     "(--tenant-max-concurrent, or its max_concurrent)")
        if state.max_queued and state.queued >= state.max_queued:
            self._reject(state, label, "queued", f"{state.max_queued} requests waiting for their first token "
                                                 "(--tenant-max-queued, or its max_queued)")
        state.in_flight += 1
        state.queued += 1
        self.metrics.tenant_requests(label).inc()
        return TenantTicket(self, state, label)

    def _reject(self, state: _TenantState, label: str, reason: str, limit: str) -> None:
        self.metrics.tenant_rejected(label, reason).inc()
        self.forget_if_idle(state)
        raise OverloadedError(f"tenant {state.tenant.name!r} is at its limit of {limit}; retry later")

    def forget_if_idle(self, state: _TenantState) -> None:
        if not state.configured and state.in_flight == 0:
            self._states.pop(state.tenant.name, None)

    def usage(self, name: str) -> tuple[int, int]:
        """(in flight, of them queued) for ``name``: what the limits compare against."""
        state = self._states.get(name)
        return (state.in_flight, state.queued) if state is not None else (0, 0)
