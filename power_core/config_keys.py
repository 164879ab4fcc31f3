"""The configuration's keys: :class:`ConfigKey` (one validation machinery), the core's keys in one table
(:data:`CORE_KEYS`), and the keys the strategies declare, entered here when the plugin manager registers them.

Every key is a :class:`ConfigKey`: its name, type, range, default, scope, CLI flag, help and owner. The
core declares the keys of the session, the transaction, the scheduler and the sampler
(:data:`CORE_KEYS`); each strategy declares its own (:attr:`power_core.spec.Strategy.config_keys`), and
the plugin manager enters them here when it registers the strategy. Both are validated by
:meth:`ConfigKey.check`, so a bad value of any key raises the same
:class:`~power_core.errors.ConfigError` naming the key, the value and the allowed range.

A key's *scope* says when it may change: ``session`` keys are fixed when a session opens, ``request``
keys may be set by one request (:data:`REQUEST_KEYS`), the session's value being its requests' default.

:mod:`power_core.config` builds :class:`~power_core.config.PowerConfig` from these keys and is their public
path (plugins import them from there).
"""

from __future__ import annotations

import difflib
import json
import math
import re
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal

import attrs

from power_core.errors import ConfigError, PluginError

__all__ = ["ConfigKey", "CORE_KEYS", "CORE_BY_NAME", "CORE_ALIASES", "CORE_OWNERS", "REQUEST_KEYS", "SAMPLING_KEYS",
           "SCOPES", "MODE_AUTO", "MODE_OFF", "MODE_NAME_RE", "NUMERICS", "FLASH_ATTN", "VERIFY_CAPACITY_MAX",
           "SAMPLING_IN_GRAPH", "STOP_MAX", "LOGPROBS_MAX", "DEFAULT_DRAFT_MAX", "config_table", "declare_keys",
           "declared_keys", "canonical_keys", "device_names", "key_owners", "parse_endpoint", "set_key_loader", "strategy_key",
           "unknown_key"]

#: spec_mode names the core reserves for itself (every other mode is a registered strategy's name)
MODE_AUTO, MODE_OFF = "auto", "off"
MODE_NAME_RE = re.compile(r"^[a-z][a-z0-9_.-]{0,63}$")
KEY_NAME_RE = re.compile(r"^[a-z][a-z0-9_]{0,63}$")

K_MAX = 64
S_MAX = 64
#: K when neither the configuration nor the strategy says (suits model-backed drafters)
DEFAULT_DRAFT_MAX = 7
#: values of the ``numerics`` key (what each means is the backend's; see power-native's target)
NUMERICS = ("exact", "stock")
#: values of the ``flash_attn`` key (llama.cpp's flash_attn_type: ``auto`` lets it decide per device)
FLASH_ATTN = ("auto", "on", "off")
#: the widest ``verify_capacity`` (tokens per padded target pass)
VERIFY_CAPACITY_MAX = 256
#: values of the ``sampling_in_graph`` key
SAMPLING_IN_GRAPH = ("auto", "on", "off")
#: at most this many stop strings per request (every commit checks each; OpenAI allows 4), in the library and the server
STOP_MAX = 16
#: at most this many alternatives per emitted token (``logprobs``; OpenAI: completions 5, chat 20)
LOGPROBS_MAX = 20
#: the token biases one request may give
LOGIT_BIAS_MAX = 1024

Scope = Literal["session", "request"]
#: when a key may change, widest last: fixed at open, per request
SCOPES: tuple[str, ...] = ("session", "request")
#: the core components that own core keys (a strategy's keys are owned by the strategies declaring them)
CORE_OWNERS: tuple[str, ...] = ("session", "transaction", "scheduler", "sampler")


# -- the machinery ---------------------------------------------------------------------------------
def _check_key_name(inst: Any, attr: attrs.Attribute, value: Any) -> None:
    if not isinstance(value, str) or not KEY_NAME_RE.match(value):
        raise PluginError(f"ConfigKey.name={value!r}: expected a lowercase key name matching [a-z][a-z0-9_]*")


