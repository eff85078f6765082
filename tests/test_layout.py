"""The source layout keeps its own rules: csrc/ layers include only the layers
below them (csrc/README.md), no two pyalloc modules import each other, the replay
package (pyalloc/replay/) stands on the core alone, and tests/ keeps a folder for
each layer's tests."""
from __future__ import annotations

import ast
import os
import re

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CSRC = os.path.join(REPO, "csrc")
PKG = os.path.join(REPO, "pyalloc")
TESTS = os.path.join(REPO, "tests")

# folder -> the folders its files may include (besides its own)
ALLOWED = {
    "core": set(),
    "backends": {"core"},
    "cuda": {"core"},
    "replay": {"core"},
    "python": {"core", "backends", "cuda", "replay"},
}


def _sources(folder):
    path = os.path.join(CSRC, folder)
    return [os.path.join(path, f) for f in sorted(os.listdir(path)) if f.endswith((".h", ".cpp"))]


def test_every_csrc_file_lies_in_a_layer_folder_with_a_readme():
    loose = [f for f in os.listdir(CSRC) if f.endswith((".h", ".cpp"))]
    assert loose == []
    for folder in ALLOWED:
        assert _sources(folder), folder
        with open(os.path.join(CSRC, folder, "README.md")) as f:
            assert len(f.read().split()) > 30, f"{folder}/README.md says too little"


def test_csrc_layers_include_only_the_layers_below():
    include = re.compile(r'#include\s+"([^"]+)"')
    for folder, allowed in ALLOWED.items():
        for path in _sources(folder):
            with open(path) as f:
                for name in include.findall(f.read()):
                    layer = name.split("/")[0] if "/" in name else folder
                    if "/" not in name:
                        assert os.path.exists(os.path.join(CSRC, folder, name)), (path, name)
                    assert layer == folder or layer in allowed, f"{path} includes {name}"
                    assert os.path.exists(os.path.join(CSRC, name if "/" in name else f"{folder}/{name}"))


def test_the_core_never_includes_cuda_or_python():
    for path in _sources("core"):
        with open(path) as f:
            text = f.read()
        for banned in ("cuda.h", "cuda_runtime", "pybind11", "Python.h", "torch/"):
            assert banned not in text, f"{path} mentions {banned}"


def _modules():
    """{dotted name inside pyalloc: path} for every module of the package and its
    subpackages (a subpackage's __init__.py by the subpackage's name: "replay")."""
    found = {}
    for parent, _, files in os.walk(PKG):
        package = os.path.relpath(parent, PKG).replace(os.sep, ".").strip(".")
        for f in files:
            if f.endswith(".py"):
                stem = f[:-3]
                if stem == "__init__" and package:
                    name = package
                else:
                    name = f"{package}.{stem}" if package else stem
                found[name] = os.path.join(parent, f)
    return found


def _imports(name, path):
    """Dotted names inside pyalloc that module `name` imports, at any depth of its code
    (a from-import of names gives the module and each name, which may be a submodule)."""
    with open(path) as f:
        tree = ast.parse(f.read())
    is_package = os.path.basename(path) == "__init__.py" and name != "__init__"
    here = name.split(".") if is_package else name.split(".")[:-1]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[:len(here) - (node.level - 1)]
            elif node.module and node.module.startswith("pyalloc."):
                base, node.module = [], node.module[len("pyalloc."):]
            else:
                continue
            target = ".".join(base + (node.module.split(".") if node.module else []))
            if target:
                found.add(target)
            found.update(f"{target}.{a.name}" if target else a.name for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name[len("pyalloc."):] for a in node.names if a.name.startswith("pyalloc."))
    return found


