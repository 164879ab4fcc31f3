"""The target validator fails closed: ``power validate --target F``, ``power run --model F`` and
``Session.open`` refuse the same malformed targets with the same reason codes, before any backend
opens the file; the architecture table is the pinned llama.cpp's own."""

from __future__ import annotations

import glob
import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import power_core.plugins as plugins_mod
from power_core.artifacts import archs, contracts, synthetic
from power_core.artifacts.archs import (
    FINAL_TAP_ARCHS,
    LAYER_INPUT_ARCHS,
    LLAMA_ARCHS,
    PINNED_SDIST_SHA256,
    archs_from_source,
    tap_archs_from_source,
)
from power_core.artifacts.target import check_target
from power_core.artifacts.view import ArtifactView
from power_core.cli import main
from power_core.config import PowerConfig
from power_core.errors import ArtifactError
from power_core.plugins import Backend, build_plugins, hookimpl
from power_core.session import Session

TRUNCATED = set(synthetic.TRUNCATION.split("|"))


# -- a backend that must never be reached by a rejected file ---------------------------------------

class Reached(Exception):
    """The sentinel backend's open ran: the file got past every check."""


class _Sentinel:
    __name__ = "sentinel"

    @hookimpl
    def power_register_backends(self, register):
        def _open(req):
            raise Reached(req.model)

        register(Backend(name="sentinel", version="1", package="tests", open=_open, accepts=lambda m: True))


def sentinel_plugins(extra=()):
    return build_plugins(extra=(_Sentinel(), *extra))


@pytest.fixture
def sentinel_cli(monkeypatch):
    """``power run`` in-process with the sentinel backend added (select it with --backend sentinel)."""
    real = plugins_mod.build_plugins
    monkeypatch.setattr(plugins_mod, "build_plugins", lambda extra=(): real(extra=(_Sentinel(), *extra)))


# -- the files ------------------------------------------------------------------------------------

def _padded_target_spec() -> synthetic.GGUFSpec:
    """A valid target whose last tensor (12 bytes) is followed by 20 bytes of alignment padding."""
    spec = synthetic.target_spec(mtp=False, arch="llama")
    spec.tensors["zz_probe.weight"] = ((3,), "F32")
    return spec


def _no_arch(blob: bytes) -> bytes:
    key = b"general.architecture"
    i = blob.index(struct.pack("<Q", len(key)) + key) + 8
    return blob[:i] + b"general.architecturX" + blob[i + len(key):]  # same length: the file stays well formed


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, tuple[Path, str | None]]:
    """name -> (path, expected reason or None for a valid target)."""
    d = tmp_path_factory.mktemp("targets")
    good = _padded_target_spec().write(d / "good.gguf")
    plain = synthetic.target_spec(mtp=False, arch="llama").write(d / "plain.gguf")
    blob = good.read_bytes()
    alien = _padded_target_spec()
    alien.arch = "alienformer"
    alien.kv = {k.replace("llama.", "alienformer.", 1): v for k, v in alien.kv.items()}
    gptj = synthetic.target_spec(mtp=False, arch="gptj")  # named by llama.cpp, but no model class loads it
    empty = synthetic.target_spec(mtp=False, arch="llama")
    empty.tensors.clear()
    corpus = synthetic.malformed_corpus(plain, d / "corpus")
    out: dict[str, tuple[Path, str | None]] = {"good": (good, None), "plain": (plain, None)}
    (d / "no_arch.gguf").write_bytes(_no_arch(blob))
    out["no_arch"] = (d / "no_arch.gguf", "arch_missing")
    out["unknown_arch"] = (alien.write(d / "alien.gguf"), "arch_unknown")
    out["classless_arch"] = (gptj.write(d / "gptj.gguf"), "arch_unknown")
    out["no_tensors"] = (empty.write(d / "empty.gguf"), "target_no_tensors")
    (d / "last_byte.gguf").write_bytes(blob[:-1])
    out["last_byte"] = (d / "last_byte.gguf", "gguf_truncated")
    (d / "plain_last_byte.gguf").write_bytes(plain.read_bytes()[:-1])
    out["plain_last_byte"] = (d / "plain_last_byte.gguf", "gguf_tensor_out_of_bounds")
    for name in ("tensor_offset_past_eof", "tensor_dim_huge", "truncated_data", "n_tensors_lie", "n_kv_lie",
                 "array_count_lie", "tensor_type_bad", "tensor_dim_zero", "tensor_offset_misaligned"):
        out[name] = corpus[name]
    return out


