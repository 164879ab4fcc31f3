"""The plugin vocabulary: what a plugin imports to offer a strategy or a backend.

A leaf module: it depends on :mod:`power_core.runtime`, :mod:`power_core.config` and
:mod:`power_core.errors` only (and on ``attrs`` / ``pluggy``), so a plugin, the hook specs, the
plugin manager (:mod:`power_core.plugins`) and the session can all import it without importing
each other. ``tests/test_layers.py`` keeps it that way.

* :data:`hookimpl` marks a hook implementation (the specs are in :mod:`power_core.hookspecs`);
* :class:`Strategy` and :class:`Backend` are what ``power_register_strategies`` /
  ``power_register_backends`` register; a strategy declares its own configuration keys as
  :class:`ConfigKey` values (``Strategy.config_keys``) and its place in ``auto``
  (``Strategy.auto_detect``, ``Strategy.auto_rank``);
* :class:`OpenRequest` / :class:`OpenedModel` are a backend's ``open`` call and its answer,
  :class:`ProposerRequest` is what a strategy's proposer factory receives, and :class:`Tokenizer`
  is a loaded model's optional text codec;
* :class:`RequestInfo` is what ``power_request_start`` observers learn about a request.

Everything here is also importable from :mod:`power_core` (the public facade) and, for older
code, from :mod:`power_core.plugins`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from importlib import metadata
from typing import Any, Literal, Protocol, TypeVar

import attrs
import pluggy

from power_core.config import MODE_NAME_RE, ConfigKey, PowerConfig
from power_core.constraint import Grammars, Vocabulary
from power_core.errors import ArtifactMismatch, PluginError
from power_core.runtime import BatchRuntime, Proposer, TargetRuntime, TokenArray

__all__ = [
    "FIRST_PARTY_PACKAGES",
    "Backend",
    "ConfigKey",
    "Grammars",
    "OpenRequest",
    "OpenedBatch",
    "OpenedModel",
    "ProposerRequest",
    "RequestInfo",
    "Strategy",
    "Validation",
    "Tokenizer",
    "Vocabulary",
    "hookimpl",
    "package_version",
]

hookimpl = pluggy.HookimplMarker("power")

#: The one registration table: Power's first-party strategies and the package that registers each,
#: for fail-closed "pip install X" messages. Nothing else in the core names a first-party strategy
#: (``tests/test_layers.py``): what a strategy is configured by and where ``auto`` tries it, it
#: declares itself when it registers (:attr:`Strategy.config_keys`, :attr:`Strategy.auto_detect`).
FIRST_PARTY_PACKAGES: Mapping[str, str] = {
    "mtp": "power-mtp",
    "dflash": "power-dflash",
    "dflash2": "power-dflash2",
    "dspark": "power-dspark",
    "eagle3": "power-eagle3",
    "draft-model": "power-native",
    "suffix": "power-suffix",
}


def package_version(distribution: str) -> str:
    """Installed version of ``distribution`` (``0+unknown`` when running from a source tree)."""
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "0+unknown"


class Tokenizer(Protocol):
    """Optional text codec of a loaded model."""

    def encode(self, text: str) -> TokenArray: ...

    def decode(self, tokens: TokenArray) -> str: ...


@attrs.frozen
class OpenRequest:
    """What a backend needs to open a target: the model, the request shape and the taps."""

    model: str | None
    config: PowerConfig
    max_block: int  # anchor + K
    snapshots: int  # S requested; the runtime reports what it got
    features: frozenset[str] = frozenset()
    #: measure (or load the cached) verify-cost curve of passes of 1..max_block tokens
    verify_cost: bool = False


@attrs.define(eq=False)
class OpenedModel:
    """A loaded target with its optional tokenizer and evidence for the receipt."""

    target: TargetRuntime
    tokenizer: Tokenizer | None = None
    model_path: str | None = None
    artifacts: dict[str, str] = attrs.field(factory=dict)  # role -> sha256
    backend_info: dict[str, Any] = attrs.field(factory=dict)
    close: Callable[[], None] = lambda: None
    #: compiles constraints against the model's vocabulary (:mod:`power_core.constraint`); ``None``: the
    #: backend cannot read its vocabulary, and constrained requests are refused. One per model: the
    #: sequences of a batch share it (its tokenizer for the grammar engine is built once, on first use)
    grammars: Grammars | None = None


@attrs.frozen
class OpenedBatch:
    """A loaded target whose sequences share target passes: the :class:`~power_core.runtime.BatchRuntime`
    and one :class:`OpenedModel` per sequence (``target`` is the sequence; each closes with the batch)."""

    runtime: BatchRuntime
    models: tuple[OpenedModel, ...]
    close: Callable[[], None] = lambda: None


_R = TypeVar("_R")


class Validation(Protocol):
    """What selection proved about the files of one selection
    (:class:`power_core.artifacts.VerifiedArtifacts`): the mode, and ``result``, the strategy
    validator's own typed result (``None`` for a strategy without a validator)."""

    @property
    def mode(self) -> str: ...

    @property
    def result(self) -> object: ...


