"""The sdist and the wheel as a user gets them (issue 38): built from this checkout's tracked
files (`python -m build`: the sdist, then the wheel from it), passing `twine check`, holding every
file tracked under `pagellm/` (the C++ sources and model configs too), each extra requiring what
its code imports, and the wheel working on its own: installed into a fresh venv outside the
checkout, its `pagellm generate` prints text from the embedded model.

The fresh venv gets the wheel alone (`--no-deps`) and the dev venv's packages through a `.pth`
file's path line; such a line only extends sys.path, so the `.pth` files over there (the dev
venv's editable install of this checkout) do not run: the test checks that too.
"""

from __future__ import annotations

import ast
import email.parser
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from timing import scaled

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "The capital of France is"
# extra -> the code whose third-party imports it must cover (with the base dependencies)
EXTRA_CODE = {"server": "pagellm/entrypoints/openai", "gpu": "pagellm/kernels", "dev": "tests"}
DEV_TOOLS = {"build", "twine", "pytest"}  # run as commands, not imported


@dataclass
class Dist:
    wheel: Path
    sdist: Path


def _git_files(*paths: str) -> list[str]:
    out = subprocess.run(
        ["git", "-C", str(ROOT), "ls-files", "-z", *paths], capture_output=True, check=True
    ).stdout.decode()
    return [f for f in out.split("\0") if f and (ROOT / f).exists()]


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> Dist:
    """The sdist and the wheel of the tracked files (what a clean clone builds)."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: the tracked files are unknown")
    src, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("dist")
    for name in _git_files():
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, src / name)
    # --no-isolation: the dev venv's setuptools (checked against build-system.requires)
    cmd = [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(src)]
    built = subprocess.run(cmd, capture_output=True, text=True, timeout=scaled(300))
    assert built.returncode == 0, built.stdout[-4000:] + built.stderr[-4000:]
    (wheel,), (sdist,) = out.glob("*.whl"), out.glob("*.tar.gz")
    return Dist(wheel, sdist)


def test_twine_check_passes(dist: Dist):
    cmd = [sys.executable, "-m", "twine", "check", "--strict", str(dist.wheel), str(dist.sdist)]
    checked = subprocess.run(cmd, capture_output=True, text=True, timeout=scaled(120))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert checked.stdout.count("PASSED") == 2, checked.stdout


def test_the_wheel_and_the_sdist_hold_every_tracked_file_of_the_package(dist: Dist):
    tracked = _git_files("pagellm")
    data = [f for f in tracked if not f.endswith(".py")]
    assert any(f.startswith("pagellm/csrc/") for f in data), data
    assert any(f.startswith("pagellm/model_configs/") for f in data), data
    wheel = set(zipfile.ZipFile(dist.wheel).namelist())
    with tarfile.open(dist.sdist) as sdist:
        in_sdist = {name.partition("/")[2] for name in sdist.getnames()}
    assert [f for f in tracked if f not in wheel] == []
    assert [f for f in tracked if f not in in_sdist] == []
    tops = {name.split("/")[0] for name in wheel}
    assert {top for top in tops if not top.endswith(".dist-info")} == {"pagellm"}, tops


def _metadata(dist: Dist) -> email.message.Message:
    with zipfile.ZipFile(dist.wheel) as wheel:
        (name,) = [n for n in wheel.namelist() if n.endswith(".dist-info/METADATA")]
        return email.parser.Parser().parsestr(wheel.read(name).decode())


def _requires(metadata: email.message.Message, extra: str = "") -> set[str]:
    """The distributions the wheel requires with `extra` installed (none: the base ones)."""
    names = set()
    for line in metadata.get_all("Requires-Dist") or []:
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate({"extra": extra}):
            names.add(canonicalize_name(req.name))
    return names


def _closure(names: set[str]) -> set[str]:
    """`names` and what the installed distributions of them require, recursively."""
    seen, todo = set(), list(names)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        for line in requires:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(canonicalize_name(req.name))
    return seen


def _imported_distributions(folder: str) -> dict[str, set[str]]:
    """Top-level modules imported under `folder` that are neither the standard library nor
    local (pagellm, the tests' helpers) -> the installed distributions that provide them."""
    local = {"pagellm", *(p.stem for p in (ROOT / "tests").glob("*.py"))}
    providers = importlib.metadata.packages_distributions()
    found: dict[str, set[str]] = {}
    for path in (ROOT / folder).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules = [node.module]
            else:
                continue
            for top in {m.split(".")[0] for m in modules} - local - set(sys.stdlib_module_names):
                found[top] = {canonicalize_name(d) for d in providers.get(top, [])}
    return found


def test_each_extra_requires_what_its_code_imports(dist: Dist):
    metadata = _metadata(dist)
    assert set(metadata.get_all("Provides-Extra")) >= set(EXTRA_CODE), metadata["Provides-Extra"]
    base = _requires(metadata)
    assert {"torch", "transformers", "xgrammar"} <= base, base
    for extra, folder in EXTRA_CODE.items():
        covered = _closure(_requires(metadata, extra))
        imported = _imported_distributions(folder)
        assert imported, folder
        missing = {m: d for m, d in imported.items() if not d & covered}
        assert missing == {}, f"[{extra}] does not bring what {folder} imports: {missing}"
    assert {"fastapi", "uvicorn"} <= _requires(metadata, "server") - base
    assert "triton" in _requires(metadata, "gpu") - base
    assert DEV_TOOLS <= _requires(metadata, "dev") - base


@pytest.fixture(scope="module")
def fresh_venv(dist: Dist, tmp_path_factory) -> Path:
    """A venv outside the checkout with the wheel alone, and the dev venv's site-packages as
    a path line of a .pth file (for torch and the rest, without this checkout's pagellm)."""
    venv = tmp_path_factory.mktemp("fresh") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    pip = [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps"]
    subprocess.run([*pip, "--no-index", str(dist.wheel)], check=True, timeout=scaled(120))
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True, env=_clean_env(),
    ).stdout.strip()  # fmt: skip
    dev_paths = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    Path(site, "dev-venv.pth").write_text("".join(f"{p}\n" for p in sorted(dev_paths)))
    return venv


def _clean_env() -> dict[str, str]:
    """This environment without what would point Python at the checkout or the dev venv."""
    drop = {"PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "VIRTUAL_ENV", "PYTHONSAFEPATH"}
    return {k: v for k, v in os.environ.items() if k not in drop}


_WHERE = """
import json, sys, pagellm, pagellm.cli, pagellm.cpp_build
print(json.dumps({
    "files": [pagellm.__file__, pagellm.cli.__file__, str(pagellm.cpp_build.CSRC)],
    "editable": [n for n in sys.modules if n.startswith("__editable__")]
    + [repr(f) for f in sys.meta_path if "editable" in repr(f).lower()],
    "path": sys.path,
}))
"""


def test_the_wheel_alone_is_imported_in_the_fresh_venv(fresh_venv: Path, tmp_path):
    python = str(fresh_venv / "bin" / "python")
    where = subprocess.run(
        [python, "-c", _WHERE], cwd=tmp_path, env=_clean_env(), capture_output=True, text=True
    )
    assert where.returncode == 0, where.stderr
    found = json.loads(where.stdout)
    for path in found["files"]:
        assert Path(path).resolve().is_relative_to(fresh_venv.resolve()), found
        assert not Path(path).resolve().is_relative_to(ROOT), found
    assert found["editable"] == [], found  # the .pth's path line ran no .pth over there
    assert sysconfig.get_paths()["purelib"] in found["path"], found


def test_pagellm_generate_runs_from_the_wheel(fresh_venv: Path, tmp_path):
    command = fresh_venv / "bin" / "pagellm"  # the wheel's console script
    assert str(fresh_venv / "bin" / "python") in command.read_text()[:1000]  # its interpreter
    cmd = [str(command), "generate", PROMPT, "--max-tokens", "8", "--max-model-len", "256"]
    ran = subprocess.run(
        cmd, cwd=tmp_path, env=_clean_env(), capture_output=True, text=True, timeout=scaled(600)
    )
    assert ran.returncode == 0, ran.stdout[-4000:] + ran.stderr[-4000:]
    printed = re.search(rf"--- {re.escape(repr(PROMPT))}\n(.*)\n\n1 requests", ran.stdout, re.S)
    assert printed and printed.group(1).strip(), ran.stdout