BAD = ["no_arch", "unknown_arch", "classless_arch", "no_tensors", "last_byte", "plain_last_byte",
       "tensor_offset_past_eof", "tensor_dim_huge", "truncated_data", "n_tensors_lie", "n_kv_lie", "array_count_lie",
       "tensor_type_bad", "tensor_dim_zero", "tensor_offset_misaligned"]


def _validate(path, *extra):
    return main(["validate", "--target", str(path), *extra])


def _run(path, *extra):
    return main(["run", "--model", str(path), "--backend", "sentinel", "--max-tokens", "2", "--prompt", "1 2",
                 *extra])


# -- the valid files pass every path (so the rejections below are about the defects) -----------------

@pytest.mark.parametrize("name", ["good", "plain"])
def test_valid_targets_verify_and_reach_the_backend(files, name, capsys, sentinel_cli):
    path, _ = files[name]
    assert _validate(path, "--json") == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] is True and out["mode"] == "off" and len(out["artifacts"]["target"]) == 64
    with pytest.raises(Reached):
        Session.open(PowerConfig(), model=str(path), backend="sentinel", plugins=sentinel_plugins())
    with pytest.raises(Reached):
        _run(path)
    capsys.readouterr()


# -- every rejection: same code through validate (human, --json, every mode), run, Session.open --------

@pytest.mark.parametrize("name", BAD)
def test_malformed_target_rejected_everywhere(files, name, capsys, sentinel_cli):
    path, reason = files[name]
    assert reason is not None
    for mode in ("auto", "off", "mtp"):
        assert _validate(path, "--mode", mode, "--json") == 2, (name, mode)
        out = json.loads(capsys.readouterr().out)
        assert out["ok"] is False and out["code"] == reason and out["evidence"], (name, mode, out)
    assert _validate(path) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error[{reason}]: ") and "Traceback" not in err

    assert _run(path, "--json") == 2  # Reached would propagate: the backend was never asked to open it
    cap = capsys.readouterr()
    out = json.loads(cap.out)
    assert out == {"ok": False, "code": reason, "message": out["message"], "evidence": out["evidence"]}
    assert f"error[{reason}]" in cap.err
    assert _run(path) == 2
    assert capsys.readouterr().err.startswith(f"error[{reason}]: ")

    with pytest.raises(ArtifactError) as ei:
        Session.open(PowerConfig(), model=str(path), backend="sentinel", plugins=sentinel_plugins())
    assert ei.value.reason == reason and ei.value.code == reason


def test_bind_checks_the_target_too(files, fixtures_dir, capsys):
    path, reason = files["no_arch"]
    assert main(["bind", "--target", str(path), "--draft", str(fixtures_dir["dflash"]), "--no-register",
                 "--json"]) == 2
    assert json.loads(capsys.readouterr().out)["code"] == reason


def test_reasons_name_the_evidence(files):
    for name, key in (("no_arch", "general.architecture"), ("unknown_arch", "general.architecture"),
                      ("no_tensors", "n_tensors"), ("last_byte", "zz_probe.weight")):
        with pytest.raises(ArtifactError) as ei:
            check_target(ArtifactView.from_gguf(files[name][0]))
        assert ei.value.evidence == key, name
    with pytest.raises(ArtifactError, match="alienformer"):
        check_target(ArtifactView.from_gguf(files["unknown_arch"][0]))