def _check_flag(inst: Any, attr: attrs.Attribute, value: Any) -> None:
    if value is not None and (not isinstance(value, str) or not re.match(r"^--[a-z][a-z0-9-]*$", value)):
        raise PluginError(f"ConfigKey {inst.name!r}: flag={value!r}, expected None or a long option like "
                          "'--my-key'")


def _check_scope(inst: Any, attr: attrs.Attribute, value: Any) -> None:
    if value not in SCOPES:
        raise PluginError(f"ConfigKey {inst.name!r}: scope={value!r}, expected one of {', '.join(SCOPES)}")


def _number(value: Any) -> str:
    return repr(value) if isinstance(value, float) else str(value)


@attrs.frozen
class ConfigKey:
    """One configuration key: what a TOML file, a keyword argument or a CLI flag may set.

    ``type`` is ``int``, ``float``, ``bool`` or ``str`` (with ``choices``), or ``tuple`` for a core key
    with its own ``convert``/``validate``. ``lo``/``hi`` bound a number (``lo_open``/``hi_open``
    exclude the bound), ``optional`` admits ``None`` (unset), ``hint`` is appended to every error.
    ``scope`` is when it may change (:data:`SCOPES`), ``flag`` its ``power run``/``power serve`` option,
    ``owner`` the core component for a core key (a strategy's key leaves it empty: the strategies that
    declare it own it, :func:`key_owners`). ``serve_default`` is the key's default under ``power serve``
    where that differs (``None``: ``default`` there too): a server outlives its requests, so what
    learns across them (a cross-request memory) pays there, not in a library session that may answer once.
    """

    name: str = attrs.field(validator=_check_key_name)
    type: type
    default: Any = None
    help: str = ""
    scope: Scope = attrs.field(default="session", validator=_check_scope)
    flag: str | None = attrs.field(default=None, validator=_check_flag)
    owner: str = ""
    lo: int | float | None = None
    hi: int | float | None = None
    lo_open: bool = False
    hi_open: bool = False
    choices: tuple[str, ...] = ()
    optional: bool = False
    hint: str = ""
    #: what a value is turned into before validation (e.g. ``"a,b"`` -> ``("a", "b")``)
    convert: Callable[[Any], Any] | None = attrs.field(default=None, eq=False)
    #: replaces the type/range check: ``(key, value) -> None`` or :class:`ConfigError`
    validate: Callable[[ConfigKey, Any], None] | None = attrs.field(default=None, eq=False)
    #: the default under ``power serve``, where it differs from ``default`` (``None``: the same)
    serve_default: Any = None
    #: earlier names of a core key, still taken wherever a key is (:func:`canonical_keys`); reads by one of
    #: them answer the key's value. The seed named two keys that serve every strategy after MTP.
    aliases: tuple[str, ...] = ()

    def __attrs_post_init__(self) -> None:
        if self.type not in (int, float, bool, str, tuple):
            raise PluginError(f"ConfigKey {self.name!r}: type={self.type!r}, expected int, float, bool or str")
        if self.type is tuple and self.validate is None:
            raise PluginError(f"ConfigKey {self.name!r}: a tuple-valued key needs its own validate=")
        if self.default is not None or not self.optional:
            try:
                self.check(self.default)
            except ConfigError as exc:
                raise PluginError(f"ConfigKey {self.name!r}: its default is invalid ({exc})") from None
        if self.serve_default is not None:
            try:
                self.check(self.serve_default)
            except ConfigError as exc:
                raise PluginError(f"ConfigKey {self.name!r}: its serve_default is invalid ({exc})") from None

    def allowed(self) -> str:
        """The accepted values in words (the ``allowed`` of the :class:`ConfigError`)."""
        if self.type is bool:
            text = "true or false"
        elif self.choices:
            text = f"one of {', '.join(repr(c) for c in self.choices)}"
        elif self.type is int:
            lo, hi = self.lo if self.lo is not None else 0, self.hi
            text = f"an integer in [{lo}, {hi}]" if hi is not None else f"an integer >= {lo}"
        elif self.type is float:
            text = (f"a number in {'(' if self.lo_open else '['}{_number(self.lo)}, {_number(self.hi)}"
                    f"{')' if self.hi_open else ']'}")
        else:
            text = "a string"
        return text

    def _ok(self, value: Any) -> bool:
        if self.type is bool:
            return isinstance(value, bool)
        if self.choices:
            return value in self.choices
        if self.type is str:
            return isinstance(value, str)
        if self.type is int:
            if isinstance(value, bool) or not isinstance(value, int):
                return False
            return (self.lo is None or value >= self.lo) and (self.hi is None or value <= self.hi)
        # float: ints are numbers too; NaN never is
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
            return False
        lo, hi = self.lo, self.hi
        return ((lo is None or (value > lo if self.lo_open else value >= lo))
                and (hi is None or (value < hi if self.hi_open else value <= hi)))

    def check(self, value: Any) -> Any:
        """``value`` converted and validated, or :class:`ConfigError` naming this key."""
        if self.convert is not None:
            value = self.convert(value)
        if value is None and self.optional:
            return None
        if self.validate is not None:
            self.validate(self, value)
        elif not self._ok(value):
            raise ConfigError(self.name, value, self.allowed(), self.hint)
        return value

    def _attrs_validator(self, inst: Any, attr: attrs.Attribute, value: Any) -> None:
        self.check(value)

    def field(self) -> Any:
        """The ``attrs`` field of a core key: this key's default, converter and validator."""
        return attrs.field(default=self.default, converter=self.convert or _identity, validator=self._attrs_validator)


