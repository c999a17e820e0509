"""Packaging and Binder (issue 5).

- binder/requirements.txt installs this repository, and what it installs resolves. The
  test runs pip's resolver on it offline, against this environment: ``pip install
  --dry-run --no-index``. It also checks that every dependency in pyproject.toml is
  installed here at a version its specifier allows, and imports it.
- The Binder and Colab links point at a notebook that exists.
- ``python -m build`` makes an sdist, then a wheel from that sdist. Both must contain the
  JavaScript bundle, every preset and the measured cases.
- The wheel installs into a fresh virtual environment that has no dependencies, and
  ``python -m vramwidget estimate llama-3.2-1b --json`` runs there. The calculator core
  needs nothing else. A second environment sees this one's packages (anywidget, ...)
  and loads the widget's bundle from the installed wheel.

Everything runs on a copy of the repository in a temporary folder, so no build output
lands in the checkout, and nothing is downloaded: build isolation is off, and pip uses
``--no-index``. It takes about 15-30 s.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

try:
    import tomllib
except ImportError:  # Python < 3.11
    tomllib = pytest.importorskip("tomli")

from packaging.requirements import Requirement
from packaging.version import Version

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
BINDER_REQUIREMENTS = ROOT / "binder" / "requirements.txt"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
LLAMA_32_1B_PARAMS = 1235814400

#: distribution name -> the module it provides, where they differ
IMPORT_NAMES = {"pyyaml": "yaml", "scikit-learn": "sklearn", "pillow": "PIL"}

#: what the copy of the repository leaves out (build outputs, caches, node_modules, git)
COPY_IGNORE = shutil.ignore_patterns(
    ".git", "node_modules", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache", ".hypothesis",
    "test-artifacts", ".venv", "venv", ".benchmarks", ".ipynb_checkpoints", "*.pyc", "*.so", "*.pyd")


def run(cmd, cwd, env=None, timeout=300) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(c) for c in cmd], cwd=str(cwd), env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, (
        f"{' '.join(map(str, cmd))} exited with {proc.returncode}\n"
        f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}")
    return proc


def clean_env(**extra) -> dict:
    """This environment without PYTHONPATH (the checkout must not leak in), plus extra."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PIP_REQUIRE_VIRTUALENV")}
    env.update(PIP_DISABLE_PIP_VERSION_CHECK="1", PYTHONDONTWRITEBYTECODE="1", **extra)
    return env


@pytest.fixture(scope="module")
def source_copy(tmp_path_factory) -> Path:
    dst = tmp_path_factory.mktemp("src") / "vramwidget-src"
    shutil.copytree(ROOT, dst, ignore=COPY_IGNORE)
    return dst


# ---------------------------------------------------------------------------------------
# Binder
# ---------------------------------------------------------------------------------------

def binder_lines():
    return [line.split("#", 1)[0].strip() for line in BINDER_REQUIREMENTS.read_text().splitlines()
            if line.split("#", 1)[0].strip()]


def test_binder_installs_this_repository():
    lines = binder_lines()
    local = [x for x in lines if x in (".", "./", "-e .", "--editable .", "-e ./", ".[hub]")]
    assert local, f"binder/requirements.txt does not install the repository ('.'): {lines}"
    # repo2docker installs it from the repository root, where pyproject.toml is
    assert (ROOT / "pyproject.toml").is_file()
    # JupyterLab for the lab/tree/... URL the badge opens
    assert any(Requirement(x).name.lower() == "jupyterlab" for x in lines if x not in local)


def test_every_dependency_of_the_package_is_installed_and_importable():
    """What Binder installs with the package is pyproject's [project].dependencies: each is
    installed here at a version its specifier allows, and imports."""
    deps = [Requirement(d) for d in PYPROJECT["project"]["dependencies"]]
    assert deps
    problems = []
    for req in deps:
        try:
            version = importlib.metadata.version(req.name)
        except importlib.metadata.PackageNotFoundError:
            problems.append(f"{req.name}: not installed")
            continue
        if req.specifier and not req.specifier.contains(Version(version), prereleases=True):
            problems.append(f"{req.name} {version} does not satisfy {req.specifier}")
        module = IMPORT_NAMES.get(req.name.lower(), req.name.replace("-", "_"))
        try:
            importlib.import_module(module)
        except ImportError as e:
            problems.append(f"{req.name}: import {module} failed ({e})")
    assert not problems, problems


