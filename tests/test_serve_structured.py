"""Structured output through ``power serve`` with the official ``openai`` client: ``response_format``
(``json_schema``, ``json_object``), llama-server's ``grammar`` and ``json_schema``, penalties and
``logit_bias``.

On the reference backend (fast): malformed or unsupported schemas, grammars and tools are
OpenAI-shaped 400s naming the field, and the server keeps serving. On SmolLM2: every output
validates against its schema, and ``--mode suffix`` answers exactly as ``--mode off`` does, greedy and
seeded, one request at a time and four at once; the same for penalties and biases."""

from __future__ import annotations

import concurrent.futures
import json
import re
import subprocess

import httpx
import jsonschema
import openai
import pytest

from tests.serve_helpers import ROOT, power_cmd, served

pytestmark = pytest.mark.slow

REF = ["--backend", "reference", "--mode", "ref-draft", "--n-ctx", "256"]
TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                     "properties": {"a": {"type": "integer"}}}}}


@pytest.fixture(scope="module")
def ref_server(tmp_path_factory):
    path = tmp_path_factory.mktemp("tpl") / "chat.jinja"
    path.write_text(TEMPLATE)
    with served(*REF, "--parallel", "2", "--chat-template", str(path)) as s:
        yield s


@pytest.fixture(scope="module")
def ref_client(ref_server):
    return openai.OpenAI(base_url=ref_server.base_url, api_key="unused", max_retries=0, timeout=60)


def _chat(**kw):
    return {"model": "M", "messages": [{"role": "user", "content": "x"}], "max_tokens": 4, **kw}


def _schema_format(schema):
    return {"type": "json_schema", "json_schema": {"name": "out", "schema": schema}}