def _identity(value: Any) -> Any:
    return value


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """``"host:port"`` -> (host, port), or :class:`ConfigError`. IPv4 addresses and host names only:
    ggml-rpc splits at the first ``:`` and resolves IPv4, so an IPv6 endpoint would abort it."""
    host, sep, port = str(endpoint).partition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError("rpc_servers", endpoint, "HOST:PORT entries with an IPv4 address or host name, "
                          "e.g. 127.0.0.1:50052", "llama.cpp's RPC client does not take IPv6 endpoints")
    return host, int(port)


def _endpoints(value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        value = [v for v in value.split(",") if v.strip()]
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise ConfigError("rpc_servers", value, "a list of HOST:PORT strings (or one comma-separated string)")
    out = tuple(v.strip() for v in value)
    for endpoint in out:
        parse_endpoint(endpoint)
    if len(set(out)) != len(out):
        raise ConfigError("rpc_servers", list(out), "distinct HOST:PORT entries")
    return out


def device_names(value: Any) -> tuple[str, ...]:
    """``"CUDA0,CUDA1"`` or a list of names -> a tuple of distinct llama.cpp device names."""
    if isinstance(value, str):
        value = [v for v in value.split(",") if v.strip()]
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) and v.strip() for v in value):
        raise ConfigError("devices", value, "a list of llama.cpp device names (or one comma-separated string)",
                          "e.g. devices = [\"CUDA0\", \"CUDA1\"]; empty: every GPU of the build")
    out = tuple(v.strip() for v in value)
    if len(set(out)) != len(out):
        raise ConfigError("devices", list(out), "distinct device names")
    return out


def _mode(key: ConfigKey, value: Any) -> None:
    if not isinstance(value, str) or not MODE_NAME_RE.match(value):
        raise ConfigError(key.name, value, f"{MODE_OFF!r}, {MODE_AUTO!r} or an installed strategy name",
                          "names are lowercase letters, digits, '-', '_' or '.'; `power plugins` lists them")


def _stop_tuple(value: Any) -> Any:
    """``"x"`` -> ``("x",)``; lists -> tuples (anything else is left for the validator to reject)."""
    if isinstance(value, str):
        return (value,)
    if isinstance(value, (list, tuple)):
        return tuple(value)
    return value


