"""Artifacts fail closed: bounded GGUF inspection, identity, binding, vocabulary, contract helpers.

Pure Python (``gguf`` constants + numpy); nothing here touches native code.
"""

from power_core.artifacts.archs import LLAMA_ARCHS
from power_core.artifacts.binding import (
    BINDING_FORMAT,
    BINDING_KEY,
    MODEL_FORMAT,
    Binding,
    ManifestEntry,
    check_binding,
    read_binding,
    read_model_manifest,
    register_draft,
    write_binding,
)
from power_core.artifacts.contracts import Verified, classify_draft, discriminate_draft, mtp_evidence
from power_core.artifacts.identity import Digest, file_digest, sha256_file, vocab_digest
from power_core.artifacts.reader import Limits
from power_core.artifacts.target import check_architecture, check_target
from power_core.artifacts.verify import VerifiedArtifacts, verify_artifacts
from power_core.artifacts.view import ArraySummary, ArtifactView, TensorInfo, Vocabulary, inspect_gguf
from power_core.artifacts.vocab import VocabMatch, compare_vocab

__all__ = [
    "ArtifactView", "ArraySummary", "TensorInfo", "Vocabulary", "inspect_gguf", "Limits",
    "Digest", "file_digest", "sha256_file", "vocab_digest",
    "Binding", "ManifestEntry", "BINDING_KEY", "BINDING_FORMAT", "MODEL_FORMAT",
    "read_binding", "check_binding", "write_binding", "read_model_manifest", "register_draft",
    "VocabMatch", "compare_vocab", "Verified", "classify_draft", "discriminate_draft", "mtp_evidence",
    "VerifiedArtifacts", "verify_artifacts", "check_target", "check_architecture", "LLAMA_ARCHS",
]
