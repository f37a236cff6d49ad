"""Size limits of the library packages (issue 18): a module over 500 lines or a function over 80 lines fails.

Generated protobuf stubs, tests, benchmarks and examples are not library code. A module that has to grow past
the limit is split by concern (docs/design.md lists what each module owns), not exempted here.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LIBRARY = ("server", "engines", "cache", "placement", "speculation", "grpo", "envhub", "observability", "rl_client")
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 80


def _modules() -> list[Path]:
    return [p for pkg in LIBRARY for p in sorted((ROOT / pkg).rglob("*.py")) if "_pb2" not in p.name]


def test_no_library_module_is_over_500_lines() -> None:
    long = {str(p.relative_to(ROOT)): n for p in _modules() if (n := p.read_text().count("\n")) > MAX_MODULE_LINES}
    assert not long, f"split these modules by concern (limit {MAX_MODULE_LINES} lines): {long}"


def test_no_library_function_is_over_80_lines() -> None:
    long = {}
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    long[f"{path.relative_to(ROOT)}:{node.lineno} {node.name}"] = length
    assert not long, f"split these functions (limit {MAX_FUNCTION_LINES} lines): {long}"


def test_the_check_sees_every_library_package() -> None:
    assert len(_modules()) > 100 and all((ROOT / pkg / "__init__.py").is_file() for pkg in LIBRARY)
