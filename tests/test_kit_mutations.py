"""Mutation tests of the conformance kit: broken copies of the tutorial adapter must each fail it.

Each mutant is the tutorial's ``power_lookup.py`` with one realistic bug. The kit runs on it in a
separate pytest process, exactly as an adapter author runs it, and the check that exists to catch
that bug must fail with its own message. The unmodified tutorial passes the same harness, so a
failure here is the mutant's, not the harness's.
"""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TUTORIAL = ROOT / "docs" / "tutorial" / "power-lookup" / "power_lookup.py"

#: name -> (exact text of the tutorial, its broken replacement, checks that must fail, phrase in their message)
MUTANTS: dict[str, tuple[str, str, set[str], str]] = {
    "noop-restore": (
        "        self.tokens = self.tokens[:checkpoint]",
        "        pass  # forgot to undo the round",
        {"test_fault_at_each_step_restores", "test_cancel_at_each_step_restores"},
        "restore(checkpoint) did not return the proposer to the state checkpoint() saw",
    ),
    "k-plus-one": (
        "return Proposal(hist[start:start + ctx.k].astype(np.int32))",
        "return Proposal(hist[start:start + ctx.k + 1].astype(np.int32))",
        {"test_greedy_parity"},
        "but the round allows at most ctx.k=",
    ),
    "out-of-vocab": (
        "        return Proposal.none()  # no earlier occurrence: nothing worth verifying",
        "        return Proposal(np.full(min(ctx.k, 1), self.n_vocab, dtype=np.int32))  # an 'unknown' filler",
        {"test_greedy_parity"},
        "outside [0, 97) (the target's n_vocab)",
    ),
    "stale-history": (
        "self.tokens = np.concatenate((self.tokens, emitted)).astype(np.int32)",
        "self.tokens = np.concatenate((self.tokens, emitted[:n_accepted])).astype(np.int32)",
        {"test_proposals_follow_the_history"},
        "but a fresh request on the same history offered",
    ),
    "leaks-across-requests": (
        "        self.tokens = np.array(prompt, dtype=np.int32)",
        "        self.tokens = np.concatenate((self.tokens, prompt)).astype(np.int32)",
        {"test_requests_are_independent"},
        "state leaked from an earlier request",
    ),
    "undeclared-capabilities": (
        "    capabilities = ProposerCapabilities()  # nothing beyond the protocol: no draft model, nothing to close\n",
        "",
        {"test_declares_capabilities"},
        "declares no capabilities",
    ),
    "bare-array": (
        "return Proposal(hist[start:start + ctx.k].astype(np.int32))",
        "return hist[start:start + ctx.k].astype(np.int32)",
        {"test_greedy_parity"},
        "not a Proposal; return power_core.Proposal(ids)",
    ),
    "one-instance-for-every-sequence": (
        "    return LookupProposer(n_vocab, max_ngram=request.config.lookup_max_ngram)  # the key, as declared",
        "    global _ONE\n    _ONE = globals().get('_ONE') or LookupProposer(n_vocab)\n"
        "    return _ONE  # cached: every session gets the same instance",
        {"test_shared_passes_parity"},
        "the proposer's state is shared with another sequence's",
    ),
}

KIT = '''
from power_core.testing import AdapterConformance
import adapter_under_test


class TestAdapter(AdapterConformance):
    k = 4

    def strategy(self):
        found = []
        adapter_under_test.power_register_strategies(register=found.append)
        return found[0]

    def prompt(self, seed, n_vocab):  # as the tutorial's own test does
        base = super().prompt(seed, n_vocab)
        return base + base + base[:2]
'''


def run_kit(tmp_path: Path, source: str) -> dict[str, list[str]]:
    """Run the kit on ``source`` in a fresh pytest process; check name -> failure messages ('' if passed)."""
    (tmp_path / "adapter_under_test.py").write_text(source)
    (tmp_path / "test_kit.py").write_text(KIT)
    env = {**os.environ, "POWER_LOAD_PLUGINS": "",  # only the adapter under test, not an installed "lookup"
           "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
                           "--junitxml", str(tmp_path / "kit.xml"), "test_kit.py"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert (tmp_path / "kit.xml").exists(), proc.stdout + proc.stderr
    out: dict[str, list[str]] = {}
    for case in ET.parse(tmp_path / "kit.xml").getroot().iter("testcase"):
        check = case.get("name", "").split("[")[0]
        failure = case.find("failure")
        if failure is None:
            failure = case.find("error")
        out.setdefault(check, []).append("" if failure is None else (failure.get("message", "") + failure.text))
    return out


def test_the_tutorial_adapter_passes_the_harness(tmp_path):
    results = run_kit(tmp_path, TUTORIAL.read_text())
    failed = {check: msgs for check, msgs in results.items() if any(msgs)}
    assert len(results) >= 14 and not failed, failed


@pytest.mark.parametrize("mutant", sorted(MUTANTS))
def test_each_broken_adapter_fails_the_kit(tmp_path, mutant):
    old, new, checks, phrase = MUTANTS[mutant]
    source = TUTORIAL.read_text()
    assert source.count(old) == 1, f"the tutorial changed: update mutant {mutant!r}"
    results = run_kit(tmp_path, source.replace(old, new))
    failures = {check: [m for m in msgs if m] for check, msgs in results.items()}
    caught = {check for check in checks if failures.get(check)}
    assert caught, (f"mutant {mutant!r} passed {sorted(checks)}; failing checks: "
                    f"{sorted(c for c, m in failures.items() if m)}")
    assert any(phrase in m for check in caught for m in failures[check]), \
        f"mutant {mutant!r} failed {sorted(caught)} without saying {phrase!r}"
