"""The house's plan, read from the code's own imports (ARCHITECTURE §1): no module import
circle, each top-level room imports only the rooms it may, pure logic imports neither
torch nor Ray, and the KV roles see the transport only through its protocols."""

from __future__ import annotations

import ast
import inspect
import os
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SKIP = {"tests", "bench", ".venv", "build", "phalanx.egg-info", ".git"}
SHARED = {"config", "log", "envs", "version"}  # leaves every room may use

# room -> the rooms it may import (besides itself and SHARED). Departures from the
# ARCHITECTURE table, each for a reason: `actors` builds a rank's model shard and MoE
# interface (`models`); `kv_transfer` launches its slab kernel through
# `kernels.gpu.compiled_launch`; the server raises the SDK's `APIError` from its
# in-process client so both clients fail alike.
MAY_IMPORT = {
    "kernels": set(),
    "comm": {"kernels"},
    "models": {"kernels"},
    "engine": {"models", "kernels"},
    "kv_transfer": {"kernels"},
    "actors": {"engine", "comm", "kv_transfer", "policies", "models"},
    "policies": set(),
    "router": {"policies"},
    "sdk": {"openai_types"},
    "chaos": {"sdk"},
    "server": {"actors", "router", "policies", "engine", "models", "llm", "openai_types",
               "sdk"},
}
PURE = ["engine.block_pool", "engine.scheduler", "engine.sequence", "actors.reconciler",
        "actors.abort_cleanup", "actors.held_reports", "actors.resume", "router",
        "policies", "kv_transfer.planning"]


def _modules() -> dict[str, pathlib.Path]:
    """The package's modules by dotted name: the checkout's top-level folders but SKIP and
    hidden ones (venvs such as AIPerf's `.aiperf-<version>/`), pruned before they are walked."""
    mods = {}
    for top, dirs, files in os.walk(ROOT):
        if pathlib.Path(top) == ROOT:
            dirs[:] = [d for d in dirs if d not in SKIP and not d.startswith(".")]
        for file in files:
            if not file.endswith(".py"):
                continue
            path = pathlib.Path(top) / file
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            mods[name] = path
    return mods


def _imports(name: str, path: pathlib.Path, mods: dict) -> set[str]:
    """Every module `name` imports, at any depth of its code: ours as dotted names
    without the `phalanx.` prefix, others as their top-level package."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".") if package else []
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
                if not (target == "phalanx" or target.startswith("phalanx.")):
                    out.add(target.split(".")[0])
                    continue
                target = target.removeprefix("phalanx").lstrip(".")
            for alias in node.names:
                full = f"{target}.{alias.name}" if target else alias.name
                out.add(full if full in mods else target)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("phalanx."):
                    out.add(alias.name.removeprefix("phalanx."))
                else:
                    out.add(alias.name.split(".")[0])
    return out


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    mods = _modules()
    return {name: _imports(name, path, mods) for name, path in mods.items()}


def _room(name: str) -> str:
    return name.split(".")[0]


def test_no_module_import_circle(graph):
    ours = {m: {d for d in deps if d in graph and d != m} for m, deps in graph.items()}
    index, low, stack, on_stack, circles = {}, {}, [], set(), []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in ours[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(ours):
        if v not in index:
            visit(v)
    assert circles == []


def test_rooms_import_only_what_they_may(graph):
    wrong = []
    for name, deps in graph.items():
        room = _room(name)
        allowed = MAY_IMPORT.get(room)
        if allowed is None:
            continue
        for dep in deps:
            if dep in graph and _room(dep) not in allowed | SHARED | {room}:
                wrong.append(f"{name} -> {dep}")
    assert wrong == []


def test_kernels_and_planning_stay_leaves(graph):
    assert not [d for m, ds in graph.items() if m.startswith("kv_transfer.planning")
                for d in ds if d in graph and not d.startswith("kv_transfer.planning")]
    assert not [d for m, ds in graph.items() if _room(m) == "kernels"
                for d in ds if d in graph and _room(d) != "kernels"]


@pytest.mark.parametrize("prefix", PURE)
def test_pure_logic_imports_neither_torch_nor_ray(graph, prefix):
    for name, deps in graph.items():
        if name == prefix or name.startswith(prefix + "."):
            assert not deps & {"torch", "ray", "triton"}, name


def test_the_kv_roles_hold_the_transport_through_its_protocols():
    from phalanx.kv_transfer.transport import (BlockingKVReceiver, BlockingKVSender,
                                               KVReceiverProtocol, KVSenderProtocol)
    for impl, proto in ((BlockingKVSender, KVSenderProtocol),
                        (BlockingKVReceiver, KVReceiverProtocol)):
        assert issubclass(impl, proto)
        for method in ("connect", "prepare", "submit_layer", "withdraw", "start", "expect",
                       "release", "stats"):
            if not hasattr(proto, method):
                continue
            wanted = list(inspect.signature(getattr(proto, method)).parameters)
            given = inspect.signature(getattr(impl, method)).parameters
            assert all(p in given for p in wanted), (impl.__name__, method)
    roles = (ROOT / "actors" / "rank" / "prefill_role.py").read_text() + (
        ROOT / "actors" / "rank" / "decode_role.py").read_text()
    assert "KVSenderProtocol" in roles and "KVReceiverProtocol" in roles