def _stops(key: ConfigKey, value: Any) -> None:
    ok = isinstance(value, tuple) and len(value) <= STOP_MAX
    if not ok or not all(isinstance(s, str) and s for s in value):
        raise ConfigError(key.name, value, f"a list of at most {STOP_MAX} non-empty strings",
                          "e.g. stop = [\"\\n\\n\", \"###\"]")


def _bias_pairs(value: Any) -> Any:
    """``{"15": -5.0}`` / ``{15: -5.0}`` / ``[(15, -5.0)]`` -> ``((15, -5.0),)`` sorted by id (anything else is
    left for the validator to reject)."""
    if isinstance(value, Mapping):
        value = list(value.items())
    if isinstance(value, (list, tuple)):
        out = []
        for pair in value:
            if not isinstance(pair, (list, tuple)) or len(pair) != 2:
                return value
            tok, bias = pair
            if isinstance(tok, str) and tok.strip().lstrip("-").isdigit():
                tok = int(tok)
            if isinstance(bias, int) and not isinstance(bias, bool):
                bias = float(bias)
            out.append((tok, bias))
        return tuple(sorted(out, key=lambda p: p[0] if isinstance(p[0], int) else -1))
    return value


def _biases(key: ConfigKey, value: Any) -> None:
    ok = isinstance(value, tuple) and len(value) <= LOGIT_BIAS_MAX and all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 and isinstance(b, float)
        and math.isfinite(b) for t, b in value)
    if not ok or len({t for t, _ in value}) != len(value):
        raise ConfigError(key.name, value, f"at most {LOGIT_BIAS_MAX} distinct token ids, each with a finite bias",
                          'e.g. logit_bias = {"15043": -100.0}; the token ids are checked against the '
                          "model's vocabulary when a request starts")


def _valid(key: ConfigKey, value: Any) -> None:
    """For keys whose converter already validated (and raised)."""


def _key(name: str, type_: type, default: Any, owner: str, help: str, *, scope: Scope = "session",
         flag: str | None = None, **kw: Any) -> ConfigKey:
    return ConfigKey(name=name, type=type_, default=default, owner=owner, help=help, scope=scope, flag=flag, **kw)