BAD: list[tuple[str, dict, str, str]] = [
    # (path, body, the param the error names, its code)
    ("/v1/chat/completions", _chat(response_format=_schema_format({"type": "strange"})),
     "response_format.json_schema.schema", "invalid_schema"),
    ("/v1/chat/completions", _chat(response_format=_schema_format({"if": {"type": "string"}, "then": {}})),
     "response_format.json_schema.schema", "invalid_schema"),  # unsupported keywords: named, never ignored
    ("/v1/chat/completions", _chat(response_format=_schema_format({"not": {"type": "string"}})),
     "response_format.json_schema.schema", "invalid_schema"),
    ("/v1/chat/completions", _chat(response_format=_schema_format({"type": "string", "pattern": "(unclosed"})),
     "response_format.json_schema.schema", "invalid_schema"),
    ("/v1/chat/completions", _chat(response_format=_schema_format({"type": "integer", "minimum": 5, "maximum": 1})),
     "response_format.json_schema.schema", "invalid_schema"),
    ("/v1/chat/completions", _chat(response_format=_schema_format({"$ref": "#/defs/none"})),
     "response_format.json_schema.schema", "invalid_schema"),
    ("/v1/chat/completions", _chat(response_format=_schema_format([1, 2])),
     "response_format.json_schema.schema", "invalid_value"),
    ("/v1/chat/completions", _chat(response_format={"type": "json_schema", "json_schema": {"schema": {}}}),
     "response_format.json_schema.name", "missing_field"),
    ("/v1/chat/completions", _chat(response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
     "response_format.json_schema.schema", "missing_field"),
    ("/v1/chat/completions", _chat(response_format={"type": "xml"}), "response_format.type", "invalid_value"),
    ("/v1/chat/completions", _chat(response_format=_schema_format({"type": "object", "properties": {
        f"k{i}": {"type": "string", "description": "x" * 100} for i in range(800)}})),
     "response_format.json_schema.schema", "invalid_value"),  # bounded size
    ("/v1/chat/completions", _chat(grammar='root ::= "a" ('), "grammar", "invalid_grammar"),
    ("/v1/chat/completions", _chat(grammar="start: undefined_rule"), "grammar", "invalid_grammar"),
    ("/v1/chat/completions", _chat(grammar="root ::= " + '"a" ' * 20000), "grammar", "invalid_value"),
    ("/v1/chat/completions", _chat(json_schema={"type": "strange"}), "json_schema", "invalid_schema"),
    ("/v1/chat/completions", _chat(response_format={"type": "json_object"}, grammar='root ::= "a"'), "grammar",
     "conflicting_fields"),
    ("/v1/chat/completions", _chat(json_schema={"type": "object"}, grammar='root ::= "a"'), "grammar",
     "conflicting_fields"),
    ("/v1/chat/completions", _chat(tools=[TOOL]), "tools", "unsupported_value"),  # its template has no tools
    ("/v1/chat/completions", _chat(tools=[TOOL], response_format={"type": "json_object"}), "response_format",
     "conflicting_fields"),
    ("/v1/chat/completions", _chat(tools=[TOOL] * 129), "tools", "invalid_value"),
    ("/v1/chat/completions", _chat(tools=[TOOL, TOOL]), "tools[1].function.name", "invalid_value"),
    ("/v1/chat/completions", _chat(tools=[{"type": "function", "function": {"name": "no spaces"}}]),
     "tools[0].function.name", "invalid_value"),
    ("/v1/chat/completions", _chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "strange"}}}}}]), "tools[0].function.parameters",
     "invalid_schema"),
    ("/v1/chat/completions", _chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {
        "type": "array"}}}]), "tools[0].function.parameters", "invalid_schema"),
    ("/v1/chat/completions", _chat(tools=[{"type": "function", "function": {"name": "f", "strange": 1}}]),
     "tools[0].function.strange", "unsupported_field"),
    ("/v1/chat/completions", _chat(tools=[{"type": "code_interpreter"}]), "tools[0].type", "invalid_value"),
    ("/v1/chat/completions", _chat(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "g"}}),
     "tool_choice", "invalid_value"),
    ("/v1/chat/completions", _chat(tools=[TOOL], tool_choice="always"), "tool_choice", "invalid_value"),
    ("/v1/chat/completions", _chat(tool_choice="required"), "tool_choice", "invalid_value"),
    ("/v1/chat/completions", _chat(parallel_tool_calls=True), "parallel_tool_calls", "invalid_value"),
    ("/v1/chat/completions", {"model": "M", "messages": [{"role": "tool", "content": "1", "tool_call_id": "c9"}]},
     "messages[0].tool_call_id", "invalid_value"),
    ("/v1/completions", {"model": "M", "prompt": "x", "grammar": "root ::= [a-"}, "grammar", "invalid_grammar"),
    ("/v1/completions", {"model": "M", "prompt": "x", "json_schema": {"type": "object", "required": 5}},
     "json_schema", "invalid_schema"),
    ("/v1/completions", {"model": "M", "prompt": "x", "response_format": {"type": "json_object"}},
     "response_format", "unsupported_field"),
]


def test_malformed_or_unsupported_structure_is_a_400_naming_the_field(ref_server, ref_client):
    name = ref_client.models.list().data[0].id
    before = ref_client.completions.create(model=name, prompt="still fine", max_tokens=8)
    with httpx.Client(base_url=ref_server.url, timeout=60) as http:
        for path, body, param, code in BAD:
            body = {**body, "model": name}
            for stream in (False, True):  # a stream is refused before it begins
                r = http.post(path, json={**body, "stream": stream})
                assert r.status_code == 400, (body, r.status_code, r.text[:300])
                err = r.json()["error"]
                assert (err["param"], err["code"], err["type"]) == (param, code, "invalid_request_error"), err
                assert err["message"] and "Traceback" not in r.text
    after = ref_client.completions.create(model=name, prompt="still fine", max_tokens=8)
    assert after.model_extra["power"]["output_sha256"] == before.model_extra["power"]["output_sha256"]
    health = httpx.get(f"{ref_server.url}/health").json()
    assert health["status"] == "ok" and health["slots_idle"] == 2


