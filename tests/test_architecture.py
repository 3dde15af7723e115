"""The layering rules of docs/architecture.md, checked on the source tree."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "gateway"
PURE = ["core", "perfmodel", "policies", "flow", "sim"]
FORBIDDEN_MODULES = {
    "fastapi",
    "httpx",
    "starlette",
    "prometheus_client",
    "asyncio",
    "uvicorn",
    "socket",
    "threading",
}
ORDER = ["core", "perfmodel", "policies", "sim", "cluster", "emulator", "proxy", "epp", "cli"]
# A package may import only packages at or below its own rank (sim, cluster and emulator are peers).
RANK = {
    "core": 0,
    "perfmodel": 1,
    "policies": 2,
    "flow": 2.5,
    "sim": 3,
    "cluster": 3,
    "emulator": 3,
    "calibrate": 3,
    "bench": 3,
    "tracing": 3,  # spans and trace context: below the proxy, which reports to it
    "proxy": 4,
    "epp": 5,  # a front end over the proxy package's routing service and parsing
    "cli": 6,
}


def modules(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append(node.module)
    return out


@pytest.mark.parametrize("package", PURE)
def test_pure_packages_do_no_io_and_read_no_wall_clock(package: str) -> None:
    for path in modules(package):
        source = path.read_text(encoding="utf-8")
        tree = ast.parse(source)
        for name in imports(path):
            assert name.split(".")[0] not in FORBIDDEN_MODULES, f"{path} imports {name}"
        for node in ast.walk(tree):
            assert not isinstance(node, ast.AsyncFunctionDef), f"{path}: async def {node.name}"
        for banned in ("time.time(", "datetime.now(", "time.perf_counter(", "time.sleep("):
            if package == "core" and path.name == "clock.py":
                continue
            assert banned not in source, f"{path} calls {banned}"
        assert "random.random(" not in source and "random.choice(" not in source, (
            f"{path} uses module-level randomness"
        )


def test_layers_import_downward_only() -> None:
    for package, rank in RANK.items():
        for path in modules(package):
            for name in imports(path):
                parts = name.split(".")
                if parts[0] != "gateway" or len(parts) < 2 or parts[1] not in RANK:
                    continue
                assert RANK[parts[1]] <= rank, f"{path} imports {name} (upward)"
                if RANK[parts[1]] == rank and parts[1] != package:
                    raise AssertionError(f"{path} imports peer package {name}")
