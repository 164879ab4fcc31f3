"""Every hook Power calls, in transaction order. Prefix ``power_``.

Plugins implement these with :data:`power_core.hookimpl`. Specs only ever gain arguments; an
implementation may accept fewer than the spec offers. Power calls ``check_pending()`` after loading
plugins, so an implementation whose name matches no spec is a hard error, not a silent no-op.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from power_core.receipt import Receipt
    from power_core.spec import Backend, RequestInfo, Strategy

hookspec = pluggy.HookspecMarker("power")

# --------------------------------------------------------------------------------------------------
# Registration: called once when the plugin manager is built, before any request.
# --------------------------------------------------------------------------------------------------


@hookspec
def power_register_strategies(register: Callable[[Strategy], None]) -> None:
    """Register proposal strategies (adapters) by calling ``register(Strategy(...))``.

    Called by :func:`power_core.plugins.build_plugins` once per plugin, in registration order. A
    strategy's own configuration keys (``Strategy.config_keys``, each a
    :class:`~power_core.config.ConfigKey`) are entered when it registers.

    :param register: adds one :class:`~power_core.spec.Strategy`; raises
        :class:`~power_core.errors.PluginError` for a missing or duplicate name.
    :return: ignored.
    """


@hookspec
def power_register_backends(register: Callable[[Backend], None]) -> None:
    """Register target backends (runtimes that load a model file) by calling ``register(Backend(...))``.

    Called by :func:`power_core.plugins.build_plugins` once per plugin.

    :param register: adds one :class:`~power_core.spec.Backend`; raises
        :class:`~power_core.errors.PluginError` for a missing or duplicate name.
    :return: ignored.
    """


# --------------------------------------------------------------------------------------------------
# Request lifecycle: observers. Called by :class:`power_core.session.Session` for each request.
# --------------------------------------------------------------------------------------------------


@hookspec
def power_request_start(request: RequestInfo) -> None:
    """A request is about to prefill its prompt.

    Called by the engine (:meth:`power_core.generation.Generation.begin`) when a request's first
    attempt starts, before its prefill, on the thread that reads the request (the caller of
    :meth:`~power_core.engine.Engine.run`, ``rounds`` or ``feed``; a ``power-slot-N`` worker in ``power
    serve``), never on the shared passes' driver nor the server's event loop. An implementation that raises is logged
    (``observer.failed``) and counted (the receipt's ``observer_faults``); it never fails the request.

    :param request: frozen facts of the request (config, strategy, prompt length).
    :return: ignored.
    """


@hookspec(firstresult=True)
def power_txn_phase(phase: str, round_index: int, step: Callable[[], Any]) -> Any:
    """Observe one phase of the exactness transaction. Wrapper-only: observers wrap it; only the core
    implements it.

    Called by :class:`power_core.transaction.Transaction` for each phase of each round, in the
    order ``checkpoint``, ``propose``, ``verify``, ``accept``, ``commit``, ``emit`` and, on
    cancellation or failure, ``restore``. Power's own implementation (the innermost, and the only
    one that is not a wrapper) calls ``step()``. Observers implement this with
    ``@hookimpl(wrapper=True)`` to time or log a phase: ``result = yield`` returns the phase's
    result (or raises its exception), and the wrapper must return it. A plain implementation or an
    old-style ``hookwrapper=True`` one is refused when plugins load
    (:class:`~power_core.errors.PluginError` naming the plugin).

    The transaction takes each phase's result or exception from the step itself: a wrapper that
    raises fails the round (which then restores), but one that swallows the step's exception or
    returns another value changes nothing. ``restore`` runs even when a wrapper raises before it.

    A wrapper runs on the thread that drives the target, inside the round: the shared passes'
    driver (``power-engine``) for a request in shared passes, so its time is every request's of
    the pass; the compute thread (``power-compute``) for a sequence that decodes alone. Keep it short.

    Stops at first non-None result (there is exactly one non-wrapper implementation: the core's).

    :param phase: phase name, one of :data:`power_core.transaction.PHASES`.
    :param round_index: 0-based round number within the request.
    :param step: zero-argument callable that performs the phase.
    :return: the phase's result; for ``propose`` the checked :class:`~power_core.runtime.Proposal`
        (its ``ids``, ``confidence`` and ``stats``: what a proposer observer reads).
    """


@hookspec
def power_request_end(receipt: Receipt) -> None:
    """A request finished (completed, stopped, cancelled or failed); its receipt is final.

    Called by the engine (:meth:`power_core.generation.Generation.report`) once per attempt at a
    request, also when it ends with an exception (the receipt's ``status`` then says why), on the
    thread that reads the request (as ``power_request_start``), after the engine has given its
    sequence back: never on the shared passes' driver, so a slow observer delays only its own
    request's answer (and holds that thread meanwhile). An implementation that raises is logged
    (``observer.failed``) and counted (``observer_faults`` in the request's final receipt,
    ``power:observer_faults`` in ``power serve``); it never fails the request, and never another
    request in the same shared pass.

    :param receipt: the request's frozen :class:`~power_core.receipt.Receipt`.
    :return: ignored.
    """
