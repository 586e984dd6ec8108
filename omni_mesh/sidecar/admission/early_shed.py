"""Shedding on a client request's headers alone, before its body is read.

Under overload most arrivals at an API server are refused; reading and decoding each one's
body first (and building its stage input, a span, an error object) costs the CPU the stages
need. :class:`EarlyShed` asks the pod's admission queue — without changing it — whether an
arrival would be shed (:meth:`~omni_mesh.sidecar.admission.queue.AdmissionQueue.refusal`),
knowing its class, tenant and deadline from its admission facts (``facts.py``: read once, kept
on the request for the route). The answer is the one the
body-time path gives (503, error type ``shed``, ``Retry-After``, ``X-Omni-Shed``), counted
in ``omni_stage_shed_total`` by reason and class, with no log line and no span.

Without the header the body's ``priority`` field may still ask for a higher class, so the
request is shed here only when even the highest class its route accepts would be; otherwise
(and whenever a header is malformed, so that the route answers its 400) it goes on as usual.
"""

from __future__ import annotations

import time
from json.encoder import encode_basestring

from aiohttp import web

from omni_mesh.sidecar.admission.admit import gate_of
from omni_mesh.sidecar.admission.facts import AdmissionFacts, admission_facts
from omni_mesh.sidecar.admission.queue import Priority, parse_priority
from omni_mesh.sidecar.hop.shed import SHED_HEADER, SHED_TYPE
from omni_mesh.sidecar.pod import Pod

#: The client routes whose requests are admitted as client requests (each has a body).
SHEDDABLE_ROUTES = frozenset(
    {
        "/v1/generate",
        "/v1/audio/speech",
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/images/generations",
    }
)

# The error shape of ``errors.error_response``, its message the only part that varies.
_BODY_HEAD = b'{"error":{"message":'
_BODY_TAIL = f',"type":"{SHED_TYPE}","param":null,"code":503}}}}'.encode()
_CONTENT_TYPE = "application/json; charset=utf-8"


class EarlyShed:
    """One pod's header-time admission check (see the module docstring)."""

    def __init__(self, pod: Pod) -> None:
        self.pod = pod
        caps = {str(route): classes for route, classes in pod.deploy.priority_classes.items()}
        self._accepted: dict[str, frozenset[Priority]] = {}
        self._top: dict[str, Priority] = {}
        for route in SHEDDABLE_ROUTES:
            names = caps.get(route)
            accepted = (
                frozenset(Priority) if names is None else frozenset(map(parse_priority, names))
            )
            self._accepted[route] = accepted
            self._top[route] = min(accepted, default=Priority.HIGH)

    def check(self, request: web.Request, route: str) -> web.Response | None:
        """The 503 for a request the gate would shed now; None to read it as usual."""
        pod = self.pod
        gate = pod.gate or gate_of(pod)
        queue = gate.queue
        if queue.idle or pod.draining:  # the common case: two attribute reads
            return None
        facts = admission_facts(pod, request)  # kept: the route reads them from here
        if facts.malformed:
            return None  # the route answers the 400 naming the header
        priority = self._priority(facts, route)
        if priority is None:
            return None
        now = time.monotonic()
        shed = queue.refusal(priority, facts.tenant, now + facts.timeout_s, now)
        if shed is None:
            return None
        gate.count_shed(shed.reason, priority)
        body = b"".join((_BODY_HEAD, encode_basestring(shed.message()).encode(), _BODY_TAIL))
        headers = {
            "Content-Type": _CONTENT_TYPE,
            "Retry-After": shed.retry_after_header,
            SHED_HEADER: shed.reason,
        }
        return web.Response(body=body, status=503, headers=headers)

    def _priority(self, facts: AdmissionFacts, route: str) -> Priority | None:
        """The class the check assumes: the header's, else the highest the route accepts (the
        body may ask for it); None when the header is not a class this route accepts."""
        if facts.priority is None:
            return self._top[route]
        return facts.priority if facts.priority in self._accepted[route] else None
