"""The OpenAPI document at /openapi.json, with the request bodies the endpoints read themselves.

The completion endpoints parse their bodies by hand (server/request_body.py: a size
bound and OpenAI-style errors before pydantic), so FastAPI does not see the models;
they are added here, so that /docs and generated clients (and the schema-driven tests
in tests/reliability/) know what a request looks like.
"""
from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

REF_TEMPLATE = "#/components/schemas/{model}"


def document_request_bodies(app: FastAPI, bodies: dict[str, type[BaseModel]]) -> None:
    """Make APP's OpenAPI document give BODIES[path] as the JSON request body of each POST path."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for path, model in bodies.items():
                definition = model.model_json_schema(ref_template=REF_TEMPLATE)
                components.update(definition.pop("$defs", {}))
                components[model.__name__] = definition
                schema["paths"][path]["post"]["requestBody"] = {
                    "required": True,
                    "content": {"application/json": {"schema": {"$ref": REF_TEMPLATE.format(model=model.__name__)}}},
                }
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
