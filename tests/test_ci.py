"""The set-up a new user follows, as CI runs it: `.ci/run` installs into a virtualenv of
its own, made anew each run, exactly what the README's test command installs; the
`test` extras name every package the tests (and the code they run) import, so that
nothing installed on a machine by hand hides a missing one."""
import ast
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: Installed by the README's command before the extras, pinned (a CPU build in CI).
INSTALLED_FIRST = {"torch"}
#: Left out of the extras on purpose: the models of the GPU workloads (benchmarks/gpu),
#: whose CPU smoke tests skip without it; it pulls in far more than the tests need.
OPTIONAL = {"transformers"}
#: The import name of a package where it is not the package's own name.
PACKAGE_OF = {"yaml": "pyyaml", "PIL": "pillow"}


def _read(*parts):
    with open(os.path.join(ROOT, *parts)) as f:
        return f.read()


def _requirements(name):
    """The package names of a list in pyproject.toml (`dependencies`, or an extra)."""
    found = re.search(rf"^{name} = \[(.*?)\]", _read("pyproject.toml"), re.M | re.S)
    assert found, f"pyproject.toml has no {name} list"
    return {re.split(r"[<>=!~\[ ;]", spec, 1)[0].lower() for spec in re.findall(r'"([^"]+)"', found.group(1))}


def _python_files():
    yield os.path.join(ROOT, "setup.py")  # a test runs it
    for folder in ("tests", "pyalloc", "benchmarks"):
        for parent, _, files in os.walk(os.path.join(ROOT, folder)):
            yield from (os.path.join(parent, f) for f in files if f.endswith(".py"))


def _local_modules():
    """Names a bare import resolves inside the repository (the packages, and the helpers
    that scripts and tests import from their own folder)."""
    names = set()
    for path in _python_files():
        names.add(os.path.splitext(os.path.basename(path))[0])
        names.add(os.path.basename(os.path.dirname(path)))
    return names


def _imports():
    """{top-level module: files importing it} over every import in the files the tests
    run, at any depth (lazy imports, and pytest.importorskip()'s, too)."""
    imported = {}
    for path in _python_files():
        for node in ast.walk(ast.parse(_read(path), path)):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            elif (isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "importorskip"
                    and node.args and isinstance(node.args[0], ast.Constant)):
                names = [node.args[0].value]
            else:
                continue
            for name in names:
                imported.setdefault(name.split(".")[0], set()).add(os.path.relpath(path, ROOT))
    return imported


@pytest.mark.skipif(sys.version_info < (3, 10), reason="sys.stdlib_module_names is new in 3.10")
def test_the_test_extras_name_every_package_the_tests_import():
    local = _local_modules()
    declared = _requirements("dependencies") | _requirements("test")
    missing = {}
    for module, files in sorted(_imports().items()):
        if module in sys.stdlib_module_names or module in local or module in INSTALLED_FIRST | OPTIONAL:
            continue
        if PACKAGE_OF.get(module, module).lower() not in declared:
            missing[module] = sorted(files)
    assert not missing, f"imported but not in pyproject.toml's dependencies or test extras: {missing}"


def test_the_extras_name_what_setup_py_needs_to_run():
    # tests/test_bridge_build.py runs `python setup.py --name`, which imports both.
    assert {"pybind11", "setuptools"} <= _requirements("test")


def _readme_test_command():
    readme = _read("README.md")
    section = readme[readme.index("Run the tests"):]
    return re.search(r"```bash\n(.*?)\n```", section, re.S).group(1).strip()


def test_ci_runs_the_readme_test_command_in_a_virtualenv_made_anew():
    script = _read(".ci", "run")
    command = _readme_test_command()
    assert "python -m pytest" in command and "tests/cpp/run.sh" in command
    lines = [ln.strip() for ln in script.splitlines()]
    assert command in lines, "the README's test command, as .ci/run runs it"
    venv = re.search(r"^venv=(\S+)$", script, re.M).group(1)
    removed = lines.index('rm -rf "$venv"')
    made = next(i for i, ln in enumerate(lines) if re.fullmatch(r'python3? -m venv "\$venv"', ln))
    entered = lines.index('. "$venv/bin/activate"')
    assert removed < made < entered < lines.index(command)
    if os.path.isdir(os.path.join(ROOT, ".git")) or os.path.isfile(os.path.join(ROOT, ".git")):
        ignored = subprocess.run(["git", "check-ignore", "-q", venv], cwd=ROOT)
        assert ignored.returncode == 0, f"{venv} is not ignored by git"


def test_the_readme_says_what_ci_runs():
    readme = " ".join(_read("README.md").split())
    assert "`.ci/run` runs exactly this command, in a virtualenv it makes anew each run" in readme


def test_ci_builds_the_sdist_and_smoke_tests_a_wheel_built_from_it():
    lines = [ln.strip() for ln in _read(".ci", "run").splitlines()]
    smoke = lines.index("bash .ci/sdist_smoke build/sdist-smoke")
    tests = lines.index(_readme_test_command())
    assert smoke > tests, "after the tests, in the same virtualenv"
    # Only the last command of an && list stops a set -e script: CI must not go on, and
    # pass, after a failing pytest.
    assert lines[tests + 2] == 'status=$?; [ "$status" -eq 0 ] || exit "$status"'
    script = _read(".ci", "sdist_smoke")
    for step in ("setup.py -q sdist", 'python3 -m venv "$work/venv"', "-m pip wheel --no-deps",
                 "pyalloc replay", "benchmarks/traces/"):
        assert step in script, step
    ignored = subprocess.run(["git", "check-ignore", "-q", "build/sdist-smoke"], cwd=ROOT)
    assert ignored.returncode == 0