def test_grammars_on_both_endpoints_and_the_receipt(ref_server, ref_client):
    name = ref_client.models.list().data[0].id
    got = ref_client.completions.create(model=name, prompt="answer", max_tokens=8,
                                        extra_body={"grammar": 'root ::= "yes" | "no"'})
    assert re.fullmatch(r"(yes|no)(<\|\d+\|>)?", got.choices[0].text)  # (the byte tokenizer spells its EOS)
    lark = ref_client.chat.completions.create(model=name, messages=[{"role": "user", "content": "n"}], max_tokens=12,
                                              extra_body={"grammar": 'start: /[0-9]{3}/ "!"'})
    text = lark.choices[0].message.content
    assert len(text) >= 4 and text[:3].isdigit() and text[3] == "!"
    receipt = httpx.get(f"{ref_server.url}/v1/receipts/{lark.id}").json()["receipt"]
    assert receipt["constraint"]["kind"] == "grammar" and len(receipt["constraint"]["digest"]) == 64
    streamed = "".join(c.choices[0].delta.content or "" for c in ref_client.chat.completions.create(
        model=name, messages=[{"role": "user", "content": "n"}], max_tokens=12, stream=True,
        extra_body={"grammar": 'start: /[0-9]{3}/ "!"'}) if c.choices)
    assert streamed == text


def test_power_run_takes_schema_grammar_and_regex_files_and_refuses_bad_ones(tmp_path):
    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(power_cmd("run", *REF, "--prompt", "x", "--max-tokens", "16", "--json", *args),
                              capture_output=True, text=True, timeout=120)

    schema = tmp_path / "s.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"n": {"type": "integer", "maximum": 999}},
                                  "required": ["n"], "additionalProperties": False,
                                  "x-guidance": {"whitespace_flexible": False}}))
    grammar = tmp_path / "g.gbnf"
    grammar.write_text('root ::= ("yes" | "no") "."\n')
    for args, check in [(["--json-schema", str(schema)], lambda t: json.loads(t)["n"] <= 999),
                        (["--grammar", str(grammar)], lambda t: t in ("yes.", "no.")),
                        (["--regex", "[0-9]{3}-[a-z]{2}", "--repeat-penalty", "1.2", "--frequency-penalty", "0.5",
                          "--presence-penalty", "0.1", "--repeat-last-n", "16"],
                         lambda t: re.fullmatch("[0-9]{3}-[a-z]{2}", t))]:
        out = run(*args)
        assert out.returncode == 0, out.stderr
        got = json.loads(out.stdout)
        text = re.sub(r"<\|\d+\|>$", "", got["text"])  # (the byte tokenizer spells its EOS)
        assert check(text), (args, got["text"])
        assert got["receipt"]["constraint"]["digest"]
    bad = tmp_path / "bad.gbnf"
    bad.write_text('root ::= "a" (')
    notjson = tmp_path / "bad.json"
    notjson.write_text("{not json")
    for args, flag in [(["--grammar", str(bad)], "--grammar"), (["--json-schema", str(notjson)], "--json-schema"),
                       (["--json-schema", str(tmp_path / "missing.json")], "--json-schema"),
                       (["--regex", "(unclosed"], "--regex")]:
        out = run(*args)
        assert out.returncode == 2, (args, out.stderr)
        assert f"error[constraint_invalid]: {flag}" in out.stderr and "Traceback" not in out.stderr


# -- SmolLM2: every output validates, and speculation equals target-only ------------------------------
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "email": {"type": "string", "pattern": "^[a-z.]+@[a-z]+\\.[a-z]{2,3}$"}},
    "required": ["name", "age", "email"], "additionalProperties": False}
