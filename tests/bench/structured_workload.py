"""The structured-output workload: a dozen JSON schemas and prompts that invite copying.

Each task gives a record in prose or in JSON and asks for it as JSON of the schema: what an agent's
extraction and tool-argument traffic looks like (keys and values copied from the prompt). The
schemas cover nested objects, enums, arrays with bounds, string patterns, ``anyOf`` and optional
fields. ``tests/native/test_constraint_models.py`` checks exactness on them, and
``tests/bench/bench_structured.py`` (``nox -s bench_structured``) measures them.
"""

from __future__ import annotations

import json
from typing import Any

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "email": {"type": "string"}},
          "required": ["name", "age"], "additionalProperties": False}
ORDER = {"type": "object", "properties": {
    "order_id": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{4}$"},
    "status": {"enum": ["pending", "shipped", "delivered"]},
    "items": {"type": "array", "minItems": 1, "maxItems": 4, "items": {
        "type": "object", "properties": {"sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1}},
        "required": ["sku", "qty"], "additionalProperties": False}}},
    "required": ["order_id", "status", "items"], "additionalProperties": False}
ADDRESS = {"type": "object", "properties": {
    "street": {"type": "string"}, "city": {"type": "string"},
    "country": {"type": "string", "minLength": 2, "maxLength": 2},
    "geo": {"type": "object", "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}},
            "required": ["lat", "lon"], "additionalProperties": False}},
    "required": ["street", "city", "country"], "additionalProperties": False}
TAGS = {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 2, "maxItems": 5}
EVENT = {"type": "object", "properties": {
    "title": {"type": "string"}, "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
    "attendees": {"type": "array", "items": {"type": "string"}, "maxItems": 4}},
    "required": ["title", "date"], "additionalProperties": False}
MEASURE = {"type": "object", "properties": {
    "value": {"anyOf": [{"type": "number"}, {"type": "null"}]},
    "unit": {"enum": ["kg", "g", "lb"]}}, "required": ["value", "unit"], "additionalProperties": False}
TOOL_ARGS = {"type": "object", "properties": {
    "path": {"type": "string"}, "line": {"type": "integer"},
    "replacement": {"type": "string"}}, "required": ["path", "line", "replacement"], "additionalProperties": False}
REVIEW = {"type": "object", "properties": {
    "rating": {"type": "integer", "minimum": 1, "maximum": 5}, "pros": {"type": "array", "items": {"type": "string"},
                                                                       "maxItems": 3},
    "cons": {"type": "array", "items": {"type": "string"}, "maxItems": 3}, "verdict": {"type": "string"}},
    "required": ["rating", "verdict"], "additionalProperties": False}
FLAGS = {"type": "object", "properties": {"debug": {"type": "boolean"}, "verbose": {"type": "boolean"},
                                          "level": {"enum": ["low", "mid", "high"]}},
         "required": ["debug", "level"], "additionalProperties": False}
MATRIX = {"type": "array", "items": {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 3},
          "minItems": 2, "maxItems": 3}
CONTACT = {"type": "object", "properties": {
    "name": {"type": "string"},
    "phone": {"anyOf": [{"type": "string", "pattern": "^\\+[0-9]{6,12}$"}, {"type": "null"}]},
    "company": {"type": "object", "properties": {"name": {"type": "string"}, "size": {"type": "integer"}},
                "required": ["name"], "additionalProperties": False}},
    "required": ["name", "company"], "additionalProperties": False}
SIGNUP = {"type": "object", "properties": {
    "username": {"type": "string", "pattern": "^[a-z][a-z0-9_]{2,15}$"},
    "plan": {"enum": ["free", "pro", "team"]}, "seats": {"type": "integer", "minimum": 1, "maximum": 50},
    "referrer": {"type": "string"}}, "required": ["username", "plan"], "additionalProperties": False}

#: name -> (schema, the record the prompt gives)
TASKS: dict[str, tuple[dict[str, Any], Any]] = {
    "person": (PERSON, {"name": "Ada Lovelace", "age": 36, "email": "ada@example.org"}),
    "order": (ORDER, {"order_id": "AB-1234", "status": "shipped",
                      "items": [{"sku": "pen-blue", "qty": 3}, {"sku": "notebook-a5", "qty": 1}]}),
    "address": (ADDRESS, {"street": "12 Rue de Rivoli", "city": "Paris", "country": "FR",
                          "geo": {"lat": 48.85, "lon": 2.35}}),
    "tags": (TAGS, ["python", "llama", "json", "speed"]),
    "event": (EVENT, {"title": "Release review", "date": "2026-12-02", "attendees": ["Kim", "Lee", "Ola"]}),
    "measure": (MEASURE, {"value": 2.5, "unit": "kg"}),
    "tool_args": (TOOL_ARGS, {"path": "src/app/main.py", "line": 42, "replacement": "return total / count"}),
    "review": (REVIEW, {"rating": 4, "pros": ["fast", "exact"], "cons": ["new"], "verdict": "recommended"}),
    "flags": (FLAGS, {"debug": True, "verbose": False, "level": "mid"}),
    "matrix": (MATRIX, [[1, 2, 3], [4, 5, 6]]),
    "contact": (CONTACT, {"name": "Sam Berg", "phone": "+4712345678", "company": {"name": "Fjord AS", "size": 40}}),
    "signup": (SIGNUP, {"username": "sam_berg", "plan": "pro", "seats": 5, "referrer": "newsletter"}),
}


def prompt(name: str) -> str:
    """The task's prompt: the record twice (once in an example), then the request to repeat it."""
    schema, record = TASKS[name]
    shown = json.dumps(record)
    return (f"Convert the record to JSON matching this schema.\nSchema: {json.dumps(schema)}\n"
            f"Record: {shown}\nJSON: {shown}\n\nConvert the record to JSON again.\nRecord: {shown}\nJSON: ")
