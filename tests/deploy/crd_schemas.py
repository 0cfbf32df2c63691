"""JSON schemas for the prometheus-operator kinds (monitoring.coreos.com/v1), which kubernetes-validate has no
schema for. Written by hand after the operator's CRDs, for the fields these manifests may use: field names and
types follow the CRDs, unknown fields fail (so a misspelt field is caught), but they cover a subset of the real
CRDs' fields, so a valid field not listed here also fails until it is added."""
from __future__ import annotations

DNS_NAME = {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$",
            "maxLength": 253}
DURATION = {"type": "string",
            "pattern": r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"}
STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
METADATA = {
    "type": "object", "required": ["name"], "additionalProperties": False,
    "properties": {"name": DNS_NAME, "namespace": DNS_NAME, "labels": STRING_MAP, "annotations": STRING_MAP},
}
LABEL_SELECTOR = {
    "type": "object", "additionalProperties": False,
    "properties": {
        "matchLabels": STRING_MAP,
        "matchExpressions": {"type": "array", "items": {
            "type": "object", "required": ["key", "operator"], "additionalProperties": False,
            "properties": {"key": {"type": "string"}, "operator": {"enum": ["In", "NotIn", "Exists", "DoesNotExist"]},
                           "values": {"type": "array", "items": {"type": "string"}}}}},
    },
}


def crd_object(kind: str, spec: dict) -> dict:
    return {
        "type": "object", "required": ["apiVersion", "kind", "metadata", "spec"], "additionalProperties": False,
        "properties": {"apiVersion": {"const": "monitoring.coreos.com/v1"}, "kind": {"const": kind},
                       "metadata": METADATA, "spec": spec},
    }


ENDPOINT = {
    "type": "object", "additionalProperties": False,
    "properties": {
        "port": {"type": "string"}, "targetPort": {"type": ["string", "integer"]}, "path": {"type": "string"},
        "scheme": {"enum": ["http", "https", "HTTP", "HTTPS"]}, "interval": DURATION, "scrapeTimeout": DURATION,
        "honorLabels": {"type": "boolean"}, "params": {"type": "object"},
        "relabelings": {"type": "array"}, "metricRelabelings": {"type": "array"},
        "authorization": {"type": "object"}, "tlsConfig": {"type": "object"},
    },
    "anyOf": [{"required": ["port"]}, {"required": ["targetPort"]}],
}
SERVICE_MONITOR = crd_object("ServiceMonitor", {
    "type": "object", "required": ["selector", "endpoints"], "additionalProperties": False,
    "properties": {
        "selector": LABEL_SELECTOR, "endpoints": {"type": "array", "minItems": 1, "items": ENDPOINT},
        "namespaceSelector": {"type": "object", "additionalProperties": False,
                              "properties": {"any": {"type": "boolean"},
                                             "matchNames": {"type": "array", "items": {"type": "string"}}}},
        "jobLabel": {"type": "string"}, "targetLabels": {"type": "array", "items": {"type": "string"}},
        "podTargetLabels": {"type": "array", "items": {"type": "string"}},
        "sampleLimit": {"type": "integer", "minimum": 0},
    },
})
RULE = {
    "type": "object", "required": ["expr"], "additionalProperties": False,
    "properties": {
        "alert": {"type": "string"}, "record": {"type": "string"}, "expr": {"type": ["string", "integer"]},
        "for": DURATION, "keep_firing_for": DURATION, "labels": STRING_MAP, "annotations": STRING_MAP,
    },
    "oneOf": [{"required": ["alert"]}, {"required": ["record"]}],
}
PROMETHEUS_RULE = crd_object("PrometheusRule", {
    "type": "object", "additionalProperties": False,
    "properties": {"groups": {"type": "array", "items": {
        "type": "object", "required": ["name"], "additionalProperties": False,
        "properties": {"name": {"type": "string", "minLength": 1}, "interval": DURATION, "query_offset": DURATION,
                       "limit": {"type": "integer"}, "partial_response_strategy": {"type": "string"},
                       "labels": STRING_MAP, "rules": {"type": "array", "items": RULE}},
    }}},
})
CRD_SCHEMAS = {("monitoring.coreos.com/v1", "ServiceMonitor"): SERVICE_MONITOR,
               ("monitoring.coreos.com/v1", "PrometheusRule"): PROMETHEUS_RULE}