#: the core's keys, in PowerConfig's field order: the session's (fixed at open; what shapes the target),
#: the transaction's, the scheduler's and the sampler's
CORE_KEYS: tuple[ConfigKey, ...] = (
    _key("spec_mode", str, MODE_AUTO, "session", "the strategy: off, auto or an installed strategy's name",
         flag="--mode", validate=_mode),
    _key("spec_draft_max", int, None, "scheduler",
         "K: proposal width (unset: the strategy's default, e.g. 32 for suffix, else 7); a request may "
         "narrow it", scope="request", flag="--draft-max", lo=1, hi=K_MAX, optional=True),
    _key("spec_recurrent_snapshots", int, None, "transaction",
         "S: resident rollback snapshots of the target (unset: K)", flag="--snapshots", lo=1,
         hi=S_MAX, optional=True, aliases=("spec_mtp_recurrent_snapshots",)),
    _key("spec_adaptive", bool, False, "scheduler", "request-local adaptive controller (circuit to target-only)",
         flag="--adaptive", aliases=("spec_mtp_adaptive",)),
    _key("spec_adaptive_low_yield", float, 0.25, "scheduler",
         "adaptive: a round yields low when accepted/proposed is below this", lo=0.0, hi=1.0),
    _key("spec_adaptive_low_yield_rounds", int, 3, "scheduler",
         "adaptive: consecutive low-yield rounds that open the target-only circuit", lo=1, hi=1024),
    _key("temperature", float, 0.0, "sampler", "0: greedy", scope="request", flag="--temperature", lo=0.0,
         hi=100.0),
    _key("top_k", int, 0, "sampler", "0: off", scope="request", flag="--top-k", lo=0),
    _key("top_p", float, 1.0, "sampler", "nucleus mass", scope="request", flag="--top-p", lo=0.0, hi=1.0,
         lo_open=True),
    _key("min_p", float, 0.0, "sampler", "drop tokens below this fraction of the top probability", scope="request",
         flag="--min-p", lo=0.0, hi=1.0, hi_open=True),
    _key("seed", int, 0, "sampler", "the random stream, keyed by emitted position", scope="request", flag="--seed",
         lo=0, hi=2**63 - 1),
    _key("repeat_penalty", float, 1.0, "sampler",
         "llama.cpp's repeat penalty over the last repeat_last_n tokens of prompt + output (1: off)",
         scope="request", flag="--repeat-penalty", lo=0.0, hi=10.0, lo_open=True),
    _key("repeat_last_n", int, 64, "sampler",
         "the penalties' window: the last N tokens of prompt + output (0: penalties off, -1: the whole context)",
         scope="request", flag="--repeat-last-n", lo=-1, hi=1 << 20),
    _key("frequency_penalty", float, 0.0, "sampler",
         "subtracted from a token's logit once per occurrence in the penalties' window", scope="request",
         flag="--frequency-penalty", lo=-2.0, hi=2.0),
    _key("presence_penalty", float, 0.0, "sampler",
         "subtracted from the logit of a token that occurs in the penalties' window", scope="request",
         flag="--presence-penalty", lo=-2.0, hi=2.0),
    _key("logit_bias", tuple, (), "sampler",
         "token id -> bias added to its logit before the penalties (e.g. -100 all but bans it)", scope="request",
         convert=_bias_pairs, validate=_biases),
    _key("tenant", str, "", "session",
         "whose memories a request may use (prompt cache, cross-request suffix index): requests see only "
         "their own tenant's (empty: the default tenant)", scope="request"),
    _key("max_tokens", int, 128, "session", "tokens to emit at most", scope="request", flag="--max-tokens", lo=1,
         hi=1 << 20),
    _key("n_ctx", int, 2048, "session", "context length", flag="--n-ctx", lo=16, hi=1 << 20),
    _key("n_threads", int, None, "session", "CPU threads (unset: the backend's choice)", flag="--threads", lo=1,
         hi=1024, optional=True),
    _key("trace", bool, False, "transaction", "each round's proposed ids in the receipt (rounds[i].proposal)",
         flag="--trace"),
    _key("stop", tuple, (), "session",
         "stop strings: the output ends right before the first one, matched on the decoded text across token "
         "boundaries (needs a tokenizer)", scope="request", flag="--stop", convert=_stop_tuple, validate=_stops),
    _key("cache_prompt", bool, False, "session",
         "reuse the target's state for the prefix a prompt shares with what its sequence holds (the previous "
         "request's prompt and output) or, with a prompt cache (power serve --cache-ram), with a saved state "
         "(receipt prompt_reused)"),
    _key("rpc_servers", tuple, (), "session",
         "llama.cpp rpc-server endpoints (HOST:PORT) that hold the target's layers (power-native built with "
         "POWER_NATIVE_RPC=1; empty: all in this process)", flag="--rpc", convert=_endpoints, validate=_valid),
    _key("n_gpu_layers", int, 0, "session",
         "target layers offloaded to the GPU devices, or to rpc_servers (-1: all, 0: CPU only); the MTP head "
         "follows the target", flag="--gpu-layers", lo=-1, hint="-1 offloads every layer, 0 none (CPU only)"),
    _key("devices", tuple, (), "session",
         "llama.cpp device names the offloaded layers go to (e.g. CUDA0,CUDA1; empty: every GPU of the build)",
         flag="--devices", convert=device_names, validate=_valid),
    _key("flash_attn", str, "auto", "session",
         "flash attention for every context: auto (llama.cpp decides per device), on or off", flag="--flash-attn",
         choices=FLASH_ATTN),
    _key("draft_gpu_layers", int, 0, "session",
         "layers of a separate draft model (draft-model, the DFlash family) offloaded to the devices (-1: all)",
         flag="--draft-gpu-layers", lo=-1, hint="-1 offloads every layer, 0 none (CPU only)"),
    _key("numerics", str, "exact", "session",
         "target kernels: exact (batch-invariant: speculative output equals spec_mode off on every model) or "
         "stock (as stock llama.cpp binaries)", flag="--numerics", choices=NUMERICS),
    _key("sampling_in_graph", str, "auto", "session",
         "greedy ids from the target's graph (auto: where rows would cross a device boundary; on: wherever "
         "supported) or from logits rows on the host (off; always for stochastic sampling or logprobs)",
         flag="--sampling-in-graph", choices=SAMPLING_IN_GRAPH),
    _key("selftest", bool, False, "session", "probe the target's batch numerics at open (receipt selftest)",
         flag="--selftest"),
    _key("warmup", bool, True, "session",
         "one throwaway pass on each context at open (target, draft model, MTP head), as llama.cpp's tools do",
         flag="--no-warmup"),
    _key("require_identical", bool, False, "session",
         "target-only, with the reason, when the probe finds verify rows that differ from one-token decodes "
         "(implies selftest)", flag="--require-identical"),
    _key("verify_capacity", int, 0, "transaction",
         "B: pad every target verify pass to exactly B tokens, one pass shape (0: off); an unset K resolves to "
         "at most B - 1", flag="--verify-capacity", lo=0, hi=VERIFY_CAPACITY_MAX),
)
#: the core's keys by name
CORE_BY_NAME: Mapping[str, ConfigKey] = {k.name: k for k in CORE_KEYS}
#: a core key's earlier name -> its name (:attr:`ConfigKey.aliases`)
CORE_ALIASES: Mapping[str, str] = {alias: k.name for k in CORE_KEYS for alias in k.aliases}


