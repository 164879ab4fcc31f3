"""The documentation is checked against the code it documents.

* ``docs/hooks.md``: one section per hook spec of :mod:`power_core.hookspecs`, in spec order, with the
  spec's signature (argument names and annotations) and its docstring verbatim; no section, signature
  or example names a hook that is not a spec.
* ``README.md``: the configuration table is the keys' declarations (core and installed first-party
  strategies), its TOML example loads, and every ``spec_*`` key its notes name exists.
* ``docs/architecture.md``: the layout names every module and subpackage of ``power_core``.
* ``docs/serving.md``: its request-field table is ``power serve``'s one table of field rules
  (:data:`power_core.serve.protocol.FIELDS`), row for row: every no-op and refused field is listed.
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
SERVING = ROOT / "docs" / "serving.md"


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
    start = text.index("Notes on the configuration keys")
    end = text.find("\n\n", start)
    return text[start:end if end >= 0 else len(text)]


def _config_table() -> str:
    text = README.read_text()
    start = text.index("<!-- config-table")
    start = text.index("\n", start) + 1
    return text[start:text.index("<!-- /config-table -->", start)].strip()


def _first_party_keys():
    from power_core.config import declared_keys
    from power_core.plugins import get_plugins
    from power_core.spec import FIRST_PARTY_PACKAGES

    installed = get_plugins().strategies.names()
    return declared_keys([n for n in installed if n == "off" or n in FIRST_PARTY_PACKAGES])


def test_readme_configuration_table_is_the_declarations():
    """The README's table (key, flag, default, scope, owner) is what the core and the installed first-party
    strategies declare; regenerate it with ``power_core.config.config_table`` when a key changes."""
    from power_core.config import config_table

    keys = _first_party_keys()
    assert len(keys) >= 20 and PowerConfig.keys()[:20] == tuple(k.name for k in keys)[:20]
    table = _config_table()
    expected = config_table(keys)
    if expected != table:  # a plugin not installed here: its rows are not checked, every other row is
        rows = set(expected.splitlines())
        missing = rows - set(table.splitlines())
        assert not missing, f"README.md's configuration table lacks or misstates {sorted(missing)}"


def test_readme_toml_example_is_a_valid_configuration(tmp_path):
    text = README.read_text()
    start = text.index("```toml", text.index("<!-- /config-table -->"))
    body = text[text.index("\n", start) + 1:text.index("```", start + 7)]
    path = tmp_path / "power.toml"
    path.write_text(body)
    cfg = PowerConfig.from_toml(path)
    assert cfg.spec_mode == "dflash" and cfg.spec_draft_p_min == 0.3


def test_readme_notes_name_only_known_keys():
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


def test_serving_md_lists_every_request_field_rule():
    """Issue 45: fields that cannot change the output are no-ops, and the docs list them; the table in
    ``docs/serving.md`` is the code's (regenerate it with ``fields_markdown()``)."""
    pytest.importorskip("pydantic")
    from power_core.serve.protocol import FIELDS, fields_markdown

    text = SERVING.read_text()
    assert fields_markdown() in text, ("docs/serving.md: the request-field table differs from "
                                       "power_core.serve.protocol.FIELDS (paste fields_markdown())")
    for rule in ("no-op", "refused"):
        for f in FIELDS:
            if f.rule == rule:
                assert f"| `{f.name}` | both | {rule} |" in text, f.name


def _hops() -> list[tuple[str, str]]:
    """(dotted name, file) of every row of docs/architecture.md's "One request, hop by hop" table."""
    text = ARCHITECTURE.read_text()
    section = text[text.index("### One request, hop by hop"):]
    section = section[:section.index("\n**")]
    return re.findall(r"^\| \d+ \| `([\w.<>]+)` \| ([\w/.]+) \|", section, flags=re.M)


def test_every_hop_of_the_request_path_exists():
    import importlib

    hops = _hops()
    assert len(hops) >= 10, hops
    for dotted, file in hops:
        parts = dotted.split(".")
        for cut in range(len(parts) - 1, 0, -1):  # the longest importable module prefix
            try:
                obj = importlib.import_module(".".join(parts[:cut]))
                break
            except ImportError:
                continue
        else:
            raise AssertionError(f"{dotted}: no module")
        assert obj.__file__ is not None and obj.__file__.endswith(file.split("/")[-1]), (dotted, file, obj.__file__)
        for name in parts[cut:]:
            if name == "<locals>":
                continue
            if not hasattr(obj, name):  # a nested function: named in its enclosing function's code
                code = getattr(obj, "__code__", None)
                assert code is not None and name in {c.co_name for c in code.co_consts if hasattr(c, "co_name")}, dotted
                break
            obj = getattr(obj, name)


#: #46's rule for the product's modules (docs/architecture.md, "Layers"): each does one job, which its opening
#: text names, in at most this many lines
MODULE_LINES_MAX = 700


def _product_modules() -> list[Path]:
    """Every source file of the product: the core, the native layer, and the plugins' packages (not their tests,
    nor a local build's generated sources)."""
    roots = [ROOT / "power_core", ROOT / "native" / "src" / "power_native",
             *sorted(p for p in (ROOT / "plugins").glob("*/power_*") if p.is_dir())]
    return sorted(f for r in roots for f in r.rglob("*") if f.suffix in {".py", ".pyx", ".pxi", ".pxd"}
                  and "__pycache__" not in f.parts)


def _opening_text(path: Path) -> str:
    """A module's docstring, or (a Cython file included into another, whose docstring it cannot have) its
    opening comment, past the ``# cython:``/``# distutils:`` directives."""
    lines = [ln for ln in path.read_text().splitlines() if not re.match(r"#\s*(cython|distutils):", ln)]
    text = "\n".join(lines).lstrip()
    if text.startswith('"""'):
        return text[3:text.index('"""', 3)].strip()
    comment = []
    for ln in text.splitlines():
        if not ln.startswith("#"):
            break
        comment.append(ln.lstrip("# "))
    return " ".join(comment).strip()


def test_every_product_module_says_its_job_in_at_most_700_lines():
    modules = _product_modules()
    assert len(modules) > 60 and ROOT / "power_core" / "transaction.py" in modules
    assert any(m.suffix == ".pyx" for m in modules) and any("plugins" in m.relative_to(ROOT).parts[:1] for m in modules)
    long = {str(m.relative_to(ROOT)): n for m in modules if (n := len(m.read_text().splitlines())) > MODULE_LINES_MAX}
    assert not long, f"modules over {MODULE_LINES_MAX} lines: {long}; split one by job (docs/architecture.md)"
    silent = [str(m.relative_to(ROOT)) for m in modules
              if m.name != "__init__.py" and len(_opening_text(m)) < 20]
    assert not silent, f"modules whose opening text does not name their job: {silent}"
