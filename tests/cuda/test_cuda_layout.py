"""The CUDA layer's boundaries stay where they were drawn (csrc/cuda/README.md):
graph pools behind their class's public interface, the device's pools never
reaching up to the registry that owns them, one out-of-memory path, and source
files that each open with what they hold and stay small enough to read."""
from __future__ import annotations

import os
import re

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CSRC = os.path.join(REPO, "csrc")
CUDA = os.path.join(CSRC, "cuda")

# Past this, a file holds more than one concern: split it by concern (STYLE.md).
MAX_LINES = 1200


def _read(path):
    with open(path) as f:
        return f.read()


def _code(text):
    """The text without its // comments (string literals are left alone)."""
    return re.sub(r"//[^\n]*", "", text)


def _sources():
    found = [os.path.join(folder, name) for folder, _, files in os.walk(CSRC)
             for name in sorted(files) if name.endswith((".h", ".cpp"))]
    # A wrong path walks nothing, and every check over the sources would pass on none.
    assert len(found) > 20, f"no C++ sources under {CSRC}"
    return found


def _class_body(text, name):
    start = re.search(r"\nclass " + name + r"\b[^;{]*\{", text)
    assert start, f"no class {name}"
    depth, i = 1, start.end()
    while depth:
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        i += 1
    return text[start.end():i - 1]


def _sections(body):
    """(access, text) of each top-level public/private/protected section of a class body."""
    out, access, depth, start = [], "private", 0, 0
    for m in re.finditer(r"[{}]|^\s*(public|private|protected):", body, re.M):
        if m.group(0) == "{":
            depth += 1
        elif m.group(0) == "}":
            depth -= 1
        elif depth == 0:
            out.append((access, body[start:m.start()]))
            access, start = m.group(1), m.end()
    out.append((access, body[start:]))
    return out


def _top_level(body):
    """A class body without what lies inside its braces (nested classes, inline bodies)."""
    out, depth = [], 0
    for ch in body:
        depth -= ch == "}"
        if depth == 0:
            out.append(ch)
        depth += ch == "{"
    return "".join(out)


def _members(body):
    """(declaration, name) of each data member (named with a trailing _) of a class body,
    its nested classes' left out."""
    body = _top_level(body)
    return re.findall(r"^\s*([^;(){}]*?)\b(\w+_)\s*(?:\{[^}]*\})?\s*(?:=[^;]*)?;", body, re.M)


def test_graph_pools_keep_their_state_to_themselves():
    header = _code(_read(os.path.join(CUDA, "graph_pools.h")))
    body = _class_body(header, "GraphPools")
    assert "friend" not in body
    for access, text in _sections(body):
        members = set(re.findall(r"\b(\w+_)\s*(?:[;{=]|\[)", text))
        if access != "private":
            assert not members, f"GraphPools exposes its state: {sorted(members)}"


def test_device_pools_reach_graph_pools_only_through_their_public_methods():
    header = _code(_read(os.path.join(CUDA, "graph_pools.h")))
    public = set()
    for access, text in _sections(_class_body(header, "GraphPools")):
        if access == "public":
            public |= set(re.findall(r"\b(\w+)\s*\(", text))
    used = set()
    for path in _sources():
        if os.path.basename(path).startswith("graph_pools."):
            continue
        used |= set(re.findall(r"\bgraphs(?:_|\(\))\s*\.\s*(\w+)", _code(_read(path))))
    assert used, "DevicePools no longer holds its graph pools as graphs_"
    assert used <= public, f"not GraphPools' public interface: {sorted(used - public)}"
    # None of the graph pools' own state (what is not handed to them: a
    # reference or a constant) is kept in DevicePools as well.
    own = {name for decl, name in _members(_class_body(header, "GraphPools"))
           if "&" not in decl and not decl.lstrip().startswith("const")}
    pools = _code(_read(os.path.join(CUDA, "cuda_pools.h")))
    kept = {name for _, name in _members(_class_body(pools, "DevicePools"))}
    assert own and not own & kept, sorted(own & kept)


def test_the_device_pools_never_reach_up_to_the_registry():
    for name in ("cuda_pools.h", "cuda_pools.cpp", "graph_pools.h", "graph_pools.cpp",
                 "pool_backend.h", "pool_backend.cpp"):
        code = _code(_read(os.path.join(CUDA, name)))
        assert '#include "registry.h"' not in code, name
        assert "PoolRegistry" not in code and "hooks::" not in code, name


def test_one_out_of_memory_path():
    """The core counts, traces and words an out-of-memory error in one place;
    the device's pools neither catch one nor raise their own."""
    counted, traced = [], []
    for path in _sources():
        code = _code(_read(path))
        if re.search(r"\bstats_\.num_ooms\s*(\+\+|\+=)", code):
            counted.append(os.path.relpath(path, CSRC))
        if re.search(r"trace\(\s*TraceEntry::kOom", code):
            traced.append(os.path.relpath(path, CSRC))
    assert counted == ["core/oom.cpp"] and traced == ["core/oom.cpp"], (counted, traced)
    for name in ("cuda_pools.cpp", "graph_pools.cpp", "pool_backend.cpp"):
        code = _code(_read(os.path.join(CUDA, name)))
        assert "OutOfMemoryError" not in code, f"{name} catches or raises an OutOfMemoryError itself"


def test_every_source_opens_with_what_it_holds_and_stays_readable():
    for path in _sources():
        text = _read(path)
        rel = os.path.relpath(path, CSRC)
        assert text.startswith(("//", "/*")), f"{rel} does not open with a comment on what it holds"
        lines = text.count("\n")
        assert lines <= MAX_LINES, f"{rel} has {lines} lines (limit {MAX_LINES}): split it by concern"