@attrs.frozen
class ProposerRequest:
    """What a strategy's factory receives to build its proposer for one loaded target.

    ``verified`` is what selection proved (:class:`Validation`); :meth:`validated` hands the
    strategy validator's result back as the type the validator returned, e.g.
    ``req.validated(Verified).backbone.target_layers``."""

    opened: OpenedModel
    config: PowerConfig
    draft: str | None = None
    verified: Validation | None = None

    def validated(self, kind: type[_R]) -> _R:
        """The strategy validator's result, checked to be a ``kind``; raises
        :class:`~power_core.errors.ArtifactMismatch` when the validator did not run or returned
        something else."""
        result = self.verified.result if self.verified is not None else None
        if not isinstance(result, kind):
            raise ArtifactMismatch(f"the strategy's validator result is {type(result).__name__}, expected "
                                   f"{kind.__name__} (did selection verify the artifacts?)", evidence="validator")
        return result


def _check_name(inst: Any, attr: attrs.Attribute, value: Any) -> None:
    if not isinstance(value, str) or not MODE_NAME_RE.match(value):
        raise PluginError(f"{type(inst).__name__}.{attr.name}={value!r}: expected a lowercase name "
                          "matching [a-z][a-z0-9_.-]*; fix the plugin's register() call")


@attrs.frozen
class Strategy:
    """A proposal mechanism a plugin offers (``spec_mode`` selects it by ``name``).

    ``proposer`` builds the :class:`~power_core.runtime.Proposer` for one session (``None`` for
    target-only); ``target_features`` names what it needs the target to publish. ``validate`` is the
    fail-closed artifact validator (``(target_view, draft_view, config) -> verified``; raises
    :class:`~power_core.errors.ArtifactError`). ``backends`` lists the backends it can run on
    (empty: any). ``config_keys`` are the strategy's own configuration keys (validated, documented and
    offered as CLI flags like the core's; ``config.<name>`` reads one). ``auto_detect`` makes it a
    candidate of ``spec_mode = "auto"`` with no draft: ``(target_view) -> evidence | None`` says what in
    the target lets it run (e.g. ``"MTP layers (...)"``); candidates are tried by ``auto_rank``, lowest
    first, then name.
    """

    name: str = attrs.field(validator=_check_name)
    version: str
    package: str
    summary: str = ""
    kind: Literal["target-only", "model-backed", "model-free"] = "model-backed"
    needs_draft: bool = False
    proposer: Callable[[ProposerRequest], Proposer] | None = None
    validate: Callable[..., Any] | None = None
    backends: frozenset[str] = frozenset()
    #: hidden-state taps the target must publish (``DecodeResult.features``), or a callable that
    #: derives them from the validator's result (e.g. the layers a DFlash draft reads)
    target_features: frozenset[str] | Callable[[Any], frozenset[str]] = frozenset()
    experimental: bool = False
    #: with ``needs_draft`` and no draft given, the target file drafts for itself (a self-check)
    self_draft: bool = False
    #: K when the configuration leaves ``spec_draft_max`` unset (None: the core's 7)
    default_draft_max: int | None = None
    #: the scheduler picks each round's verified width from the target's verify-cost curve and the
    #: proposer's ``confidence`` (the backend measures the curve once per model)
    cost_aware: bool = False
    #: the strategy's own configuration keys (the plugin manager enters them into the configuration)
    config_keys: tuple[ConfigKey, ...] = ()
    #: ``auto`` without a draft: ``(target_view) -> evidence or None`` (None here: not a candidate)
    auto_detect: Callable[[Any], str | None] | None = None
    #: ``auto``'s order among the candidates with ``auto_detect`` (lowest first)
    auto_rank: int = 0

    def features_for(self, verified: Validation | None) -> frozenset[str]:
        """The target features for this selection (``verified``: the validator's result, or None)."""
        tf = self.target_features
        return frozenset(tf(verified) if callable(tf) else tf)


@attrs.frozen
class Backend:
    """A target runtime family (``llama`` from power-native, ``reference`` from the core)."""

    name: str = attrs.field(validator=_check_name)
    version: str
    package: str
    open: Callable[[OpenRequest], OpenedModel]
    accepts: Callable[[str | None], bool]
    summary: str = ""
    priority: int = 0  # higher wins when several backends accept the same model (None = default)
    #: maps a model argument (``None`` = the backend's default, an alias) to what gets inspected
    #: and opened, e.g. the path of the embedded GGUF; identity by default
    resolve: Callable[[str | None], str | None] = lambda model: model
    #: opens ``n`` sequences of one target that share target passes (continuous batching); ``None``:
    #: this backend runs concurrent requests as independent slots only
    open_batch: Callable[[OpenRequest, int], OpenedBatch] | None = None


@attrs.frozen
class RequestInfo:
    """What observers learn when a request starts."""

    config: PowerConfig
    strategy: str
    backend: str
    prompt_tokens: int
    selection: str