CASES: list[tuple[str, dict]] = [
    ('Copy this record as JSON, exactly: {"name": "Ada Lovelace", "born": 1815, "fields": ["mathematics", '
     '"computing", "poetry"]}',
     {"type": "object", "properties": {
         "name": {"type": "string", "maxLength": 40}, "born": {"type": "integer"},
         "fields": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 4}},
      "required": ["name", "born", "fields"], "additionalProperties": False}),
    ("Extract the person as JSON: John Smith is 42 years old; write to john.smith@example.com.", PERSON),
    ("Extract the address as JSON: 221 Baker Street, London, postcode 12345. Tags: detective, fiction.",
     {"type": "object", "properties": {
         "address": {"type": "object", "properties": {
             "street": {"type": "string", "maxLength": 40}, "city": {"type": "string", "maxLength": 20},
             "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
             "required": ["street", "city", "zip"], "additionalProperties": False},
         "tags": {"type": "array", "items": {"type": "string", "maxLength": 16}, "minItems": 1, "maxItems": 3}},
      "required": ["address", "tags"], "additionalProperties": False}),
    ("Classify the sentiment of this review as JSON: 'The food was wonderful and the staff were kind.'",
     {"type": "object", "properties": {
         "sentiment": {"enum": ["positive", "negative", "neutral"]},
         "confidence": {"type": "number", "minimum": 0, "maximum": 1}},
      "required": ["sentiment", "confidence"], "additionalProperties": False}),
    ("What is 6 times 7? Answer as JSON with the field result.",
     {"type": "object", "properties": {"result": {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 12}]}},
      "required": ["result"], "additionalProperties": False}),
    ("Describe the film Casablanca (1942, drama) as JSON.",
     {"type": "object", "properties": {
         "title": {"type": "string", "maxLength": 30}, "year": {"type": "integer"},
         "genre": {"type": "string", "maxLength": 20}},
      "required": ["title"], "additionalProperties": False}),
    ("List the order lines as JSON: 2 of ABC-123 and 5 of XYZ-789.",
     {"type": "object", "properties": {"items": {"type": "array", "maxItems": 3, "items": {
         "type": "object", "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
                                          "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
         "required": ["sku", "qty"], "additionalProperties": False}}},
      "required": ["items"], "additionalProperties": False}),
]
SEEDED = {"temperature": 0.8, "seed": 7}


@pytest.fixture(scope="module")
def smollm2():
    pytest.importorskip("power_native")
    from tests.native.test_models import _model_path

    return _model_path("smollm2")


@pytest.fixture(scope="module")
def off(smollm2):
    with served("--model", smollm2, "--mode", "off", "--threads", "1") as s:
        yield openai.OpenAI(base_url=s.base_url, api_key="x", max_retries=0, timeout=600)


@pytest.fixture(scope="module")
def spec(smollm2):
    with served("--model", smollm2, "--mode", "suffix", "--threads", "1", "--parallel", "4") as s:
        yield openai.OpenAI(base_url=s.base_url, api_key="x", max_retries=0, timeout=600)


def _ask(client, prompt: str, schema: dict, **kw):
    name = client.models.list().data[0].id
    # the schema in the prompt too, as applications write it (the keys are there to copy)
    messages = [{"role": "system", "content": "Reply with JSON that matches this schema: " + json.dumps(schema)},
                {"role": "user", "content": prompt}]
    return client.chat.completions.create(model=name, messages=messages, max_tokens=96,
                                          response_format=_schema_format(schema), **kw)


def _valid(resp, schema: dict) -> str:
    text = resp.choices[0].message.content
    assert resp.choices[0].finish_reason == "stop", text
    jsonschema.validate(json.loads(text), schema)
    return text


