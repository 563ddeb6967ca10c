"""The package contracts (issue 14): who may import the dangerous layer, what each package exports,
and no private name used across modules. Read from the source with ast, and from ruff itself."""

from __future__ import annotations

import ast
import functools
import importlib
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SRC = REPO / "src"
RUFF = Path(sys.executable).parent / "ruff"

# Which files may import each dangerous module, and why. pyproject.toml's TID251 ignores name the
# same files (ruff can only allow a file everything it bans; this says which module each may use).
DANGEROUS: dict[str, dict[str, str]] = {
    "subprocess": {
        "bastion/sandbox/_spawn.py": "starts bwrap",
        "bastion/sandbox/_disk.py": "mkfs, mount and umount",
        "bastion/sandbox/_idmap.py": "`unshare` makes the user namespace",
        "bastion/gateway/dispatch.py": "runs on the target host; spawning the action is its job",
        "bastion/templates/_pip.py": "makes a template's venv and pip-installs its hashed lock",
        "bastion/systemd/install.py": "install-service runs systemd-sysusers and systemctl daemon-reload",
    },
    "bastion.sandbox._spawn": {
        "bastion/sandbox/warm.py": "the checked layer above: it starts the sandboxes",
        "bastion/sandbox/__init__.py": "re-exports the constants, SandboxSpec and sandbox_python",
        "bastion/doctor.py": "probes bwrap with the sandboxes' own flags",
        "bastion/sandbox/backend.py": "names SandboxSpec, what a backend starts a sandbox from",
        "bastion/sandbox/microvm.py": "the checked layer above: it starts the microVMs",
    },
    "bastion.sandbox._disk": {
        "bastion/sandbox/_devices.py": "each sandbox's tmpfs",
        "bastion/sandbox/__init__.py": "re-exports quota_available, a check that changes nothing",
        "bastion/workbench/manager.py": "owns each sandbox's workspace disk",
    },
    "bastion.safety._openat2": {
        "bastion/safety/paths.py": "the path jail is built on openat2",
    },
}
# Files ruff allows a banned call in, not a banned import.
BANNED_CALLS: dict[str, str] = {
    "bastion/sandbox/inside/agent.py": "runs inside the sandbox: forks and spawns the commands",
    "bastion/sandbox/inside/repl.py": "runs inside the sandbox: spawns the bash or node of a context",
    "bastion/sandbox/inside/relay.py": "runs inside a microVM guest: spawns the agent",
}
IMPORTING_CALLS = frozenset({"__import__", "import_module"})


def _source_files(root: Path) -> list[Path]:
    return sorted(root.rglob("*.py"))


