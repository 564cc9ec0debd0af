"""The package's import structure: no import cycle among kvrepro's modules (counting imports inside functions
too: a lazy import that closes a cycle still ties two modules' jobs together), and every module but the vLLM
backend itself imports without vLLM."""
import ast
import pathlib
import subprocess
import sys


ROOT = pathlib.Path(__file__).resolve().parents[1]
PKG = ROOT / "kvrepro"
NEEDS_VLLM = {"kvrepro.vllm_backend.backend"}   # the backend classes subclass vLLM's


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def all_modules() -> dict[str, pathlib.Path]:
    return {module_name(p): p for p in sorted(PKG.rglob("*.py")) if "__pycache__" not in p.parts}


def imports_of(name: str, path: pathlib.Path, known: set[str]) -> set[str]:
    """The kvrepro modules ``name`` imports anywhere in its file (module level or inside functions)."""
    is_pkg = path.name == "__init__.py"
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:                                  # relative: resolve against this module's package
                pkg = name.split(".") if is_pkg else name.split(".")[:-1]
                pkg = pkg[:len(pkg) - node.level + 1]
                base = ".".join(pkg + ([base] if base else []))
            # "from a.b import c": the submodule a.b.c if there is one, else the module a.b
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        for t in targets:
            while t and t not in known:                     # "import kvrepro.ops.decode as d" -> that module
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` as ``[a, b, ..., a]``, or None."""
    state, stack = {}, []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == "open":
                return stack[stack.index(n):] + [n]
            if n not in state:
                found = visit(n)
                if found:
                    return found
        stack.pop()
        state[m] = "done"
        return None

    for m in sorted(graph):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


def test_cycle_finder_finds_a_planted_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "d": {"a", "c"}}) is None
    known = {"kvrepro", "kvrepro.ops", "kvrepro.ops.decode", "kvrepro.ops.common"}
    src = PKG / "ops" / "decode.py"
    assert "kvrepro.ops.common" in imports_of("kvrepro.ops.decode", src, known)


def test_no_import_cycle_among_kvrepro_modules():
    mods = all_modules()
    graph = {m: imports_of(m, p, set(mods)) for m, p in mods.items()}
    assert "kvrepro.vllm_backend.measure" not in mods      # the sweep worker lives outside the plugin package
    assert "kvrepro.sweep" in graph["kvrepro.sweep_worker"]
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)
    # the settings and the provenance depend on nothing that records or runs measurements
    for m in ("kvrepro.settings", "kvrepro.provenance"):
        bad = {d for d in graph[m] if d.startswith(("kvrepro.sweep", "kvrepro.accuracy", "kvrepro.vllm_backend"))}
        assert not bad, (m, bad)
    # the plugin package holds what vLLM loads; it does not reach back into the sweep or the accuracy runs
    for m in (m for m in graph if m.startswith("kvrepro.vllm_backend")):
        assert not {d for d in graph[m] if d.startswith(("kvrepro.sweep", "kvrepro.accuracy"))}, m


BLOCK_VLLM = """
import importlib.abc, importlib, sys

class NoVllm(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "vllm" or name.startswith("vllm."):
            raise ImportError(f"vLLM blocked by the test: {name}")
        return None

sys.meta_path.insert(0, NoVllm())
failed = []
for m in sys.argv[1:]:
    try:
        importlib.import_module(m)
    except Exception as e:
        failed.append(f"{m}: {type(e).__name__}: {e}")
print("\\n".join(failed))
sys.exit(1 if failed else 0)
"""


def test_every_module_but_the_backend_imports_without_vllm():
    mods = sorted(m for m in all_modules() if m not in NEEDS_VLLM)
    r = subprocess.run([sys.executable, "-c", BLOCK_VLLM, *mods], capture_output=True, text=True, timeout=300,
                       cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    r = subprocess.run([sys.executable, "-c", BLOCK_VLLM, *sorted(NEEDS_VLLM)], capture_output=True, text=True,
                       timeout=300, cwd=ROOT)
    assert r.returncode == 1 and "vLLM blocked by the test" in r.stdout    # the one that needs it says so
