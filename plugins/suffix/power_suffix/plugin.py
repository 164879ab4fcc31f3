"""The ``power.adapters`` entry point of power-suffix: registers the ``suffix`` strategy."""

from __future__ import annotations

from collections.abc import Callable

from power_core.spec import ProposerRequest, Strategy, hookimpl, package_version

#: without an explicit --draft-max a round may draft this far (copying pays only for long drafts;
#: the scheduler's cost-aware width decides how much of it is verified)
DEFAULT_DRAFT_MAX = 32


def _proposer(req: ProposerRequest):
    from power_suffix.proposer import SuffixProposer

    return SuffixProposer()


@hookimpl
def power_register_strategies(register: Callable[[Strategy], None]) -> None:
    register(Strategy(
        name="suffix", version=package_version("power-suffix"), package="power-suffix", kind="model-free",
        summary="Model-free drafts from a suffix index over the prompt, the output and the session's earlier "
                "requests; the draft length is chosen per round from the match and the verify-cost curve.",
        proposer=_proposer, default_draft_max=DEFAULT_DRAFT_MAX, cost_aware=True,
    ))