# -- truncation at any offset, the last byte included ----------------------------------------------

@pytest.fixture(scope="module")
def good_blob(files) -> bytes:
    return files["good"][0].read_bytes()


def _check_cut(blob: bytes, n: int, path: Path) -> str:
    path.write_bytes(blob[:n])
    with pytest.raises(ArtifactError) as ei:
        check_target(ArtifactView.from_gguf(path))
    assert ei.value.reason in TRUNCATED, (n, ei.value.reason)
    return ei.value.reason


def test_every_cut_in_the_padding_and_the_last_tensor(good_blob, tmp_path):
    view_end = len(good_blob)
    reasons = {_check_cut(good_blob, n, tmp_path / "cut.gguf") for n in range(view_end - 64, view_end)}
    # the 20 padding bytes are caught as gguf_truncated, cuts into the 12 data bytes as out of bounds
    assert reasons == {"gguf_truncated", "gguf_tensor_out_of_bounds"}


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(frac=st.floats(0, 1, exclude_max=True))
@example(frac=0.0)
def test_truncated_anywhere(good_blob, tmp_path, frac):
    _check_cut(good_blob, int(frac * len(good_blob)), tmp_path / "cut.gguf")


@pytest.mark.parametrize("cut", [1, 2, 7, 31, 32, 33, 4096])
def test_truncated_from_the_end_through_validate_and_run(good_blob, tmp_path, capsys, sentinel_cli, cut):
    p = tmp_path / "cut.gguf"
    p.write_bytes(good_blob[:-cut])
    assert _validate(p, "--json") == 2
    assert json.loads(capsys.readouterr().out)["code"] in TRUNCATED
    assert _run(p, "--json") == 2
    assert json.loads(capsys.readouterr().out)["code"] in TRUNCATED


def test_trailing_bytes_are_not_truncation(good_blob, tmp_path):
    p = tmp_path / "longer.gguf"
    p.write_bytes(good_blob + b"\0" * 7)
    assert check_target(ArtifactView.from_gguf(p)).architecture == "llama"


# -- the architecture table ------------------------------------------------------------------------

def test_every_architecture_list_is_drawn_from_the_table():
    for name in ("MTP_ARCHS", "MTP_SINGLE_BLOCK_ARCHS", "MTP_CHAINED_ARCHS", "LAYER_INPUT_ARCHS", "FINAL_TAP_ARCHS"):
        assert getattr(contracts, name) <= LLAMA_ARCHS, (name, sorted(getattr(contracts, name) - LLAMA_ARCHS))
    assert contracts.DFLASH_ARCH in LLAMA_ARCHS
    assert {"llama", "gemma3", "qwen35"} <= LLAMA_ARCHS and not {"gptj", "(unknown)", ""} & LLAMA_ARCHS


def test_the_table_is_the_generated_form():
    text = Path(archs.__file__).read_text()
    assert archs.render(LLAMA_ARCHS) in text
    assert archs.render(LAYER_INPUT_ARCHS, name="LAYER_INPUT_ARCHS") in text
    assert archs.render(FINAL_TAP_ARCHS, name="FINAL_TAP_ARCHS") in text


def test_the_validator_uses_the_generated_tap_tables():
    # one table, not a copy that can drift: contracts re-exports archs' (and power-native imports it)
    assert contracts.LAYER_INPUT_ARCHS is LAYER_INPUT_ARCHS and contracts.FINAL_TAP_ARCHS is FINAL_TAP_ARCHS
    assert FINAL_TAP_ARCHS <= LAYER_INPUT_ARCHS <= LLAMA_ARCHS
    # general.architecture names (LLM_ARCH_NAMES), not src/models/*.cpp file names
    assert {"hunyuan_vl", "gpt-oss", "nemotron_h"} <= LAYER_INPUT_ARCHS
    assert not {"hunyuan-vl", "openai-moe", "nemotron-h"} & LAYER_INPUT_ARCHS


