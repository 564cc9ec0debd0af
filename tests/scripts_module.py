"""Load a file of ``scripts/`` as a module, so tests reach its CPU-side functions (the scripts are not a package)."""
from __future__ import annotations

import importlib.util
import pathlib

SCRIPTS = pathlib.Path(__file__).resolve().parents[1] / "scripts"


def load(name: str):
    """``scripts/<name>.py`` executed as a fresh module named ``<name>_script``."""
    spec = importlib.util.spec_from_file_location(f"{name}_script", SCRIPTS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
