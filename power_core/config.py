"""Frozen request configuration with the seed's keys.

Every key is validated on construction; unknown keys, out-of-range values and contradictions raise
:class:`~power_core.errors.ConfigError` naming the key, the value and the allowed range.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from power_core.errors import ConfigError

__all__ = ["PowerConfig", "FIRST_PARTY_MODES", "MODE_NAME_RE", "NUMERICS", "FLASH_ATTN", "VERIFY_CAPACITY_MAX",
           "SAMPLING_IN_GRAPH", "device_names"]

#: modes whose names Power reserves; third-party strategies may add more names.
FIRST_PARTY_MODES = ("off", "auto", "mtp", "dflash", "dflash2", "dspark", "draft-model")
MODE_NAME_RE = re.compile(r"^[a-z][a-z0-9_.-]{0,63}$")

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


def _int_range(lo: int, hi: int | None):
    allowed = f"an integer in [{lo}, {hi}]" if hi is not None else f"an integer >= {lo}"

    def check(inst: Any, attr: attrs.Attribute, value: Any) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < lo or (hi is not None and value > hi):
            raise ConfigError(attr.name, value, allowed)

    return check


def _opt(check):
    def inner(inst: Any, attr: attrs.Attribute, value: Any) -> None:
        if value is not None:
            check(inst, attr, value)

    return inner


def _float_range(lo: float, hi: float, *, lo_open: bool = False, hi_open: bool = False):
    allowed = f"a number in {'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"

    def check(inst: Any, attr: attrs.Attribute, value: Any) -> None:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value == value
        if ok:
            ok = (value > lo if lo_open else value >= lo) and (value < hi if hi_open else value <= hi)
        if not ok:
            raise ConfigError(attr.name, value, allowed)

    return check


def _choice(allowed: tuple[str, ...]) -> Any:
    def check(inst: Any, attr: attrs.Attribute, value: Any) -> None:
        if value not in allowed:
            raise ConfigError(attr.name, value, f"one of {', '.join(repr(a) for a in allowed)}")

    return check


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


def _gpu_layers(inst: Any, attr: attrs.Attribute, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < -1:
        raise ConfigError(attr.name, value, "an integer >= -1", "-1 offloads every layer, 0 none (CPU only)")


def _bool(inst: Any, attr: attrs.Attribute, value: Any) -> None:
    if not isinstance(value, bool):
        raise ConfigError(attr.name, value, "true or false")


def _mode(inst: Any, attr: attrs.Attribute, value: Any) -> None:
    if not isinstance(value, str) or not MODE_NAME_RE.match(value):
        raise ConfigError(
            attr.name, value, f"one of {', '.join(FIRST_PARTY_MODES)} or an installed strategy name",
            "names are lowercase letters, digits, '-', '_' or '.'",
        )


#: at most this many stop strings per request
STOP_MAX = 64


def _stop_tuple(value: Any) -> Any:
    """``"x"`` -> ``("x",)``; lists -> tuples (anything else is left for the validator to reject)."""
    if isinstance(value, str):
        return (value,)
    if isinstance(value, (list, tuple)):
        return tuple(value)
    return value


def _stops(inst: Any, attr: attrs.Attribute, value: Any) -> None:
    ok = isinstance(value, tuple) and len(value) <= STOP_MAX
    if not ok or not all(isinstance(s, str) and s for s in value):
        raise ConfigError(attr.name, value, f"a list of at most {STOP_MAX} non-empty strings",
                          "e.g. stop = [\"\\n\\n\", \"###\"]")


@attrs.frozen
class PowerConfig:
    """One request's speculative-decoding and sampling configuration.

    ``spec_draft_max`` (K) bounds proposal width (unset: the strategy's default, else 7); ``spec_mtp_recurrent_snapshots`` (S) bounds the
    target's resident rollback snapshots (``None`` means S = K, the balanced default K7/S7).
    """

    spec_mode: str = attrs.field(default="auto", validator=_mode)
    #: K; ``None`` takes the strategy's own default (``Strategy.default_draft_max``), else 7
    spec_draft_max: int | None = attrs.field(default=None, validator=_opt(_int_range(1, K_MAX)))
    spec_mtp_recurrent_snapshots: int | None = attrs.field(default=None, validator=_opt(_int_range(1, S_MAX)))
    spec_mtp_fr_vocab_size: int | None = attrs.field(default=None, validator=_opt(_int_range(1, None)))
    spec_mtp_adaptive: bool = attrs.field(default=False, validator=_bool)
    #: block drafters (dflash, dflash2, dspark) stop a proposal where the draft's confidence falls
    #: below this (llama.cpp ``--spec-draft-p-min``; 0 = never)
    spec_draft_p_min: float = attrs.field(default=0.0, validator=_float_range(0.0, 1.0, hi_open=True))
    #: adaptive controller: a round "yields low" when accepted/proposed < this fraction
    spec_adaptive_low_yield: float = attrs.field(default=0.25, validator=_float_range(0.0, 1.0))
    #: adaptive controller: consecutive low-yield rounds that open the target-only circuit
    spec_adaptive_low_yield_rounds: int = attrs.field(default=3, validator=_int_range(1, 1024))
    temperature: float = attrs.field(default=0.0, validator=_float_range(0.0, 100.0))
    top_k: int = attrs.field(default=0, validator=_int_range(0, None))
    top_p: float = attrs.field(default=1.0, validator=_float_range(0.0, 1.0, lo_open=True))
    min_p: float = attrs.field(default=0.0, validator=_float_range(0.0, 1.0, hi_open=True))
    seed: int = attrs.field(default=0, validator=_int_range(0, 2**63 - 1))
    max_tokens: int = attrs.field(default=128, validator=_int_range(1, 1 << 20))
    n_ctx: int = attrs.field(default=2048, validator=_int_range(16, 1 << 20))
    n_threads: int | None = attrs.field(default=None, validator=_opt(_int_range(1, 1024)))
    #: record each round's proposed token ids in the receipt (``rounds[i].proposal``)
    trace: bool = attrs.field(default=False, validator=_bool)
    #: stop strings: the output ends right before the first occurrence of any of them, matched on
    #: the decoded text across token boundaries (needs a model with a tokenizer)
    stop: tuple[str, ...] = attrs.field(default=(), converter=_stop_tuple, validator=_stops)
    #: reuse the target's state for the prefix a request's prompt shares with what the previous
    #: request of the session left in memory (llama-server's ``cache_prompt``); the receipt's
    #: ``prompt_reused`` counts the tokens not prefilled again
    cache_prompt: bool = attrs.field(default=False, validator=_bool)
    #: llama.cpp ``rpc-server`` endpoints (``HOST:PORT``) that hold the target's layers (power-native
    #: built with ``POWER_NATIVE_RPC=1``); empty: everything runs in this process
    rpc_servers: tuple[str, ...] = attrs.field(default=(), converter=_endpoints)
    #: target layers offloaded to GPU devices (``devices``; -1: all, 0: none, every layer on the CPU);
    #: with ``rpc_servers``, to the servers (0 there: every layer). The MTP head follows the target
    n_gpu_layers: int = attrs.field(default=0, validator=_gpu_layers)
    #: llama.cpp device names the offloaded layers go to (e.g. ``["CUDA0", "CUDA1"]``); empty: every GPU
    #: of the build
    devices: tuple[str, ...] = attrs.field(default=(), converter=device_names)
    #: flash attention for every context of the session (llama.cpp ``--flash-attn``): ``auto`` (its
    #: per-device choice), ``on`` or ``off``
    flash_attn: str = attrs.field(default="auto", validator=_choice(FLASH_ATTN))
    #: layers of a separate draft model (draft-model, the DFlash family) offloaded to ``devices``
    draft_gpu_layers: int = attrs.field(default=0, validator=_gpu_layers)
    #: the target's kernels: ``exact`` (batch-invariant: a verify row has the bits of a one-token
    #: decode, so speculative output equals ``spec_mode = "off"`` on every model) or ``stock`` (the
    #: backend's stock kernels, e.g. to compare with a stock llama.cpp binary)
    numerics: str = attrs.field(default="exact", validator=_choice(NUMERICS))
    #: where a greedy request's token ids come from: the target's graph, so only ids leave the
    #: backend (``auto``: where the runtime says that pays, i.e. the rows would cross a device
    #: boundary; ``on``: wherever the runtime can), or the logits rows on the host (``off``, and
    #: always for stochastic sampling or logprobs); the receipt's ``backend.sampling`` says which ran
    sampling_in_graph: str = attrs.field(default="auto", validator=_choice(SAMPLING_IN_GRAPH))
    #: probe the target's batch numerics when the session opens (:mod:`power_core.numerics`); the
    #: result goes into every receipt (``selftest``)
    selftest: bool = attrs.field(default=False, validator=_bool)
    #: one throwaway pass on each context when the session opens (target, draft model, MTP head), as
    #: llama.cpp's tools do at load (``--warmup``, their default): the first pass of a context pages
    #: its weights in and sizes its compute buffers, which no request should pay for
    warmup: bool = attrs.field(default=True, validator=_bool)
    #: run target-only, with the reason, when the probe finds verify rows that differ from one-token
    #: decodes on the running build (implies ``selftest``)
    require_identical: bool = attrs.field(default=False, validator=_bool)
    #: B: pad every target verify pass to exactly B tokens (one pass shape, e.g. one captured GPU
    #: graph); the padding's rows and memory cells never leave the target runtime. 0: off. An unset
    #: ``spec_draft_max`` then resolves to at most B - 1; a set one must satisfy K + 1 <= B
    verify_capacity: int = attrs.field(default=0, validator=_int_range(0, VERIFY_CAPACITY_MAX))

    def __attrs_post_init__(self) -> None:
        b, k = self.verify_capacity, self.spec_draft_max
        if b == 1:
            raise ConfigError("verify_capacity", b, f"0 (off) or an integer in [2, {VERIFY_CAPACITY_MAX}]",
                              "a padded pass holds the anchor and at least one more token")
        if b and k is not None and k + 1 > b:
            raise ConfigError("verify_capacity", b, f"0 (off) or at least spec_draft_max + 1 = {k + 1}",
                              "a verify pass holds the anchor and up to spec_draft_max proposals; raise "
                              "verify_capacity or lower spec_draft_max")
        s = self.spec_mtp_recurrent_snapshots
        if s is not None and s > self.draft_max:
            raise ConfigError(
                "spec_mtp_recurrent_snapshots", s, f"an integer in [1, spec_draft_max={self.draft_max}]",
                "snapshots beyond the proposal width can never be used; lower S or raise spec_draft_max",
            )
        if self.spec_mode == "off" and self.spec_mtp_adaptive:
            raise ConfigError("spec_mtp_adaptive", True, "false when spec_mode = 'off'",
                              "the adaptive controller schedules proposals; enable a speculative mode")
        if self.spec_draft_p_min > 0 and self.spec_mode not in ("dflash", "dflash2", "dspark", "auto"):
            raise ConfigError("spec_draft_p_min", self.spec_draft_p_min,
                              "0 unless spec_mode is 'dflash', 'dflash2', 'dspark' or 'auto'",
                              "the confidence cut applies to the block drafters only")
        if self.spec_mtp_fr_vocab_size is not None and self.spec_mode not in ("mtp", "auto"):
            raise ConfigError("spec_mtp_fr_vocab_size", self.spec_mtp_fr_vocab_size,
                              "unset unless spec_mode is 'mtp' or 'auto'",
                              "the FR prefix only narrows the native MTP draft head")

    # -- derived -------------------------------------------------------------------------------
    @property
    def draft_max(self) -> int:
        """Effective K (the session resolves an unset key to the strategy's default first, capped
        like the core's default by ``verify_capacity - 1``)."""
        if self.spec_draft_max is not None:
            return self.spec_draft_max
        return self.capped_draft_max(DEFAULT_DRAFT_MAX)

    def capped_draft_max(self, k: int) -> int:
        """``k`` as a default K under ``verify_capacity``: at most B - 1 when padding is on."""
        return min(k, self.verify_capacity - 1) if self.verify_capacity else k

    @property
    def snapshots(self) -> int:
        """Effective S: resident rollback snapshots (defaults to K)."""
        return self.draft_max if self.spec_mtp_recurrent_snapshots is None else self.spec_mtp_recurrent_snapshots

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    def to_dict(self) -> dict[str, Any]:
        out = attrs.asdict(self)
        out["stop"] = list(self.stop)  # as JSON reads it back
        return out

    def digest(self) -> str:
        """sha256 over the canonical JSON of every key: the receipt's config hash."""
        blob = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(blob).hexdigest()

    # -- construction --------------------------------------------------------------------------
    @classmethod
    def keys(cls) -> tuple[str, ...]:
        return tuple(a.name for a in attrs.fields(cls))

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], **overrides: Any) -> PowerConfig:
        """Build from a mapping (TOML table, JSON) plus keyword overrides; ``None`` overrides are ignored."""
        merged = dict(data)
        merged.update({k: v for k, v in overrides.items() if v is not None})
        known = set(cls.keys())
        for key in merged:
            if key not in known:
                close = difflib.get_close_matches(str(key), sorted(known), n=1)
                hint = f"did you mean {close[0]!r}?" if close else f"known keys: {', '.join(sorted(known))}"
                raise ConfigError(str(key), merged[key], "a known configuration key", hint)
        return cls(**merged)

    @classmethod
    def from_toml(cls, path: str | Path, **overrides: Any) -> PowerConfig:
        """Load top-level keys (or a ``[power]`` table) from a TOML file."""
        p = Path(path)
        try:
            data = tomllib.loads(p.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ConfigError("config", str(p), "an existing TOML file", "check the --config path") from None
        except (tomllib.TOMLDecodeError, UnicodeDecodeError, IsADirectoryError) as exc:
            raise ConfigError("config", str(p), "a readable TOML file", str(exc)) from None
        if set(data) == {"power"} and isinstance(data["power"], dict):
            data = data["power"]
        return cls.from_mapping(data, **overrides)
