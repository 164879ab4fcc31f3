"""The one error hierarchy of Power.

Every error derives from :class:`PowerError` and from the builtin it resembles, so callers may catch
either. A message names the object, what was expected, what was found and the likely fix.
"""

from __future__ import annotations

__all__ = [
    "PowerError",
    "ConfigError",
    "PluginError",
    "StrategyNotFound",
    "StrategyNotInstalled",
    "ArtifactError",
    "ArtifactMismatch",
    "RuntimeFault",
    "AdapterFault",
    "Cancelled",
    "StateLost",
    "CapacityError",
    "ConstraintError",
    "SessionBusy",
    "Overloaded",
    "MissingDependency",
]


class PowerError(Exception):
    """Root of every error Power raises on purpose."""

    #: stable machine-readable reason code (CLI ``--json`` output, receipts)
    code: str = "power_error"


class ConfigError(PowerError, ValueError):
    """A configuration key, value or combination is invalid.

    ``key`` names the offending key, ``value`` the rejected value and ``allowed`` the accepted
    range, so hosts can show a precise message without parsing text.
    """

    code = "config_invalid"

    def __init__(self, key: str, value: object, allowed: str, detail: str = "") -> None:
        self.key, self.value, self.allowed = key, value, allowed
        msg = f"config key {key!r}: got {value!r}, allowed {allowed}"
        super().__init__(f"{msg}. {detail}".rstrip(". ") if detail else msg)


class PluginError(PowerError, RuntimeError):
    """A plugin failed to load, registered something invalid, or misnamed a hook."""

    code = "plugin_invalid"


class StrategyNotFound(PowerError, LookupError):
    """No strategy of that name is registered (and none is known to exist)."""

    code = "strategy_unknown"


class StrategyNotInstalled(StrategyNotFound):
    """A first-party strategy was selected but its package is not installed."""

    code = "strategy_not_installed"


class ArtifactError(PowerError, ValueError):
    """A model or draft file is unreadable, malformed or unsupported.

    ``reason`` is a stable reason code (e.g. ``gguf_truncated``); ``evidence`` names the key or
    tensor that decided.
    """

    code = "artifact_invalid"

    def __init__(self, message: str, *, reason: str | None = None, evidence: str | None = None) -> None:
        super().__init__(message)
        if reason is not None:
            self.code = reason
        self.reason = self.code
        self.evidence = evidence


class ArtifactMismatch(ArtifactError):
    """Files are individually valid but do not belong together (binding, vocabulary, contract)."""

    code = "artifact_mismatch"


class RuntimeFault(PowerError, RuntimeError):
    """The target runtime failed (decode error, lost state, bad logits)."""

    code = "runtime_fault"


class AdapterFault(PowerError, RuntimeError):
    """A proposer broke its contract (too many tokens, ids outside the vocabulary, exception).

    ``proposer`` names the proposer's class and ``method`` the protocol method that failed (``None``
    when the transaction rejected what a method returned rather than an exception it raised).
    """

    code = "adapter_fault"

    def __init__(self, message: str, *, proposer: str | None = None, method: str | None = None) -> None:
        super().__init__(message)
        self.proposer, self.method = proposer, method


class Cancelled(PowerError):
    """Generation was cancelled through its cancel token; committed tokens are kept."""

    code = "cancelled"


class StateLost(RuntimeFault):
    """A runtime could not restore a checkpoint (the session must be discarded), or an interrupted
    generation cannot resume because its session has served another request since (start a new one)."""

    code = "state_lost"


class CapacityError(PowerError, ValueError):
    """A request does not fit (prompt longer than the context, K/S beyond what the runtime allows)."""

    code = "capacity_exceeded"


class ConstraintError(PowerError, ValueError):
    """A schema, regular expression, grammar or tool definition the grammar engine refuses (a syntax
    error, an unsupported keyword, an unsatisfiable grammar). ``field`` names where it came from
    (``response_format``, ``grammar``, ``tools[0].function.parameters``, ``--json-schema``)."""

    code = "constraint_invalid"

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.detail = message


class SessionBusy(PowerError, RuntimeError):
    """A :class:`~power_core.session.Session` was asked to run while it serves another request.

    A session owns one target context: one request at a time. A second thread (or an interleaved
    call while a stream is unfinished) gets this error instead of waiting; open one session per
    thread, or serialize calls in the host.
    """

    code = "session_busy"


class Overloaded(SessionBusy):
    """Every sequence of an :class:`~power_core.engine.Engine` is busy and its admission queue is full,
    or a request's wait for a free one outlasted its timeout; retry later."""

    code = "server_overloaded"


class MissingDependency(PowerError, ImportError):
    """An optional module a command needs is not installed; ``extra`` names the power-core extra
    that installs it (``pip install 'power-core[EXTRA]'``). Raised before the command does any work."""

    code = "dependency_missing"

    def __init__(self, module: str, extra: str, needed_for: str) -> None:
        self.module, self.extra = module, extra
        super().__init__(f"{needed_for} needs {module!r}, which is not installed: pip install 'power-core[{extra}]' "
                         f"(from a checkout: pip install '.[{extra}]')", name=module)