def test_parser_keeps_only_named_archs_with_a_model_class(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "llama-arch.cpp").write_text(
        'static const std::map<llm_arch, const char *> LLM_ARCH_NAMES = {\n'
        '    { LLM_ARCH_LLAMA,   "llama"     },\n    { LLM_ARCH_GPTJ, "gptj" },\n'
        '    { LLM_ARCH_UNKNOWN, "(unknown)" },\n};\n')
    (src / "llama-model.cpp").write_text(
        "static llama_model * llama_model_mapping(llm_arch arch, const llama_model_params & params) {\n"
        "    switch (arch) {\n        case LLM_ARCH_LLAMA:\n            return new llama_model_llama(params);\n"
        "        default:\n            throw 1;\n    }\n}\n")
    assert archs_from_source(tmp_path) == {"llama"}
    (src / "llama-model.cpp").write_text("nothing here\n")
    with pytest.raises(ValueError, match="layout"):
        archs_from_source(tmp_path)


def _tap_tree(root: Path, graph_cpp: dict[str, str]) -> Path:
    """A minimal llama.cpp tree: four archs, their classes, and ``src/models/<file>`` graph sources."""
    src = root / "src"
    (src / "models").mkdir(parents=True)
    (src / "llama-arch.cpp").write_text(
        'static const std::map<llm_arch, const char *> LLM_ARCH_NAMES = {\n'
        '    { LLM_ARCH_LLAMA, "llama" },\n    { LLM_ARCH_HUNYUAN_VL, "hunyuan_vl" },\n'
        '    { LLM_ARCH_HUNYUAN_DENSE, "hunyuan-dense" },\n    { LLM_ARCH_GEMMA3N, "gemma3n" },\n'
        '    { LLM_ARCH_DEEPSEEK4, "deepseek4" },\n    { LLM_ARCH_UNKNOWN, "(unknown)" },\n};\n')
    (src / "llama-model.cpp").write_text(
        "static llama_model * llama_model_mapping(llm_arch arch, const llama_model_params & params) {\n"
        "    switch (arch) {\n"
        "        case LLM_ARCH_LLAMA:\n            return new llama_model_llama(params);\n"
        "        case LLM_ARCH_HUNYUAN_VL:\n            return new llama_model_hunyuan_vl(params);\n"
        "        case LLM_ARCH_HUNYUAN_DENSE:\n            return new llama_model_hunyuan_dense(params);\n"
        "        case LLM_ARCH_GEMMA3N:\n            return new llama_model_gemma3n(params);\n"
        "        case LLM_ARCH_DEEPSEEK4:\n            return new llama_model_deepseek4(params);\n"
        "        default:\n            throw 1;\n    }\n}\n")
    (src / "models" / "models.h").write_text(
        "struct llama_model_llama : public llama_model_base {\n    template <bool embed>\n"
        "    struct graph : public llm_graph_context {};\n};\n\n"
        "struct llama_model_hunyuan_vl : public llama_model_base {\n"
        "    struct graph : public llm_graph_context {};\n};\n\n"
        "struct llama_model_hunyuan_dense : public llama_model_hunyuan_vl {\n"
        "    using graph = llama_model_hunyuan_vl::graph;\n};\n\n"
        "struct llama_model_gemma3n : public llama_model_base {\n"
        "    struct graph : public llm_graph_context {};\n};\n\n"
        "struct llama_model_deepseek4 : public llama_model_base {\n    struct graph : public llm_graph_context {};\n"
        "    struct graph_mtp : public llm_graph_context {};\n};\n")
    for name, text in graph_cpp.items():
        (src / "models" / name).write_text(text)
    return root


