"""The API keys both protocols accept, and the tenant each names: the unnamed keys of ``--api-key`` /
``--api-key-file`` / $PAGEDSERVE_API_KEY and the named keys of the tenants file. A key is known by its index in the
table (which requests an Abort may reach: ``request_owners``)."""
from __future__ import annotations

import hmac
from collections.abc import Iterable
from dataclasses import dataclass

from pagedserve.cluster.server.tenants import TenantConfig


def split_api_keys(api_key: str | None) -> list[str]:
    """The keys an ``api_key`` setting holds: one, or a comma-separated list (``--api-key`` given several times or as
    a comma list, ``--api-key-file``)."""
    return [k.strip() for k in (api_key or "").split(",") if k.strip()]


@dataclass(frozen=True)
class ApiKey:
    secret: str
    tenant: str | None = None  # the tenant its requests are; None (an unnamed key): the tenant header's, or default

    def __repr__(self) -> str:  # never the secret in a log line
        return f"ApiKey(tenant={self.tenant!r})"


@dataclass(frozen=True)
class KeyTable:
    """No keys: no key needed. Otherwise a request must present one of them."""

    keys: tuple[ApiKey, ...] = ()

    @classmethod
    def build(cls, api_key: str | None = None, tenants: Iterable[TenantConfig] = ()) -> KeyTable:
        """``api_key``: the unnamed keys (comma-separated); ``tenants``: the tenants file's, each naming its tenant.
        Raises ValueError for a key that is both (it would name two tenants)."""
        unnamed = list(dict.fromkeys(split_api_keys(api_key)))
        named = [ApiKey(t.api_key, t.name) for t in tenants if t.api_key is not None]
        if set(unnamed) & {k.secret for k in named}:
            raise ValueError("a key of the tenants file is also given by --api-key, --api-key-file or "
                             "$PAGEDSERVE_API_KEY: each key names one tenant")
        return cls(tuple(ApiKey(k) for k in unnamed) + tuple(named))

    def __bool__(self) -> bool:
        return bool(self.keys)

    def match(self, *presented: str | None) -> int | None:
        """The index of the key among the ``presented`` credentials, None if none is one. Every key is compared
        with each (in constant time), whichever matches."""
        given = [p.encode() for p in presented if p]
        hits = [any([hmac.compare_digest(g, k.secret.encode()) for g in given]) for k in self.keys]
        return hits.index(True) if True in hits else None

    def tenant(self, index: int | None) -> str | None:
        """The tenant the key at ``index`` names (None: an unnamed key, or no key)."""
        return self.keys[index].tenant if index is not None else None
