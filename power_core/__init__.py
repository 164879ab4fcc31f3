"""Power: model-neutral, exact speculative decoding on llama.cpp.

The public facade. Everything a host runtime, an adapter author or a backend needs is importable
from here; modules not named here are private and may change.
"""

from power_core.chat import ChatTemplate
from power_core.config import ConfigKey, PowerConfig
from power_core.constraint import ConstraintSpec, Grammars, Vocabulary
from power_core.errors import (
    AdapterFault,
    ArtifactError,
    ArtifactMismatch,
    Cancelled,
    CapacityError,
    ConfigError,
    ConstraintError,
    PluginError,
    PowerError,
    RuntimeFault,
    SessionBusy,
    StateLost,
    StrategyNotFound,
    StrategyNotInstalled,
)
from power_core.generation import Generation, Result
from power_core.memory import PromptCache, PromptCacheStats
from power_core.plugins import get_plugins
from power_core.receipt import Receipt, token_digest
from power_core.runtime import (
    DecodeResult,
    Proposal,
    ProposalBatch,
    ProposalContext,
    Proposer,
    ProposerCapabilities,
    RequestScope,
    TargetCapabilities,
    TargetRuntime,
)
from power_core.sampling import TargetSampler
from power_core.scheduler import RoundOutcome, RoundPlan, Scheduler
from power_core.session import Session
from power_core.spec import Backend, OpenedModel, OpenRequest, ProposerRequest, Strategy, Tokenizer, hookimpl
from power_core.streaming import Stream
from power_core.tools import ToolPlan
from power_core.transaction import PHASES, CancelToken, Transaction

__all__ = [
    "PHASES",
    "AdapterFault",
    "ArtifactError",
    "ArtifactMismatch",
    "Backend",
    "CancelToken",
    "Cancelled",
    "CapacityError",
    "ChatTemplate",
    "ConfigError",
    "ConfigKey",
    "ConstraintError",
    "ConstraintSpec",
    "DecodeResult",
    "Generation",
    "Grammars",
    "OpenRequest",
    "OpenedModel",
    "PluginError",
    "PowerConfig",
    "PowerError",
    "PromptCache",
    "PromptCacheStats",
    "Proposal",
    "ProposalBatch",
    "ProposalContext",
    "Proposer",
    "ProposerCapabilities",
    "ProposerRequest",
    "Receipt",
    "RequestScope",
    "Result",
    "RoundOutcome",
    "RoundPlan",
    "RuntimeFault",
    "Scheduler",
    "Session",
    "SessionBusy",
    "StateLost",
    "Strategy",
    "StrategyNotFound",
    "StrategyNotInstalled",
    "Stream",
    "TargetCapabilities",
    "TargetRuntime",
    "TargetSampler",
    "Tokenizer",
    "ToolPlan",
    "Transaction",
    "Vocabulary",
    "get_plugins",
    "hookimpl",
    "token_digest",
]