def _module_of(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _package_of(path: Path) -> str:
    module = _module_of(path)
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _is_module(dotted: str) -> bool:
    path = SRC.joinpath(*dotted.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


@functools.cache
def _parsed(path: Path) -> ast.Module:
    """A source file's tree, parsed once per test process (the checks below walk every file of src, tests
    and bench; parsing them again for each took ~25 s of the suite's CPU)."""
    return ast.parse(path.read_text(encoding="utf-8"))


def _imports(path: Path) -> Iterator[tuple[int, str]]:
    return _imports_of(_parsed(path), _package_of(path))


def _imports_in(source: str, package: str) -> Iterator[tuple[int, str]]:
    return _imports_of(ast.parse(source), package)


def _imports_of(tree: ast.Module, package: str) -> Iterator[tuple[int, str]]:
    """Every module a source imports, in any form: `import a.b`, `from a import b`, `from . import b`,
    and `__import__("a")` or `importlib.import_module("a")` with a literal name."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            yield node.lineno, base
            yield from ((node.lineno, f"{base}.{alias.name}") for alias in node.names)
        elif isinstance(node, ast.Call) and _called_name(node) in IMPORTING_CALLS and node.args:
            first = node.args[0]
            if isinstance(first, ast.Constant) and isinstance(first.value, str):
                yield node.lineno, first.value


def _called_name(call: ast.Call) -> str:
    func = call.func
    if isinstance(func, ast.Name):
        return func.id
    return func.attr if isinstance(func, ast.Attribute) else ""


def _within(dotted: str, module: str) -> bool:
    return dotted == module or dotted.startswith(module + ".")


def _packages() -> list[str]:
    return sorted(_module_of(init) for init in SRC.rglob("__init__.py"))


def test_the_dangerous_layer_is_imported_only_where_allowed() -> None:
    wrong = []
    for path in _source_files(SRC / "bastion"):
        name = path.relative_to(SRC).as_posix()
        for line, dotted in _imports(path):
            wrong += [
                f"{name}:{line} imports {dotted}"
                for module, allowed in DANGEROUS.items()
                if _within(dotted, module) and name not in allowed
            ]
    assert wrong == []


def test_ruff_allows_banned_names_in_exactly_the_listed_files() -> None:
    config = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    ignores = config["tool"]["ruff"]["lint"]["per-file-ignores"]
    in_src = {pattern for pattern, rules in ignores.items() if pattern.startswith("src/") and "TID251" in rules}
    listed = {name for allowed in DANGEROUS.values() for name in allowed} | set(BANNED_CALLS)
    assert in_src == {f"src/{name}" for name in listed}


def test_no_line_in_src_silences_the_import_rules() -> None:
    # A `noqa` would allow one line anywhere; the allow-list lives in pyproject.toml only.
    silenced = [
        f"{path.relative_to(REPO)}:{number}"
        for path in _source_files(SRC)
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if "TID251" in line and "noqa" in line
    ]
    assert silenced == []


def test_private_modules_are_imported_only_inside_their_package() -> None:
    allowed = {(name, module) for module, files in DANGEROUS.items() for name in files}
    wrong = []
    for path in _source_files(SRC / "bastion"):
        name, package = path.relative_to(SRC).as_posix(), _package_of(path)
        for line, dotted in _imports(path):
            parts = dotted.split(".")
            private = next((i for i, part in enumerate(parts) if _is_private(part)), None)
            if parts[0] != "bastion" or private is None:
                continue
            owner = ".".join(parts[:private])
            inside = _within(package, owner)
            if not inside and (name, ".".join(parts[: private + 1])) not in allowed:
                wrong.append(f"{name}:{line} imports {dotted}")
    assert wrong == []


@pytest.mark.parametrize("root", ["src", "tests", "bench"])
def test_no_private_name_is_imported_across_modules(root: str) -> None:
    # A private module (`_x.py`) has public names; a public module's `_names` stay inside it.
    wrong = []
    for path in _source_files(REPO / root):
        for node in ast.walk(_parsed(path)):
            if not (isinstance(node, ast.ImportFrom) and (node.module or "").startswith("bastion")):
                continue
            names = [alias.name for alias in node.names if _is_private(alias.name)]
            wrong += [
                f"{path.relative_to(REPO)}:{node.lineno} imports {node.module}.{name}"
                for name in names
                if not _is_module(f"{node.module}.{name}")
            ]
    assert wrong == []


@pytest.mark.parametrize("package", _packages())
def test_every_package_lists_what_it_exports(package: str) -> None:
    module = importlib.import_module(package)
    exported = module.__dict__.get("__all__")
    assert isinstance(exported, list), f"{package} has no __all__ list"
    assert len(set(exported)) == len(exported)
    assert [name for name in exported if not hasattr(module, name)] == []


def test_what_other_modules_import_from_a_package_is_in_its_all() -> None:
    packages = set(_packages())
    wrong = []
    for root in ("src", "tests", "bench"):
        for path in _source_files(REPO / root):
            for node in ast.walk(_parsed(path)):
                if not (isinstance(node, ast.ImportFrom) and node.module in packages):
                    continue
                exported = importlib.import_module(node.module).__all__
                wrong += [
                    f"{path.relative_to(REPO)}:{node.lineno} imports {node.module}.{alias.name}"
                    for alias in node.names
                    if alias.name not in exported and not _is_module(f"{node.module}.{alias.name}")
                ]
    assert wrong == []


def _ruff(text: str, filename: str) -> subprocess.CompletedProcess[str]:
    argv = [str(RUFF), "check", "--no-cache", "--config", str(REPO / "pyproject.toml"), "--select", "TID251"]
    argv += ["--stdin-filename", filename, "-"]
    return subprocess.run(argv, input=text, capture_output=True, text=True, cwd=REPO, check=False, timeout=60)


DANGEROUS_TEXT = {
    "import subprocess\n": "src/bastion/sandbox/_disk.py",
    "from bastion.sandbox._spawn import start_sandbox\n": "src/bastion/sandbox/warm.py",
    "from bastion.sandbox import _spawn\n": "src/bastion/sandbox/warm.py",
    "import bastion.sandbox._disk\n": "src/bastion/workbench/manager.py",
    "from bastion.safety._openat2 import load_openat2\n": "src/bastion/safety/paths.py",
    "import importlib\n\nimportlib.import_module('subprocess')\n": "src/bastion/sandbox/_spawn.py",
    "import os\n\nos.fork()\n": "src/bastion/sandbox/inside/agent.py",
}


@pytest.mark.parametrize(("text", "allowed_file"), DANGEROUS_TEXT.items())
def test_ruff_refuses_the_dangerous_layer_outside_the_allow_list(text: str, allowed_file: str) -> None:
    refused = _ruff(text, "src/bastion/workbench/example.py")
    assert refused.returncode == 1, refused.stdout + refused.stderr
    assert "TID251" in refused.stdout
    allowed = _ruff(text, allowed_file)
    assert allowed.returncode == 0, allowed.stdout + allowed.stderr


def test_the_ast_check_sees_imports_ruff_cannot() -> None:
    # ruff bans names, not calls of the `__import__` builtin: the ast walk above catches those.
    source = "__import__('subprocess')\nfrom .. import sandbox\nfrom bastion.sandbox import _spawn\n"
    found = {dotted for _, dotted in _imports_in(source, "bastion.workbench")}
    assert {"subprocess", "bastion.sandbox", "bastion.sandbox._spawn"} <= found
    assert _ruff("__import__('subprocess')\n", "src/bastion/workbench/example.py").returncode == 0


def _import_graph() -> dict[str, set[str]]:
    """Module -> the bastion modules it imports, TYPE_CHECKING imports included."""
    graph: dict[str, set[str]] = {}
    for path in _source_files(SRC / "bastion"):
        graph[_module_of(path)] = {
            name for _, name in _imports(path) if name.startswith("bastion") and _is_module(name)
        }
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), or one that imports itself."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for other in graph.get(module, ()):
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            component = []
            while (top := stack.pop()) != module:
                component.append(top)
            component.append(module)
            if len(component) > 1 or module in graph.get(module, ()):
                found.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return found


def test_no_import_circle_even_under_type_checking() -> None:
    """The layers of docs/architecture.md hold: no module reaches itself through imports. A package's
    __init__ counts as imported by `from bastion.pkg import x`, so a re-export cannot hide a circle."""
    assert _cycles(_import_graph()) == []


def test_the_circle_check_sees_a_circle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