def _graph(cls: str, body: str, *, template: str = "") -> str:
    return (f"std::unique_ptr<llm_graph_context> {cls}::build_arch_graph(const llm_graph_params & params) const {{\n"
            f"    return std::make_unique<graph{template}>(*this, params);\n}}\n\n"
            f"{cls}::graph{template}::graph(const llama_model & model, const llm_graph_params & params) {{\n"
            f"    for (int il = 0; il < n_layer; ++il) {{\n{body}    }}\n}}\n")


_TAP_SOURCES = {
    "llama.cpp": _graph("llama_model_llama", "        res->t_layer_inp[il] = inpL;\n", template="<false>"),
    "hunyuan-vl.cpp": _graph("llama_model_hunyuan_vl", "        res->t_layer_inp[il] = inpL;\n"),
    # hunyuan_dense reuses hunyuan_vl's graph through `using graph = ...`
    "hunyuan-dense.cpp": ("std::unique_ptr<llm_graph_context> llama_model_hunyuan_dense::build_arch_graph("
                          "const llm_graph_params & params) const {\n"
                          "    return std::make_unique<graph>(*this, params);\n}\n"),
    "gemma3n.cpp": _graph("llama_model_gemma3n", "        cur = inpL;\n"),  # records nothing
    "deepseek4.cpp": _graph("llama_model_deepseek4", "        res->t_layer_inp[il] = inpL;\n")
    + "void llama_model_deepseek4::graph::finish() {\n    res->t_layer_inp[n_layer] = cur;\n"
    "    GGML_ASSERT(res->t_layer_inp[n_layer] != nullptr);\n}\n"
    + "llama_model_deepseek4::graph_mtp::graph_mtp() {\n    res->t_layer_inp[il] = cur;\n}\n",
}


def test_tap_parser_follows_classes_aliases_and_names(tmp_path):
    taps, final = tap_archs_from_source(_tap_tree(tmp_path, _TAP_SOURCES))
    # arch *names* from LLM_ARCH_NAMES (hunyuan_vl, not the file name hunyuan-vl); an alias shares the graph
    assert taps == {"llama", "hunyuan_vl", "hunyuan-dense", "deepseek4"}
    assert final == {"deepseek4"}


def test_tap_parser_refuses_a_layout_it_cannot_place(tmp_path):
    stray = dict(_TAP_SOURCES, **{"gemma3n.cpp": "static void helper() {\n    res->t_layer_inp[il] = x;\n}\n"})
    with pytest.raises(ValueError, match="layout"):
        tap_archs_from_source(_tap_tree(tmp_path / "stray", stray))
    odd = dict(_TAP_SOURCES, **{"gemma3n.cpp": _graph("llama_model_gemma3n", "    res->t_layer_inp[il + 1] = x;\n")})
    with pytest.raises(ValueError, match="layout"):
        tap_archs_from_source(_tap_tree(tmp_path / "odd", odd))
    with pytest.raises(ValueError, match="layout"):
        tap_archs_from_source(_tap_tree(tmp_path / "none", {}))


def _pinned_source() -> Path | None:
    try:
        from power_native import build_info

        src = build_info().get("source")
        if src and Path(src, "src", "llama-arch.cpp").exists():
            return Path(src)
    except ImportError:
        pass
    root = Path(os.environ.get("POWER_NATIVE_CACHE", Path.home() / ".cache" / "power-native"))
    hits = sorted(glob.glob(str(root / f"src-{PINNED_SDIST_SHA256[:12]}*" / "llama.cpp" / "src" / "llama-arch.cpp")))
    return Path(hits[0]).parents[1] if hits else None


def _absent(why: str) -> None:
    """Skip on a partial developer install; CI (CI=true, nox installs everything) must not skip."""
    (pytest.fail if os.environ.get("CI") else pytest.skip)(why)


