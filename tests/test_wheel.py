"""The package works installed from its wheel, away from the checkout.

Proves: ``pip wheel --no-deps .`` builds a wheel holding the planner, the
tracing layer it stands on, the platform package and the ``hf`` command;
installed into a temporary target and imported from a directory outside the
checkout, ``torchtitan_neuron`` comes from that target, every recipe module
(each ``config_registry`` in the installed package) imports, and
``python -m torchtitan_neuron.plan`` plans a debug recipe with no tokenizer,
corpus or other checkout file, and ``python -m torchtitan_neuron.hf --help``
lists its commands.

Run: .venv/bin/python -m pytest tests/test_wheel.py -q
"""

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from conftest import LLAMA_MODULE, REPO

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(site folder, wheel) of the checkout, built and installed."""
    tmp = tmp_path_factory.mktemp("wheel")
    # Built from a copy: setuptools writes build/ and *.egg-info beside the
    # sources. No build isolation: this environment's setuptools builds it,
    # so no package index is needed.
    source = tmp / "source"
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "outputs", "assets", "*.egg-info", "__pycache__"))
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
         str(source), "-w", str(tmp)],
        cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
    assert build.returncode == 0, build.stdout[-4000:]
    (wheel,) = tmp.glob("torchtitan_neuron-*.whl")
    site = tmp / "site"
    install = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--target", str(site), str(wheel)],
        cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
    assert install.returncode == 0, install.stdout[-4000:]
    return site, wheel


def _run(site: Path, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """``python args`` from a folder outside the checkout, the wheel first on the path."""
    env = dict(os.environ, PYTHONPATH=str(site))
    return subprocess.run([sys.executable, *args], cwd=site.parent, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=timeout)


def test_wheel_holds_the_planner_package(installed):
    _, wheel = installed
    names = set(zipfile.ZipFile(wheel).namelist())
    for module in ("plan/__init__", "plan/__main__", "plan/core", "plan/trace",
                   "plan/backend", "tracing/world", "tracing/patches",
                   "tracing/neuron_device", "hf/__main__", "devices/__init__"):
        assert f"torchtitan_neuron/{module}.py" in names
    assert not any(n.startswith("tests/") for n in names)


def test_installed_package_imports_every_recipe_module(installed):
    site, _ = installed
    script = (
        "import pathlib, importlib, torchtitan_neuron\n"
        "root = pathlib.Path(torchtitan_neuron.__file__).parent\n"
        "print('FILE', torchtitan_neuron.__file__)\n"
        "for reg in sorted(root.rglob('config_registry.py')):\n"
        "    name = '.'.join(reg.relative_to(root.parent).with_suffix('').parts)\n"
        "    importlib.import_module(name)\n"
        "    print('IMPORTED', name)\n"
    )
    proc = _run(site, "-c", script)
    assert proc.returncode == 0, proc.stdout[-4000:]
    (path,) = [l.split(" ", 1)[1] for l in proc.stdout.splitlines() if l.startswith("FILE ")]
    assert Path(path).resolve().is_relative_to(site.resolve()), path
    imported = [l for l in proc.stdout.splitlines() if l.startswith("IMPORTED ")]
    assert f"IMPORTED {LLAMA_MODULE}.config_registry" in imported
    assert len(imported) >= 5, imported


def test_installed_hf_command_runs_away_from_the_checkout(installed):
    site, _ = installed
    proc = _run(site, "-m", "torchtitan_neuron.hf", "--help", timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert "export" in proc.stdout and "download" in proc.stdout


def test_installed_planner_plans_a_debug_recipe(installed):
    site, _ = installed
    proc = _run(site, "-m", "torchtitan_neuron.plan", "--module", LLAMA_MODULE,
                "--config", "simple_fsdp_llama3_debugmodel", "--ngpu", "2",
                "--target", "cpu", "--json")
    assert proc.returncode == 0, proc.stdout[-4000:]
    plan = json.loads([l for l in proc.stdout.splitlines() if l.startswith("{")][-1])
    assert plan["peak_gib"] > 0 and plan["fits"] is True
    assert plan["layout"]["dp_shard"] == 2