def test_regression_the_sdist_holds_everything_setup_py_builds_from(tmp_path):
    # Regression: no MANIFEST.in, and setup.py named exports.map by an absolute path: the
    # sdist lacked it and the bridge's sources, and `pip wheel` on it failed.
    import tarfile

    out = subprocess.run([sys.executable, "setup.py", "-q", "sdist", "--dist-dir", str(tmp_path)],
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    (sdist,) = tmp_path.glob("pyalloc-*.tar.gz")
    with tarfile.open(sdist) as tar:
        held = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
    csrc = {os.path.relpath(os.path.join(parent, f), ROOT)
            for parent, _, files in os.walk(os.path.join(ROOT, "csrc"))
            for f in files if f.endswith((".cpp", ".h", ".map"))}
    # Every module of the package and its subpackages (pyalloc/replay/): a subpackage
    # pyproject.toml does not list is left out of the sdist, and of the wheel built from it.
    package = {os.path.relpath(os.path.join(parent, f), ROOT)
               for parent, _, files in os.walk(os.path.join(ROOT, "pyalloc"))
               for f in files if f.endswith(".py")}
    needed = csrc | package | {"setup.py", "pyproject.toml", "README.md"}
    assert "csrc/python/exports.map" in needed and "csrc/torch_bridge/bridge.cpp" in needed
    assert "pyalloc/bridge.py" in needed and "pyalloc/replay/__init__.py" in needed
    assert not needed - held, f"missing from the sdist: {sorted(needed - held)}"
    assert not {n for n in held if n.endswith((".so", ".o", ".pyc"))}, "build outputs in the sdist"


# -- what a plain install gives ---------------------------------------------------------


def _specs(name):
    found = re.search(rf"^{name} = \[(.*?)\]", _read("pyproject.toml"), re.M | re.S)
    return re.findall(r'"([^"]+)"', found.group(1))


def test_regression_a_plain_install_brings_what_the_bridge_is_built_with():
    # Regression: ninja was in the test extra only, so `pip install pyalloc torch` fell back
    # to the hooks route with a warning; and the torch extra admitted torch 2.3, which the
    # bridge refuses (2.9 at least).
    from pyalloc import bridge

    assert "ninja" in _requirements("dependencies")
    (torch,) = [s for s in _specs("torch") if s.startswith("torch")]
    assert torch == "torch>={}.{}".format(*bridge.OLDEST_TORCH), torch


def test_the_readmes_install_line_gives_the_default_route():
    readme = _read("README.md")
    section = readme[readme.index("## Install"):]
    line = re.search(r"```bash\n(.*?)\n```", section, re.S).group(1).strip()
    extras = re.fullmatch(r'pip install "?\.\[([a-z,]+)\]"?(\s+#.*)?', line)
    assert extras, line
    named = set(extras.group(1).split(","))
    assert "torch" in named, "the bridge is built against torch: the install line brings it"
    assert "ninja" in _requirements("dependencies") | set().union(*(_requirements(e) for e in named))


def test_ci_checks_the_bridge_against_the_newest_torch():
    run = [ln.strip() for ln in _read(".ci", "run").splitlines()]
    # On its own line, after the suite, so that a failure there fails CI too (set -e).
    assert "set -euo pipefail" in run
    assert run.index("bash .ci/newest_torch") > run.index(_readme_test_command())
    script = _read(".ci", "newest_torch")
    assert "set -euo pipefail" in script
    assert "-m pyalloc bridge build --check" in script
    # The machine's cap on torch is lifted for the script's own pip calls, never removed.
    assert "export PIP_CONSTRAINT=" in script and "/etc/xdg/pip" not in script.replace("# ", "")
    # Everything it downloads stays in pip's cache, and is installed from there.
    assert "wheels=$(python3 -m pip cache dir)/newest-torch" in script
    assert script.count('--no-index --find-links "$wheels"') == 2
    building = " ".join(_read("docs", "building.md").split())
    assert "`.ci/run` runs `.ci/newest_torch`" in building
    for release in ("2.11", "2.12", "2.13", "2.14", "2.15"):
        assert f"| {release} |" in building, f"docs/building.md's table says nothing of torch {release}"


def test_ci_fuzzes_the_pickle_pre_scan_after_the_tests():
    lines = [ln.strip() for ln in _read(".ci", "run").splitlines()]
    tests = lines.index(_readme_test_command())
    assert lines.index("bash tests/fuzz/run.sh") > tests + 2, "on a line of its own, after the tests' status"
    script = _read("tests", "fuzz", "run.sh")
    assert "-fsanitize=fuzzer,address,undefined" in script and "-max_total_time=" in script
    assert "FUZZ_SECONDS=" in _read("docs", "building.md"), "docs/building.md says how to fuzz for longer"
