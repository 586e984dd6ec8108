"""A JSON schema of KEDA's ``ScaledObject`` (keda.sh/v1alpha1), written from KEDA's documented
fields (keda.sh/docs/2.x/reference/scaledobject-spec and the Prometheus scaler page), since
kubernetes-validate bundles only core Kubernetes schemas. Strict like kubectl's: an unknown
field anywhere is an error. ``advanced.horizontalPodAutoscalerConfig.behavior`` is the HPA's own
``behavior`` and is checked separately against the core schema."""

from __future__ import annotations

from typing import Any

_INT = {"type": "integer", "minimum": 0}
_STR = {"type": "string"}
_NAME = {"type": "string", "pattern": "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", "maxLength": 253}

_METADATA = {
    "type": "object",
    "required": ["name"],
    "properties": {
        "name": _NAME,
        "namespace": _NAME,
        "labels": {"type": "object", "additionalProperties": _STR},
        "annotations": {"type": "object", "additionalProperties": _STR},
    },
    "additionalProperties": False,
}

#: The Prometheus scaler's metadata (every value a string, as in every KEDA trigger).
PROMETHEUS_METADATA = {
    "type": "object",
    "required": ["serverAddress", "query", "threshold"],
    "properties": {
        "serverAddress": {"type": "string", "pattern": "^https?://"},
        "query": _STR,
        "threshold": {"type": "string", "pattern": r"^[0-9]+(\.[0-9]+)?$"},
        "activationThreshold": {"type": "string", "pattern": r"^[0-9]+(\.[0-9]+)?$"},
        "namespace": _STR,
        "customHeaders": _STR,
        "ignoreNullValues": {"enum": ["true", "false"]},
        "queryParameters": _STR,
        "unsafeSsl": {"enum": ["true", "false"]},
        "timeout": _STR,
    },
    "additionalProperties": False,
}

_TRIGGER = {
    "type": "object",
    "required": ["type", "metadata"],
    "properties": {
        "type": {"const": "prometheus"},  # the only scaler these manifests use
        "name": _STR,
        "metricType": {"enum": ["AverageValue", "Value", "Utilization"]},
        "useCachedMetrics": {"type": "boolean"},
        "metadata": PROMETHEUS_METADATA,
        "authenticationRef": {
            "type": "object",
            "required": ["name"],
            "properties": {"name": _STR, "kind": {"enum": ["TriggerAuthentication",
                                                           "ClusterTriggerAuthentication"]}},
            "additionalProperties": False,
        },
    },
    "additionalProperties": False,
}  # fmt: skip

SCALED_OBJECT: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "keda.sh/v1alpha1"},
        "kind": {"const": "ScaledObject"},
        "metadata": _METADATA,
        "spec": {
            "type": "object",
            "required": ["scaleTargetRef", "triggers"],
            "properties": {
                "scaleTargetRef": {
                    "type": "object",
                    "required": ["name"],
                    "properties": {
                        "name": _NAME,
                        "apiVersion": _STR,
                        "kind": _STR,
                        "envSourceContainerName": _STR,
                    },
                    "additionalProperties": False,
                },
                "pollingInterval": _INT,
                "cooldownPeriod": _INT,
                "initialCooldownPeriod": _INT,
                "idleReplicaCount": _INT,
                "minReplicaCount": _INT,
                "maxReplicaCount": {"type": "integer", "minimum": 1},
                "fallback": {
                    "type": "object",
                    "required": ["failureThreshold", "replicas"],
                    "properties": {"failureThreshold": _INT, "replicas": _INT},
                    "additionalProperties": False,
                },
                "advanced": {
                    "type": "object",
                    "properties": {
                        "restoreToOriginalReplicaCount": {"type": "boolean"},
                        "horizontalPodAutoscalerConfig": {
                            "type": "object",
                            "properties": {"name": _NAME, "behavior": {"type": "object"}},
                            "additionalProperties": False,
                        },
                    },
                    "additionalProperties": False,
                },
                "triggers": {"type": "array", "minItems": 1, "items": _TRIGGER},
            },
            "additionalProperties": False,
        },
    },
    "additionalProperties": False,
}