def test_binder_requirements_resolve_offline(source_copy):
    """pip's resolver on binder/requirements.txt, exactly as repo2docker runs it (from the
    repository root), against the packages installed here and with no index: every
    requirement, with the package's own dependencies, is satisfiable, with no conflict."""
    shutil.copytree(ROOT / "binder", source_copy / "binder", dirs_exist_ok=True)
    proc = run([sys.executable, "-m", "pip", "install", "--dry-run", "--no-index", "--no-build-isolation",
                "-r", "binder/requirements.txt"], cwd=source_copy, env=clean_env())
    assert re.search(r"Would install .*vramwidget-", proc.stdout), proc.stdout[-2000:]


def test_binder_and_colab_links_open_the_quickstart():
    texts = [(ROOT / "README.md").read_text(encoding="utf-8")] if (ROOT / "README.md").is_file() else []
    texts.append((ROOT / "notebooks" / "quickstart.ipynb").read_text(encoding="utf-8"))
    binder = [m for t in texts for m in re.findall(r"mybinder\.org/v2/gh/[^)\s\"]*urlpath=lab/tree/([^)\s\"&]+)", t)]
    colab = [m for t in texts for m in re.findall(r"colab\.research\.google\.com/github/[^/]+/[^/]+/blob/[^/]+/"
                                                  r"([^)\s\"]+\.ipynb)", t)]
    assert binder and colab, "no Binder or Colab link found"
    for path in binder + colab:
        assert (ROOT / path).is_file(), f"a link opens {path}, which does not exist"
    assert "notebooks/quickstart.ipynb" in binder


# ---------------------------------------------------------------------------------------
# build, then install the wheel into fresh environments
# ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def dists(source_copy, tmp_path_factory):
    """(sdist, wheel) built by ``python -m build`` (the wheel from the sdist), offline."""
    pytest.importorskip("build")
    setuptools_req = next((Requirement(r) for r in PYPROJECT["build-system"]["requires"]
                           if Requirement(r).name == "setuptools"), None)
    import setuptools

    if setuptools_req is not None:
        assert setuptools_req.specifier.contains(setuptools.__version__), (
            f"setuptools {setuptools.__version__} does not satisfy {setuptools_req}")
    out = tmp_path_factory.mktemp("dist")
    # --no-isolation: use this environment's setuptools instead of downloading one;
    # --skip-dependency-check: the "wheel" requirement is for setuptools < 70.1, which
    # needed it to build wheels (checked above: this setuptools meets the floor)
    proc = run([sys.executable, "-m", "build", "--no-isolation", "--skip-dependency-check", "--outdir", out, "."],
               cwd=source_copy, env=clean_env(), timeout=600)
    BUILD_LOG.append(proc.stdout + proc.stderr)
    sdists, wheels = sorted(out.glob("*.tar.gz")), sorted(out.glob("*.whl"))
    assert len(sdists) == 1 and len(wheels) == 1, list(out.iterdir())
    return sdists[0], wheels[0]


BUILD_LOG: list = []


def test_build_has_no_packaging_warnings(dists):
    """Issue 14: `python -m build` warned that vramwidget.data, .presets and .static were absent
    from the packages configuration (setuptools' "Package would be ignored")."""
    log = BUILD_LOG[-1]
    for needle in ("absent from the `packages` configuration", "Package would be ignored",
                   "SetuptoolsDeprecationWarning"):
        assert needle not in log, needle


