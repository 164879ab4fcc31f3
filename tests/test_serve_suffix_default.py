"""``power serve`` keeps power-suffix's cross-request memory on by default (issue 45, item 5), per tenant
and bounded, the way llama-server's n-gram cache outlives a request; a library session keeps it off.

The default is the key's declaration (``ConfigKey.serve_default``): the serve command applies it to the
keys the operator set neither by flag nor in ``--config``, where a strategy the server runs owns the
key (``--mode off`` or ``draft-model`` alone get nothing they would refuse). ``--suffix-memory 0`` turns
it off."""

from __future__ import annotations

import httpx
import pytest

from power_core.config import ConfigKey, PowerConfig, config_table
from power_core.errors import PluginError
from tests.serve_helpers import served

power_suffix = pytest.importorskip("power_suffix")
from power_suffix.plugin import MEMORY_TOKENS, SERVE_MEMORY_TOKENS  # noqa: E402

KEY = "spec_suffix_memory_tokens"


def _serve(*argv: str):
    from power_core.cli import build_parser
    from power_core.commands import _serve_config, _serve_strategies

    args = build_parser().parse_args(["serve", *argv])
    return _serve_config(args, _serve_strategies(args.mode))


@pytest.mark.parametrize("argv, tokens", [
    (["--mode", "suffix"], SERVE_MEMORY_TOKENS),
    (["--mode", "suffix,off"], SERVE_MEMORY_TOKENS),  # one lane runs suffix
    (["--mode", "suffix", "--suffix-memory", "0"], 0),  # the operator's off switch
    (["--mode", "suffix", "--suffix-memory", "4096"], 4096),
    (["--mode", "off"], 0),  # no strategy of the server reads it: not set (a set key would be refused)
    (["--mode", "auto"], 0),
    ([], 0),
])
def test_serve_turns_the_memory_on_where_suffix_runs(argv, tokens):
    config = _serve(*argv)
    assert config.spec_suffix_memory_tokens == tokens
    assert (KEY in dict(config.options)) == (tokens != 0)


@pytest.mark.parametrize("body, tokens", [
    ('spec_mode = "suffix"\n', SERVE_MEMORY_TOKENS),
    (f'spec_mode = "suffix"\n{KEY} = 0\n', 0),  # the file's setting, 0 included, is the operator's
    (f'[power]\nspec_mode = "suffix"\n{KEY} = 512\n', 512),
])
def test_a_config_files_setting_is_kept(tmp_path, body, tokens):
    path = tmp_path / "power.toml"
    path.write_text(body)
    assert _serve("--config", str(path)).spec_suffix_memory_tokens == tokens


def test_the_library_and_power_run_keep_it_off():
    from power_core.cli import build_parser
    from power_core.commands import _config_from_args

    assert PowerConfig(spec_mode="suffix").spec_suffix_memory_tokens == 0
    assert _config_from_args(build_parser().parse_args(["run", "--mode", "suffix"])).spec_suffix_memory_tokens == 0


def test_the_serve_default_is_declared_checked_and_tabled():
    assert MEMORY_TOKENS.serve_default == SERVE_MEMORY_TOKENS > 0
    assert f"`0` (serve: `{SERVE_MEMORY_TOKENS}`)" in config_table([MEMORY_TOKENS])
    with pytest.raises(PluginError, match="serve_default"):
        ConfigKey(name="spec_x_budget", type=int, default=0, lo=0, hi=10, serve_default=11)


def _sources(url: str, prompt: str, user: str) -> dict:
    """A completion of ``prompt`` for ``user``; the draft sources its receipt counts."""
    with httpx.Client(base_url=url, timeout=120) as c:
        r = c.post("/v1/completions", json={"model": c.get("/v1/models").json()["data"][0]["id"], "prompt": prompt,
                                            "max_tokens": 24, "user": user})
        assert r.status_code == 200, r.text
        return c.get(f"/v1/receipts/{r.json()['id']}").json()["receipt"]["proposer"]["sources"]


@pytest.mark.slow
@pytest.mark.parametrize("off", [False, True], ids=["default", "suffix-memory-0"])
def test_a_served_tenant_drafts_from_its_own_earlier_answer_by_default(off):
    """The same question twice from alice: the second answer is drafted from the first one's, which the
    server learned (shared source); bob's is not (per tenant). With ``--suffix-memory 0`` nothing is."""
    prompt = "zq vex plom, trask yurn: "
    with served("--backend", "reference", "--n-ctx", "256", "--mode", "suffix",
                *(["--suffix-memory", "0"] if off else [])) as s:
        first = _sources(s.url, prompt, "alice")
        again = _sources(s.url, prompt, "alice")
        bob = _sources(s.url, prompt, "bob")
    assert "shared" not in first and "shared" not in bob
    if off:
        assert "shared" not in again
    else:
        assert again["shared"]["accepted"] > 0, again
