"""A third-party adapter written outside the repo, installed with pip, is discovered and runs."""

from __future__ import annotations

import json
import shutil
import site
import subprocess
import sys
import venv
from pathlib import Path

import pytest

TUTORIAL = Path(__file__).resolve().parent.parent / "docs" / "tutorial" / "power-lookup"


@pytest.mark.slow
def test_pip_installed_adapter_is_discovered_and_runs(tmp_path):
    src = tmp_path / "outside" / "power-lookup"
    shutil.copytree(TUTORIAL, src, ignore=shutil.ignore_patterns("*.egg-info", "__pycache__", "build", "tests"))
    # a distinct distribution, entry point and strategy, so it cannot be confused with a tutorial
    # copy that the surrounding environment may already have installed
    (src / "power_outside.py").write_text((src / "power_lookup.py").read_text()
                                          .replace('name="lookup"', 'name="outside"')
                                          .replace('package="power-lookup"', 'package="power-outside"'))
    (src / "power_lookup.py").unlink()
    (src / "pyproject.toml").write_text((src / "pyproject.toml").read_text()
                                        .replace('name = "power-lookup"', 'name = "power-outside"')
                                        .replace('lookup = "power_lookup"', 'outside = "power_outside"'))
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    py = env_dir / "bin" / "python"
    # the new environment sees this interpreter's packages (power-core and its deps) through a .pth file,
    # so the test installs only the adapter, offline
    child_site = Path(subprocess.check_output([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                              text=True).strip())
    parent = [p for p in sys.path if p.endswith("site-packages")] + site.getsitepackages()
    (child_site / "parent.pth").write_text("\n".join(dict.fromkeys(parent)) + "\n")
    # build the wheel as pip does for any user (isolated build env from PyPI), then install it
    dist = tmp_path / "dist"
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                            str(src), "-w", str(dist)], capture_output=True, text=True)
    assert build.returncode == 0, build.stderr
    pip = subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", *map(str, dist.glob("*.whl"))],
                         capture_output=True, text=True)
    assert pip.returncode == 0, pip.stderr
    env = {"PATH": str(env_dir / "bin"), "POWER_LOAD_PLUGINS": "outside"}
    out = subprocess.run([str(py), "-m", "power_core.cli", "plugins", "--json"], check=True, capture_output=True,
                         text=True, env=env).stdout
    outside = next(p for p in json.loads(out) if p["name"] == "outside")
    assert outside["distribution"] == "power-outside" and outside["strategies"] == ["outside"]
    run = subprocess.run([str(py), "-m", "power_core.cli", "run", "--backend", "reference", "--mode", "outside",
                          "--prompt", "abc abc abc abc abc abc", "--max-tokens", "24", "--json"],
                         check=True, capture_output=True, text=True, env=env)
    receipt = json.loads(run.stdout)["receipt"]
    assert receipt["strategy"] == {"name": "outside", "version": "0.1.0", "package": "power-outside",
                                   "kind": "model-free"}
    assert receipt["output_tokens"] == 24
    subprocess.run([str(py), "-m", "pip", "uninstall", "-q", "-y", "power-outside"], check=True, capture_output=True)
    out = subprocess.run([str(py), "-m", "power_core.cli", "plugins", "--json"], check=True, capture_output=True,
                         text=True, env=env).stdout
    assert all(p["name"] != "outside" for p in json.loads(out))
