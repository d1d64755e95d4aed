"""What `pip install .` ships: the serving package alone, never the fixtures, tools, tests or
benchmarks, and nothing it ships imports them."""

import ast
import pathlib

import pytest
from setuptools import find_packages

REPO = pathlib.Path(__file__).resolve().parents[2]
NOT_SHIPPED = ("fixtures", "tools", "tests", "benchmarks", "examples", "helpers")


@pytest.mark.unit
def test_only_the_serving_package_ships():
    packages = find_packages(where=REPO, include=["vllm_deepinfer", "vllm_deepinfer.*"])
    assert "vllm_deepinfer.worker" in packages and "vllm_deepinfer.patches" in packages
    assert not [p for p in packages if p.split(".")[0] in NOT_SHIPPED]
    setup_py = (REPO / "setup.py").read_text()
    assert 'find_packages(include=["vllm_deepinfer", "vllm_deepinfer.*"])' in setup_py


@pytest.mark.unit
def test_every_folder_of_modules_is_a_package():
    """find_packages skips a folder without `__init__.py`: its modules would be missing
    from a wheel (spec_decode/dspark was, before it had one)."""
    packages = set(find_packages(where=REPO, include=["vllm_deepinfer", "vllm_deepinfer.*"]))
    folders = {
        ".".join(path.parent.relative_to(REPO).parts)
        for path in (REPO / "vllm_deepinfer").rglob("*.py")
    }
    assert sorted(folders - packages) == []


@pytest.mark.unit
def test_the_shipped_package_imports_no_tooling():
    offenders = []
    for path in (REPO / "vllm_deepinfer").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom) and not node.level
                else []
            )
            offenders += [
                f"{path.relative_to(REPO)}: {name}"
                for name in names
                if name.split(".")[0] in NOT_SHIPPED
            ]
    assert not offenders