def test_table_matches_the_pinned_llama_cpp_source():
    src = _pinned_source()
    if src is None:
        _absent("the pinned llama.cpp source is not on this machine (build power-native to get it)")
    got = archs_from_source(src)
    assert got == LLAMA_ARCHS, {"missing": sorted(got - LLAMA_ARCHS), "extra": sorted(LLAMA_ARCHS - got)}


def test_tap_tables_match_the_pinned_llama_cpp_source():
    src = _pinned_source()
    if src is None:
        _absent("the pinned llama.cpp source is not on this machine (build power-native to get it)")
    taps, final = tap_archs_from_source(src)
    assert taps == LAYER_INPUT_ARCHS, {"missing": sorted(taps - LAYER_INPUT_ARCHS),
                                       "extra": sorted(LAYER_INPUT_ARCHS - taps)}
    assert final == FINAL_TAP_ARCHS, {"missing": sorted(final - FINAL_TAP_ARCHS),
                                      "extra": sorted(FINAL_TAP_ARCHS - final)}
    # the pinned LLM_ARCH_NAMES spells it hunyuan_vl; its graph (src/models/hunyuan-vl.cpp) records taps
    assert '{ LLM_ARCH_HUNYUAN_VL,       "hunyuan_vl"       }' in (src / "src" / "llama-arch.cpp").read_text()
    assert "hunyuan_vl" in taps and "hunyuan-vl" not in taps
    assert "gemma3n" not in taps  # its graph never sets t_layer_inp: a tap would trip the GGML_ASSERT


def test_native_tap_call_uses_the_validators_table():
    try:
        from power_native import _llama
    except ImportError:
        _absent("power-native is not installed")
    assert _llama.LAYER_INP_ARCHS is LAYER_INPUT_ARCHS and _llama.LAYER_INP_FINAL_ARCHS is FINAL_TAP_ARCHS


def test_table_and_native_build_share_the_pin():
    try:
        import power_native
    except ImportError:
        _absent("power-native is not installed")
    pinned = power_native.build_info().get("sdist_sha256")
    if pinned is None:
        _absent("power-native has no build-info.json (not built from the pinned sdist)")
    assert pinned == PINNED_SDIST_SHA256, "power-native moved its pin: regenerate power_core/artifacts/archs.py"


# -- the real models: still verified and still run; truncated by one byte, refused --------------------

def _real_models() -> list:
    try:
        from power_native.models import gemma3_path, smollm2_path
    except ImportError:
        return []
    out = []
    for name, fn in (("smollm2", smollm2_path), ("gemma3", gemma3_path)):
        try:
            out.append(pytest.param(str(fn()), id=name))
        except ArtifactError:
            pass
    return out


REAL = _real_models()


def _cli(*argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(Path(__file__).resolve().parents[2]),
                                                                      os.environ.get("PYTHONPATH"))))}
    return subprocess.run([sys.executable, "-m", "power_core.cli", *argv], capture_output=True, text=True,
                          timeout=300, env=env)


@pytest.mark.model
@pytest.mark.native
@pytest.mark.parametrize("model", REAL or [pytest.param(None, id="not-installed")])
def test_real_models_verify_run_and_refuse_a_one_byte_truncation(model, tmp_path):
    if model is None:
        _absent("power-native or the real models are not installed")
    r = _cli("validate", "--target", model, "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["ok"] is True
    r = _cli("run", "--model", model, "--max-tokens", "3", "--threads", "2", "--n-ctx", "128", "--json")
    assert r.returncode == 0, r.stderr
    assert len(json.loads(r.stdout)["tokens"]) == 3
    cut = tmp_path / "cut.gguf"
    shutil.copyfile(model, cut)
    os.truncate(cut, os.path.getsize(cut) - 1)
    for argv in (("validate", "--target", str(cut), "--json"), ("run", "--model", str(cut), "--json")):
        r = _cli(*argv)
        assert r.returncode == 2 and "Traceback" not in r.stderr, (argv, r.stderr)
        assert json.loads(r.stdout)["code"] in TRUNCATED, argv
