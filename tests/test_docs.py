"""The documentation is checked against the code it documents.

* ``docs/hooks.md``: one section per hook spec of :mod:`power_core.hookspecs`, in spec order, with the
  spec's signature (argument names and annotations) and its docstring verbatim; no section, signature
  or example names a hook that is not a spec.
* ``README.md``: the "Configuration keys" paragraph names every :meth:`PowerConfig.keys` key, and every
  ``spec_*`` key it names exists.
* ``docs/architecture.md``: the layout names every module and subpackage of ``power_core``.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from power_core import hookspecs
from power_core.config import PowerConfig

ROOT = Path(__file__).resolve().parent.parent
HOOKS_MD = ROOT / "docs" / "hooks.md"
README = ROOT / "README.md"
ARCHITECTURE = ROOT / "docs" / "architecture.md"


def _specs() -> list[str]:
    """Hook specs in the order they are defined (the transaction's order)."""
    specs = [n for n, f in vars(hookspecs).items() if n.startswith("power_") and callable(f)]
    return sorted(specs, key=lambda n: inspect.getsourcelines(getattr(hookspecs, n))[1])


SPECS = _specs()


def _sections(text: str) -> dict[str, str]:
    """``## `name` `` heading -> the text up to the next ``## `` heading."""
    parts = re.split(r"^## ", text, flags=re.M)[1:]
    out = {}
    for part in parts:
        head, _, body = part.partition("\n")
        m = re.fullmatch(r"`(\w+)`", head.strip())
        if m:
            out[m.group(1)] = body
    return out


def test_the_specs_are_found():
    assert len(SPECS) >= 5 and SPECS[0] == "power_register_strategies" and "power_txn_phase" in SPECS
    assert all(hasattr(getattr(hookspecs, n), "power_spec") for n in SPECS)  # pluggy's marker


def test_hooks_md_documents_every_spec_in_order():
    sections = _sections(HOOKS_MD.read_text())
    hook_sections = [n for n in sections if n.startswith("power_")]
    assert hook_sections == SPECS, "docs/hooks.md: one `## `power_...`` section per hook spec, in spec order"


@pytest.mark.parametrize("hook", SPECS)
def test_hooks_md_section_matches_the_spec(hook):
    body = _sections(HOOKS_MD.read_text())[hook]
    spec = getattr(hookspecs, hook)
    sig = inspect.signature(spec)
    assert f"{hook}{sig}".replace("'", "") in body, f"docs/hooks.md `{hook}`: signature differs from the spec"
    for arg in sig.parameters:
        assert re.search(rf"\b{arg}\b", body), f"docs/hooks.md `{hook}` does not name its argument {arg!r}"
    assert inspect.cleandoc(spec.__doc__ or "") in body, (
        f"docs/hooks.md `{hook}`: the text must be the spec's docstring (power_core/hookspecs.py), verbatim")


def test_hooks_md_names_no_unknown_hook():
    text = HOOKS_MD.read_text()
    packages = {"power_core", "power_native", "power_mtp", "power_dflash", "power_dflash2", "power_dspark",
                "power_suffix"}
    named = set(re.findall(r"\bpower_[a-z0-9_]+\b", text)) - packages
    assert named, "the scan found no hook names at all"
    assert named <= set(SPECS), f"docs/hooks.md names hooks that are not specs: {sorted(named - set(SPECS))}"
    # the signatures and example implementations too
    called = set(re.findall(r"^(?:def )?(power_\w+)\(", text, flags=re.M)) | set(
        re.findall(r"\bdef (power_\w+)\(", text))
    assert called and called <= set(SPECS)


def _config_paragraph() -> str:
    text = README.read_text()
    start = text.index("Configuration keys")
    end = text.find("\n\n", start)
    return text[start:end if end >= 0 else len(text)]


def test_every_config_key_is_documented_in_the_readme():
    para = _config_paragraph()
    keys = PowerConfig.keys()
    assert len(keys) >= 20
    missing = [k for k in keys if f"`{k}`" not in para]
    assert not missing, f"README.md's 'Configuration keys' paragraph lacks {missing}"


def test_readme_documents_no_unknown_config_key():
    named = set(re.findall(r"`(spec_[a-z0-9_]+)`", _config_paragraph()))
    assert named and named <= set(PowerConfig.keys()), sorted(named - set(PowerConfig.keys()))


def test_architecture_names_every_module():
    text = ARCHITECTURE.read_text()
    layout = text[text.index("## Layers"):text.index("## The transaction")]
    core = ROOT / "power_core"
    names = [p.name for p in sorted(core.glob("*.py"))]
    names += [f"{p.name}/" for p in sorted(core.iterdir()) if (p / "__init__.py").is_file()]
    assert "spec.py" in names and "serve/" in names
    missing = [n for n in names if not re.search(rf"^\s+{re.escape(n)}\s", layout, flags=re.M)]
    assert not missing, f"docs/architecture.md's layout lacks {missing}"