def _expected_package_files():
    presets = sorted(p.name for p in (ROOT / "vramwidget" / "presets").glob("*.json"))
    assert len(presets) >= 20, presets
    files = ["vramwidget/static/widget.js", "vramwidget/static/widget.css",
             "vramwidget/data/h200_training_a.jsonl", "vramwidget/__init__.py", "vramwidget/cli.py"]
    return files + [f"vramwidget/presets/{p}" for p in presets]


def test_wheel_contains_the_bundle_presets_and_cases(dists):
    _, wheel = dists
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        missing = [f for f in _expected_package_files() if f not in names]
        assert not missing, missing
        bundle = z.read("vramwidget/static/widget.js")
    assert bundle == (ROOT / "vramwidget" / "static" / "widget.js").read_bytes()
    assert not [n for n in names if n.startswith(("tests/", "js/", "notebooks/"))]


def test_sdist_contains_the_bundle_presets_and_cases(dists):
    sdist, _ = dists
    with tarfile.open(sdist) as t:
        names = {n.split("/", 1)[1] for n in t.getnames() if "/" in n}
    missing = [f for f in _expected_package_files() + ["pyproject.toml", "setup.py", "vramwidget/allocator/creplay.c"]
               if f not in names]
    assert not missing, missing


def test_the_wheel_carries_the_compiled_replay(dists):
    """Built where a C compiler is (this machine, cibuildwheel's): the wheel holds the compiled
    replay, so it is platform-specific."""
    _, wheel = dists
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
    assert [n for n in names if n.startswith("vramwidget/allocator/creplay.") and n.endswith((".so", ".pyd"))]
    assert not wheel.name.endswith("-none-any.whl"), wheel.name


def _purelib(py: Path) -> str:
    """The site-packages folder of the interpreter ``py`` (where a .pth file is read)."""
    return run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=py.parent,
               env=clean_env()).stdout.strip()


def _venv(path: Path, system_site: bool) -> Path:
    """A new venv; ``system_site``: it also sees the packages of the environment running the
    tests.  ``--system-site-packages`` alone is not that when the tests run inside a venv
    (the new venv's base is the base interpreter, not the outer venv), so the outer
    environment's site-packages are added with a .pth file, after the new venv's own."""
    cmd = [sys.executable, "-m", "venv", "--without-pip"] + (["--system-site-packages"] if system_site else [])
    run(cmd + [path], cwd=path.parent, env=clean_env())
    py = path / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    assert py.exists()
    if system_site:
        import site

        purelib = _purelib(py)
        outer = [p for p in site.getsitepackages() + [site.getusersitepackages()] if os.path.isdir(p)]
        (Path(purelib) / "_outer_environment.pth").write_text("\n".join(outer) + "\n", encoding="utf-8")
    return py


def _pip_install_into(py: Path, wheel: Path, cwd: Path) -> None:
    # this environment's pip installs into the new one (--python), from the file alone
    run([sys.executable, "-m", "pip", "--python", py, "install", "--no-deps", "--no-index", wheel],
        cwd=cwd, env=clean_env())


def _only_numpy(py: Path, tmp_path: Path) -> None:
    """The one dependency the calculator core imports (the step plan's views are numpy
    arrays): this environment's numpy, and nothing else of it, made visible to ``py``
    through a .pth file over a folder holding links to numpy alone."""
    import numpy

    site_dir = Path(numpy.__file__).resolve().parent.parent
    extra = tmp_path / "numpy_only"
    extra.mkdir()
    for name in os.listdir(site_dir):
        if name == "numpy" or name.startswith(("numpy.libs", "numpy-")):
            (extra / name).symlink_to(site_dir / name, target_is_directory=(site_dir / name).is_dir())
    purelib = _purelib(py)
    (Path(purelib) / "_numpy_only.pth").write_text(f"{extra}\n", encoding="utf-8")