def test_no_import_cycles_in_the_package():
    modules = _modules()
    graph = {m: _imports(m, path) & set(modules) for m, path in modules.items()}
    # The package's __init__ and __main__ gather the others; cycles through them
    # are what Python's own import order resolves.
    for m in ("__init__", "__main__"):
        graph.pop(m, None)
    for deps in graph.values():
        deps.discard("__init__")

    def cycle_from(start):
        stack = [(start, [start])]
        while stack:
            node, path = stack.pop()
            for nxt in graph.get(node, ()):
                if nxt == start:
                    return path + [start]
                if nxt not in path:
                    stack.append((nxt, path + [nxt]))
        return None

    cycles = [c for m in sorted(graph) if (c := cycle_from(m))]
    assert cycles == [], cycles


def test_the_import_rules_see_the_replay_package():
    """The rules above read every module, subpackages' too, by the name it is imported by."""
    modules = _modules()
    assert {"replay", "replay.run", "replay.snapshot_io", "oom", "oom_watch"} <= set(modules)
    assert {"_C", "_config", "replay.allocators", "replay.oom"} <= _imports("replay.run", modules["replay.run"])
    assert "replay.snapshot_io" in _imports("oom_watch", modules["oom_watch"])


# The replay (pyalloc/replay/) stands on the compiled core and the configuration alone:
# the allocator's Python modules (the torch route, the OOM watch, the launcher) use it,
# never the reverse, so a replay runs where none of them could.
REPLAY_MAY_IMPORT = {"_C", "_config"}


def test_the_replay_package_imports_only_the_core_and_the_configuration():
    modules = _modules()
    outside = {}
    for name, path in modules.items():
        if name == "replay" or name.startswith("replay."):
            used = {m for m in _imports(name, path) & set(modules)
                    if m != "replay" and not m.startswith("replay.")}
            if used - REPLAY_MAY_IMPORT:
                outside[name] = sorted(used - REPLAY_MAY_IMPORT)
    assert outside == {}, outside


# tests/: a folder per layer (README.md, Layout); at the top, only the checks of the
# repository as a whole, beside the helpers (conftest.py, bridge_api.py, cpp/, gpu/, ...).
TEST_LAYERS = ("core", "cuda", "replay", "cli", "bench")
REPOSITORY_CHECKS = ("test_ci.py", "test_layout.py")


def test_every_test_module_lies_in_the_folder_of_a_layer():
    misplaced = []
    for parent, _, files in os.walk(TESTS):
        folder = os.path.relpath(parent, TESTS)
        for name in files:
            if not (name.startswith("test_") and name.endswith(".py")):
                continue
            if folder not in TEST_LAYERS and not (folder == "." and name in REPOSITORY_CHECKS):
                misplaced.append(os.path.normpath(os.path.join("tests", folder, name)))
    assert misplaced == [], f"{misplaced}: each belongs in tests/<layer>/, a layer of {TEST_LAYERS}"


# README.md is the front door, read in two minutes; each topic has its page in docs/,
# linked from it, and no link of either leads nowhere.
README_MOST_LINES = 250


def _relative_links(path):
    with open(path) as f:
        text = f.read()
    return [t for t in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text) if "://" not in t]


def test_the_readme_is_short_and_links_every_docs_page():
    readme = os.path.join(REPO, "README.md")
    with open(readme) as f:
        assert len(f.read().splitlines()) < README_MOST_LINES, "README.md: move the detail into docs/"
    linked = {os.path.normpath(t) for t in _relative_links(readme)}
    pages = {os.path.join("docs", f) for f in os.listdir(os.path.join(REPO, "docs")) if f.endswith(".md")}
    assert pages and pages <= linked, f"docs pages the README does not link: {sorted(pages - linked)}"


def test_every_relative_link_of_the_readme_and_docs_resolves():
    docs = os.path.join(REPO, "docs")
    files = [os.path.join(REPO, "README.md")] + [os.path.join(docs, f) for f in sorted(os.listdir(docs))
                                                  if f.endswith(".md")]
    broken = [(os.path.relpath(path, REPO), target) for path in files for target in _relative_links(path)
              if not os.path.exists(os.path.join(os.path.dirname(path), target))]
    assert broken == [], broken