@pytest.mark.native
@pytest.mark.model
@pytest.mark.parametrize("sampling", [{}, SEEDED], ids=["greedy", "seeded"])
def test_json_schema_outputs_validate_and_suffix_equals_off(off, spec, sampling):
    accepted = 0
    for prompt, schema in CASES:
        a, b = _ask(off, prompt, schema, **sampling), _ask(spec, prompt, schema, **sampling)
        assert _valid(b, schema) == _valid(a, schema), prompt
        assert b.model_extra["power"]["output_sha256"] == a.model_extra["power"]["output_sha256"]
        accepted += b.model_extra["power"]["proposed"]
    assert accepted > 0  # the proposer's drafts were verified under the constraint, not switched off


@pytest.mark.native
@pytest.mark.model
def test_four_concurrent_structured_requests_each_equal_their_solo_off_run(off, spec):
    jobs = [(p, s, kw) for p, s in CASES[:5] for kw in ({}, SEEDED)]
    solo = [_ask(off, p, s, **kw).choices[0].message.content for p, s, kw in jobs]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda job: _ask(spec, job[0], job[1], **job[2]), jobs))
    for (p, s, _), resp, want in zip(jobs, got, solo, strict=True):
        assert _valid(resp, s) == want, p


@pytest.mark.native
@pytest.mark.model
def test_json_object_and_llama_server_fields(off, spec):
    name = off.models.list().data[0].id
    msgs = [{"role": "user", "content": 'Reply with this JSON object: {"capital": "Paris", "country": "France"}'}]
    objects = [c.chat.completions.create(model=name, messages=msgs, max_tokens=48,
                                         response_format={"type": "json_object"}) for c in (off, spec)]
    text = objects[0].choices[0].message.content
    assert text.startswith("{") and objects[1].choices[0].message.content == text
    if objects[0].choices[0].finish_reason == "stop":  # (the small model may go on past max_tokens)
        assert isinstance(json.loads(text), dict)
    texts = [c.completions.create(model=name, prompt="The colour of the sky, as JSON:", max_tokens=48,
                                  extra_body={"json_schema": {"type": "object", "properties": {
                                      "colour": {"enum": ["blue", "grey", "red"]}}, "required": ["colour"],
                                      "additionalProperties": False}}).choices[0].text for c in (off, spec)]
    assert texts[0] == texts[1] and json.loads(texts[0])["colour"] in ("blue", "grey", "red")


@pytest.mark.native
@pytest.mark.model
def test_penalties_and_logit_bias_suffix_equals_off(off, spec, smollm2):
    name = off.models.list().data[0].id
    prompt = (ROOT / "docs" / "examples" / "code-edit.txt").read_text(encoding="utf-8")  # the answer copies it
    plain = off.completions.create(model=name, prompt=prompt, max_tokens=40).choices[0].text
    out = subprocess.run(power_cmd("run", "--model", smollm2, "--mode", "off", "--threads", "1", "--json",
                                   "--prompt-file", str(ROOT / "docs" / "examples" / "code-edit.txt"),
                                   "--max-tokens", "1"), capture_output=True, text=True, timeout=300)
    first = json.loads(out.stdout)["tokens"][0]
    settings = [
        {"frequency_penalty": 0.8, "presence_penalty": 0.5},
        {"extra_body": {"repeat_penalty": 1.3, "repeat_last_n": 32}},
        {"logit_bias": {str(first): -100.0}},
        {"frequency_penalty": 0.4, "logit_bias": {str(first): -100.0}, **SEEDED},
    ]
    accepted, changed = 0, 0
    for kw in settings:
        a = off.completions.create(model=name, prompt=prompt, max_tokens=40, **kw)
        b = spec.completions.create(model=name, prompt=prompt, max_tokens=40, **kw)
        assert b.choices[0].text == a.choices[0].text, kw
        assert b.model_extra["power"]["output_sha256"] == a.model_extra["power"]["output_sha256"]
        accepted += b.model_extra["power"]["accepted"]
        changed += a.choices[0].text != plain
    assert accepted > 0  # drafts were verified under the penalties
    assert changed >= 3  # they took effect (the banned first token, the strong repeat penalty at least)
