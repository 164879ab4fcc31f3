"""`pip install ./plugins/<name>` makes the strategy appear in `power plugins --json`; uninstall removes it.

A real pip install into a temporary venv. The venv sees the system's dependencies through a
filtered link farm (everything except Power's own distributions), so nothing is downloaded and
the system-wide editable plugins do not leak in.
"""

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(py, *args, env, check=True):
    r = subprocess.run([str(py), *args], capture_output=True, text=True, env=env, timeout=300)
    if check and r.returncode != 0:
        raise AssertionError(f"{args}: rc={r.returncode}\n{r.stdout}\n{r.stderr}")
    return r


def _strategies(py, env):
    r = _run(py, "-m", "power_core.cli", "plugins", "--json", env=env)
    data = json.loads(r.stdout)
    return {s for plugin in data for s in plugin["strategies"]}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["dspark"])
def test_pip_install_and_uninstall_plugin(tmp_path, name, fixtures_dir):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    site = Path(_run(py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", env=os.environ).stdout.strip())
    deps = tmp_path / "deps"
    deps.mkdir()
    system_site = Path(sysconfig.get_paths()["purelib"])
    for entry in system_site.iterdir():
        if "power" in entry.name.lower():
            continue
        (deps / entry.name).symlink_to(entry)
    (site / "_power_test_deps.pth").write_text(f"{ROOT}\n{deps}\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "POWER_LOAD_PLUGINS")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"

    before = _strategies(py, env)
    assert name not in before and "off" in before
    r = _run(py, "-m", "power_core.cli", "validate", "--target", str(fixtures_dir["target_plain"]),
             "--draft", str(fixtures_dir[name]), "--mode", name, env=env, check=False)
    assert r.returncode == 2 and f"pip install power-{name}" in r.stderr

    # build the wheel as pip does for any user (isolated build env), from a copy so the tree stays clean
    src = tmp_path / "src" / name
    shutil.copytree(ROOT / "plugins" / name, src, ignore=shutil.ignore_patterns("*.egg-info", "__pycache__", "build"))
    dist = tmp_path / "dist"
    _run(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", str(src), "-w", str(dist), env=os.environ)
    _run(py, "-m", "pip", "install", "-q", "--no-deps", *map(str, dist.glob("*.whl")), env=env)
    assert name in _strategies(py, env)
    r = _run(py, "-m", "power_core.cli", "validate", "--target", str(fixtures_dir["target_plain"]),
             "--draft", str(fixtures_dir[name]), "--mode", name, env=env, check=False)
    assert r.returncode == 0, r.stderr

    _run(py, "-m", "pip", "uninstall", "-y", "-q", f"power-{name}", env=env)
    assert name not in _strategies(py, env)
