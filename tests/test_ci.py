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
    readme = " ".join(_read("README.md").split())
    assert "`.ci/run` runs `.ci/newest_torch`" in readme
    for release in ("2.11", "2.12", "2.13", "2.14", "2.15"):
        assert f"| {release} |" in readme, f"the README's table says nothing of torch {release}"