def test_wheel_in_a_fresh_venv_runs_the_cli(dists, tmp_path):
    """A plain venv: nothing but the wheel and numpy (the core's one import beyond the
    standard library). The CLI estimates a preset there."""
    _, wheel = dists
    py = _venv(tmp_path / "venv", system_site=False)
    _pip_install_into(py, wheel, tmp_path)
    _only_numpy(py, tmp_path)
    env = clean_env()
    where = run([py, "-c", "import vramwidget, sys; print(vramwidget.__file__); print(vramwidget.__version__)"],
                cwd=tmp_path, env=env).stdout.split()
    assert Path(where[0]).resolve().is_relative_to((tmp_path / "venv").resolve()), where
    assert where[1] == PYPROJECT["project"]["version"]
    out = run([py, "-m", "vramwidget", "estimate", "llama-3.2-1b", "--json"], cwd=tmp_path, env=env).stdout
    data = json.loads(out)
    assert data["params_total"] == LLAMA_32_1B_PARAMS
    assert data["peak_allocated_bytes"] > 0
    compiled = run([py, "-c", "from vramwidget.allocator import caching; print(caching.COMPILED)"], cwd=tmp_path,
                   env=env).stdout.strip()
    assert compiled == "True"
    # the console script is installed too
    script = py.parent / ("vramwidget.exe" if os.name == "nt" else "vramwidget")
    assert script.exists()
    out = run([script, "estimate", "llama-3.2-1b", "--json"], cwd=tmp_path, env=env).stdout
    assert json.loads(out)["params_total"] == LLAMA_32_1B_PARAMS


def test_wheel_in_a_venv_with_the_dependencies_loads_the_widget(dists, tmp_path):
    """A venv that sees this environment's packages (anywidget, altair, ...): the widget
    imports from the installed wheel, not from the checkout, and finds its bundle."""
    _, wheel = dists
    py = _venv(tmp_path / "venv", system_site=True)
    _pip_install_into(py, wheel, tmp_path)
    code = (
        "import json, vramwidget, vramwidget.widget as w\n"
        "c = w.Calculator('llama-3.2-1b')\n"
        "print(json.dumps({'file': w.__file__, 'esm': len(c._esm), 'css': len(c._css),\n"
        "                  'params': c.estimate.params_total, 'error': c.error}))\n"
    )
    info = json.loads(run([py, "-c", code], cwd=tmp_path, env=clean_env()).stdout.strip().splitlines()[-1])
    assert Path(info["file"]).resolve().is_relative_to((tmp_path / "venv").resolve()), info
    assert info["esm"] == len((ROOT / "vramwidget" / "static" / "widget.js").read_text(encoding="utf-8"))
    assert info["css"] > 0
    assert info["params"] == LLAMA_32_1B_PARAMS and info["error"] == ""


def test_without_a_c_compiler_the_sdist_installs_and_replays_in_python(dists, tmp_path):
    """The compiled replay is optional (setup.py: ``optional=True``): where no wheel fits and
    no C compiler is there (CC=false here), ``pip`` still builds and installs the sdist, the
    package says it replays in Python, and the CLI gives the answer the compiled build gives."""
    sdist, wheel = dists
    out = tmp_path / "wheel"
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-index", "--no-build-isolation", "-w", out, sdist],
        cwd=tmp_path, env=clean_env(CC="false", LDSHARED="false"), timeout=600)
    (built,) = out.glob("*.whl")
    with zipfile.ZipFile(built) as z:
        assert not [n for n in z.namelist() if n.endswith((".so", ".pyd"))]
    answers = []
    for name, whl in (("plain", built), ("compiled", wheel)):
        py = _venv(tmp_path / name, system_site=False)
        _pip_install_into(py, whl, tmp_path)
        _only_numpy(py, tmp_path / name)
        code = ("import json, vramwidget as vw\nfrom vramwidget.allocator import caching\n"
                "e = vw.estimate('llama-3.2-1b', method='qlora', batch_size=2, seq_len=1024)\n"
                "print(json.dumps([caching.COMPILED, e.reserved_bytes, e.peak_allocated_bytes]))")
        answers.append(json.loads(run([py, "-c", code], cwd=tmp_path, env=clean_env()).stdout.strip().splitlines()[-1]))
    assert [a[0] for a in answers] == [False, True]
    assert answers[0][1:] == answers[1][1:]