def canonical_keys(values: Mapping[str, Any]) -> dict[str, Any]:
    """``values`` with every key's earlier name (:data:`CORE_ALIASES`) replaced by its name. Both names of
    one key is a :class:`ConfigError`: which value was meant cannot be told."""
    if not CORE_ALIASES.keys() & values.keys():
        return dict(values)
    out: dict[str, Any] = {}
    for name, value in values.items():
        key = CORE_ALIASES.get(name, name)
        if key in out or (key != name and key in values):
            raise ConfigError(name, value, f"one of {key!r} and its earlier name {name!r}, not both",
                              f"set {key} only ({name} is its legacy name)")
        out[key] = value
    return out


# -- the strategies' keys --------------------------------------------------------------------------
_lock = threading.RLock()
_declared: dict[str, ConfigKey] = {}  # a strategy key's name -> its declaration
_owners: dict[str, tuple[str, ...]] = {}  # a strategy key's name -> the strategies declaring it
_loader: Callable[[], object] | None = None
_loading = False


def set_key_loader(loader: Callable[[], object] | None) -> None:
    """What loads the installed plugins (so that they declare their keys) the first time a key is not
    known: the plugin manager installs :func:`power_core.plugins.get_plugins` here."""
    global _loader
    _loader = loader


def declare_keys(strategy: str, keys: Iterable[ConfigKey]) -> None:
    """Enter a strategy's keys (the plugin manager calls this when it registers the strategy).

    Several strategies may declare one key (the DFlash family's ``spec_draft_p_min``) if they declare it
    alike; a core key, a different declaration of a declared key, or a strategy key with ``request``
    scope (a proposer is built when the session opens) is a :class:`~power_core.errors.PluginError`.
    """
    with _lock:
        for key in keys:
            if not isinstance(key, ConfigKey):
                raise PluginError(f"strategy {strategy!r} declares {key!r}; expected a power_core.ConfigKey")
            if key.aliases:
                raise PluginError(f"strategy {strategy!r} declares config key {key.name!r} with aliases "
                                  f"{key.aliases!r}; earlier names are the core's keys' only: keep the key's name")
            core = CORE_BY_NAME.get(CORE_ALIASES.get(key.name, key.name))
            if core is not None:
                raise PluginError(f"strategy {strategy!r} declares config key {key.name!r}, which is the core's "
                                  f"({core.owner}); name the strategy's own key differently")
            if key.scope == "request":
                raise PluginError(f"strategy {strategy!r} declares config key {key.name!r} with scope 'request'; a "
                                  "strategy's key is fixed when the session opens: use 'session'")
            owners = tuple(o for o in _owners.get(key.name, ()) if o != strategy)
            have = _declared.get(key.name)
            if owners and have is not None and have != key:
                raise PluginError(f"strategy {strategy!r} declares config key {key.name!r} as {key!r}, but "
                                  f"{', '.join(owners)} declared it as {have!r}; one key has one meaning: "
                                  "declare it alike or rename it")
            _declared[key.name] = key
            _owners[key.name] = tuple(sorted({*owners, strategy}))


