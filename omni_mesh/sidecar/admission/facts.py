"""What admission needs to know of a client request, read from its headers once.

A client request's class (``X-Omni-Priority``), tenant (``X-Omni-Tenant``, else a hash of its
API key) and deadline budget (``X-Omni-Timeout-S``, else the deploy config's) are read in one
call, :func:`admission_facts`, the first time anything asks — the header-time shed check
(``early_shed.py``) or the entry step of the route (``api/client_requests.py``) — and kept on
the request, so a request's way through the pod reads its headers once. A malformed header is
kept as its 400, answered by the route (the shed check lets such a request through).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

from aiohttp import web

from omni_mesh.data_plane.messages import PriorityClass
from omni_mesh.sidecar.admission.queue import Priority, parse_priority
from omni_mesh.sidecar.deadlines import TIMEOUT_HEADER, request_timeout
from omni_mesh.sidecar.errors import ApiError, bad_request
from omni_mesh.sidecar.pod import Pod

PRIORITY_HEADER = "X-Omni-Priority"
TENANT_HEADER = "X-Omni-Tenant"
PRIORITY_NAMES_TYPED: tuple[PriorityClass, ...] = ("high", "normal", "low")
_TENANT = re.compile(r"[\w.:\-]{1,64}")


#: A malformed header's 400: (message, the header it names); raised anew at every use.
Bad = tuple[str, str]


@dataclass(frozen=True, slots=True)
class AdmissionFacts:
    """A client request's admission facts (see the module docstring). ``priority`` is the
    header's class, None when the header is absent (the body may ask for one); each ``*_error``
    is what the 400 of its malformed header says."""

    priority: Priority | None
    tenant: str
    timeout_s: float
    priority_error: Bad | None = None
    tenant_error: Bad | None = None
    timeout_error: Bad | None = None

    @property
    def malformed(self) -> bool:
        return bool(self.priority_error or self.tenant_error or self.timeout_error)

    def resolve(
        self, pod: Pod, route: str, body_priority: PriorityClass | None
    ) -> tuple[PriorityClass, str, float]:
        """The request's class, tenant and deadline budget: the header's class, else
        ``priority`` in its body, else normal (on every route the header wins, so a gateway in
        front can set the class); 400 naming the header or field that is malformed or a class
        the route does not accept (``priority_classes`` in the deploy config)."""
        if self.priority_error is not None:
            raise bad_request(*self.priority_error)
        priority: PriorityClass = "normal"
        if self.priority is not None:
            priority = PRIORITY_NAMES_TYPED[self.priority]
        elif body_priority is not None:
            priority = body_priority
        caps = {str(k): v for k, v in pod.deploy.priority_classes.items()}
        allowed = caps.get(route)
        if allowed is not None and priority not in allowed:
            raise bad_request(
                f"priority: {priority!r} is not accepted on {route} "
                f"(accepted: {', '.join(allowed)})",
                "priority",
            )
        if self.tenant_error is not None:
            raise bad_request(*self.tenant_error)
        return priority, self.tenant, self.budget_s()

    def budget_s(self) -> float:
        """The deadline budget (400 naming ``X-Omni-Timeout-S`` when it is malformed)."""
        if self.timeout_error is not None:
            raise bad_request(*self.timeout_error)
        return self.timeout_s


_FACTS = web.RequestKey("omni_admission_facts", AdmissionFacts)


def admission_facts(pod: Pod, request: web.Request) -> AdmissionFacts:
    """The request's admission facts, read from its headers on the first call."""
    facts = request.get(_FACTS)
    if facts is None:
        facts = request[_FACTS] = _read(pod, request)
    return facts


def _read(pod: Pod, request: web.Request) -> AdmissionFacts:
    priority: Priority | None = None
    priority_error: Bad | None = None
    tenant_error: Bad | None = None
    timeout_error: Bad | None = None
    raw = request.headers.get(PRIORITY_HEADER)
    if raw is not None:
        try:
            priority = parse_priority(raw)
        except ValueError as exc:
            priority_error = (f"{PRIORITY_HEADER}: {exc}", PRIORITY_HEADER)
    tenant = ""
    try:
        tenant = request_tenant(request)
    except ApiError as exc:
        tenant_error = (exc.message, TENANT_HEADER)
    timeout_s = pod.request_timeout_s()
    if TIMEOUT_HEADER in request.headers:
        try:
            timeout_s = request_timeout(pod, request)
        except ApiError as exc:
            timeout_error = (exc.message, TIMEOUT_HEADER)
    return AdmissionFacts(priority, tenant, timeout_s, priority_error, tenant_error, timeout_error)


def request_class(
    pod: Pod, request: web.Request, body_priority: PriorityClass | None = None
) -> tuple[PriorityClass, str]:
    """A client request's priority class and tenant (:meth:`AdmissionFacts.resolve` on its
    path)."""
    priority, tenant, _ = admission_facts(pod, request).resolve(pod, request.path, body_priority)
    return priority, tenant


def request_tenant(request: web.Request) -> str:
    """A client request's tenant: ``X-Omni-Tenant`` (400 when malformed), else a hash of its
    API key (never the key itself), else anonymous ('')."""
    tenant = request.headers.get(TENANT_HEADER, "").strip()
    if tenant:
        if not _TENANT.fullmatch(tenant):
            raise bad_request(
                f"{TENANT_HEADER}: 1 to 64 characters of letters, digits and ._:-",
                TENANT_HEADER,
            )
        return tenant
    auth = request.headers.get("Authorization", "")
    scheme, _, key = auth.partition(" ")
    if scheme.lower() == "bearer" and key.strip():
        return "key-" + hashlib.sha256(key.strip().encode()).hexdigest()[:16]
    return ""
