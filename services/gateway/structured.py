"""A request's structured-output constraint, from OpenAI's `response_format` or vLLM's `guided_*` /
`structured_outputs` fields, as the grammar its engine samples under (`common/engine/grammar.py`).

  response_format {"type": "json_object"}                           any JSON object
                  {"type": "json_schema", "json_schema": {"schema"}}  JSON matching the schema (with "strict": true,
                                                                      an object takes no keys its schema leaves out)
  guided_json / structured_outputs.json   (a schema, or its JSON text)  as json_schema
  guided_regex / structured_outputs.regex                               text matching the regular expression
  guided_choice / structured_outputs.choice (a list of strings)         exactly one of them

At most one per request; one that cannot be followed (an unknown JSON-schema type, a bad regex) is a 400 that says
why, before anything is queued.
"""

from __future__ import annotations

import json
import re

from common.engine.grammar import GrammarRejected, json_schema_grammar, regex_grammar
from services.gateway.errors import ApiError


def parse_grammar(body: dict, tools_grammar: str | None = None) -> str | None:
    """The grammar of the request's constraint, or None (no constraint). `tools_grammar`: a tool-calling answer's
    (`tools.tool_grammar`), which counts as one."""
    found = [(name, value) for name, value in _constraints(body) if value is not None]
    if tools_grammar is not None:
        found.insert(0, ("tool_choice", tools_grammar))
    if len(found) > 1:
        raise ApiError(
            400,
            f"a request takes one structured-output constraint; it has {', '.join(n for n, _ in found)}",
            found[1][0],
        )
    if not found:
        return None
    name, value = found[0]
    if name == "tool_choice":
        return value
    try:
        if name == "response_format":
            return _response_format(value)
        kind = name.rsplit(".", 1)[-1].removeprefix("guided_")
        if kind == "json":
            return json_schema_grammar(_schema(value, name))
        if kind == "regex":
            if not isinstance(value, str) or not value:
                raise ApiError(400, f"'{name}' must be a non-empty regular expression", name)
            return regex_grammar(value)
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise ApiError(400, f"'{name}' must be a non-empty list of non-empty strings", name)
        return regex_grammar("|".join(re.escape(c) for c in value))
    except GrammarRejected as e:
        raise ApiError(400, f"'{name}' cannot be followed: {e}", name) from None


def _constraints(body: dict):
    response_format = body.get("response_format")
    yield "response_format", None if response_format in (None, {"type": "text"}) else response_format
    for kind in ("json", "regex", "choice"):
        yield f"guided_{kind}", body.get(f"guided_{kind}")
    outputs = body.get("structured_outputs")
    if outputs is not None and not isinstance(outputs, dict):
        raise ApiError(400, "'structured_outputs' must be an object (json, regex or choice)", "structured_outputs")
    unknown = sorted(set(outputs or {}) - {"json", "regex", "choice"})
    if unknown:
        raise ApiError(
            400,
            f"structured_outputs.{unknown[0]} is not supported by this server (json, regex or choice)",
            "structured_outputs",
        )
    for kind in ("json", "regex", "choice"):
        yield f"structured_outputs.{kind}", (outputs or {}).get(kind)


def _response_format(value) -> str:
    if not isinstance(value, dict):
        raise ApiError(400, "'response_format' must be an object with a 'type'", "response_format")
    kind = value.get("type")
    if kind == "json_object":
        return json_schema_grammar({"type": "object"})
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict):
            raise ApiError(
                400, "response_format.json_schema must be an object with the schema in 'schema'", "response_format"
            )
        schema = _schema(spec.get("schema", {}), "response_format.json_schema.schema")
        return json_schema_grammar(strict_schema(schema) if spec.get("strict") is True else schema)
    raise ApiError(
        400, f"response_format type {kind!r} is not supported: send text, json_object or json_schema", "response_format"
    )


def _schema(value, name: str) -> dict:
    if isinstance(value, str):  # vLLM takes a schema's JSON text too
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ApiError(400, f"'{name}' is not valid JSON: {e}", name) from None
    if not isinstance(value, dict):
        raise ApiError(400, f"'{name}' must be a JSON schema (an object)", name)
    return value


def strict_schema(node):
    """A copy of a schema in which every object that does not say whether it takes other keys takes none
    (`"additionalProperties": false`), as OpenAI's strict mode asks."""
    if isinstance(node, dict):
        out = {key: strict_schema(value) for key, value in node.items()}
        if (
            out.get("type") == "object" or isinstance(out.get("properties"), dict)
        ) and "additionalProperties" not in out:
            out["additionalProperties"] = False
        return out
    if isinstance(node, list):
        return [strict_schema(value) for value in node]
    return node