def _load() -> None:
    """Have the installed plugins declare their keys (the loader caches; a call from inside it is a no-op)."""
    global _loading
    if _loader is None:
        return
    with _lock:
        if _loading:
            return
        _loading = True
        try:
            _loader()
        finally:
            _loading = False


def strategy_key(name: str) -> ConfigKey | None:
    """The declaration of a strategy key, loading the installed plugins first if it is not known yet."""
    if name not in _declared:
        _load()
    return _declared.get(name)


def key_owners(name: str) -> tuple[str, ...]:
    """Who owns a key: its core component, or the strategies that declare it (``()``: unknown)."""
    if name in CORE_BY_NAME:
        return (CORE_BY_NAME[name].owner,)
    return _owners.get(name, ()) if strategy_key(name) is not None else ()


def declared_keys(strategies: Iterable[str] | None = None) -> tuple[ConfigKey, ...]:
    """The core's keys, then the strategies' keys in name order (only those ``strategies`` declare,
    when given)."""
    if strategies is None:
        _load()
    wanted = None if strategies is None else set(strategies)
    extra = [k for n, k in sorted(_declared.items()) if wanted is None or wanted & set(_owners[n])]
    return (*CORE_KEYS, *extra)


#: keys one request may set for itself (:class:`~power_core.config.RequestSettings`): the core's request-scoped
#: keys (a strategy's key is never one, :func:`declare_keys`), in the table's order
REQUEST_KEYS: tuple[str, ...] = tuple(k.name for k in CORE_KEYS if k.scope == "request")
#: the sampler's request keys (:meth:`power_core.Session.start`'s ``sampling``; the server's per-request fields)
SAMPLING_KEYS: tuple[str, ...] = tuple(k.name for k in CORE_KEYS if k.scope == "request" and k.owner == "sampler")


def config_table(keys: Iterable[ConfigKey]) -> str:
    """The Markdown table of ``keys`` (key, flag, default, scope, owner, help): README's configuration table.
    A key's default under ``power serve``, where it differs, follows its default."""
    rows = ["| key | flag | default | scope | owner | meaning |", "|---|---|---|---|---|---|"]
    for k in keys:
        default = "unset" if k.default is None else json.dumps(list(k.default) if k.type is tuple else k.default)
        default = f"`{default}`" + ("" if k.serve_default is None else f" (serve: `{json.dumps(k.serve_default)}`)")
        flag = f"`{k.flag}`" if k.flag else ""
        legacy = f" (legacy name: {', '.join(f'`{a}`' for a in k.aliases)})" if k.aliases else ""
        rows.append(f"| `{k.name}` | {flag} | {default} | {k.scope} | {', '.join(key_owners(k.name))} | "
                    f"{k.help.replace('|', '/')}{legacy} |")
    return "\n".join(rows)


def unknown_key(key: str, value: Any) -> ConfigError:
    """The error for ``key``, which neither the core nor an installed strategy declares (with the closest name)."""
    known = sorted({*CORE_BY_NAME, *_declared})
    close = difflib.get_close_matches(str(key), known, n=1)
    hint = f"did you mean {close[0]!r}?" if close else f"known keys: {', '.join(known)}"
    hint += ("; a strategy's key is known when its plugin is installed and allowed by POWER_LOAD_PLUGINS "
             "(`power plugins --json` lists each plugin's config_keys)")
    return ConfigError(str(key), value, "a known configuration key (the core's or an installed strategy's)", hint)
