"""Tenants as a label value: the first :data:`MAX_TENANT_LABELS` a process sees keep their
name, later ones count as ``other`` (a client inventing tenants, ``X-Omni-Tenant``, cannot
grow a process's series without bound); requests without a tenant are ``anonymous``."""

from __future__ import annotations

import threading

MAX_TENANT_LABELS = 100
ANONYMOUS = "anonymous"
OTHER = "other"


class TenantLabels:
    """The tenant label values of one process (module docstring)."""

    def __init__(self, limit: int = MAX_TENANT_LABELS) -> None:
        self.limit = limit
        self._seen: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self, tenant: str) -> str:
        name = tenant or ANONYMOUS
        with self._lock:
            if name in self._seen:
                return name
            if len(self._seen) >= self.limit:
                return OTHER
            self._seen.add(name)
            return name
