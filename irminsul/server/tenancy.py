"""Who a request is, from its bearer key: its tenant, its cache namespace, its share of the worker
threads, and whether it may publish to the namespace every tenant reads.

The server and the fleet's ingress decide by this one policy (the ingress checks a key before it
reads a body, and fingerprints a prompt in the namespace its replica will store it in). It reads
only the config: no model, no engine.
"""

from __future__ import annotations

import hmac

from irminsul.server.config import ServerConfig
from irminsul.server.errors import APIError


def bearer(request) -> str:
    """The request's `Authorization: Bearer <key>`, "" when it sends none."""
    auth = request.headers.get("authorization", "")
    return auth[7:].strip() if auth[:7].lower() == "bearer " else ""


class Tenancy:
    """The API keys' tenants (--api-key), the admin key (--admin-key) and the namespaces they name."""

    def __init__(self, config: ServerConfig):
        self.tenants, self.admin_key = config.tenants, config.admin_key

    def key_tenant(self, request) -> str | None:
        """The API key's namespace ("key:<tenant>"), None when the server has no keys; a 401 when it
        has and the request brings none of them. Called before the body is read, so nobody without a
        key can make the server parse one."""
        if not self.tenants:
            return None
        key = bearer(request)
        match = next((t for k, t in self.tenants.items() if hmac.compare_digest(k, key)), None)
        if match is None:
            raise APIError(
                401, "missing or unknown API key; send 'Authorization: Bearer <key>'", code="invalid_api_key"
            )
        return f"key:{match}"

    def tenant_of(self, request, cache_salt: str | None) -> str | None:
        """The request's cache namespace: the API key's tenant, subdivided by cache_salt.

        Names are prefixed ("key:", "salt:"), so no request can name another kind of namespace,
        and never the operator's shared one (kvcache.namespaces.SHARED).
        """
        tenant = self.key_tenant(request)
        if cache_salt is not None:
            tenant = f"{tenant or ''}|salt:{cache_salt}"
        return tenant

    def share_of(self, request) -> str:
        """Whose share of the worker threads a request's preparation takes (workers.py): its API
        key's tenant (checked before: key_tenant), or without keys its client's address."""
        tenant = self.key_tenant(request)
        return tenant if tenant is not None else f"host:{request.client.host if request.client else ''}"

    def check_admin(self, request) -> None:
        """Publishing fills the namespace every tenant reads: only the operator's key may do it."""
        if self.admin_key is None:
            raise APIError(403, "publishing is disabled: start the server with --admin-key to publish shared chunks")
        if not hmac.compare_digest(self.admin_key, bearer(request)):
            raise APIError(403, "publishing shared chunks needs the admin key (--admin-key)")
