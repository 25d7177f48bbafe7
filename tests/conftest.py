import importlib.metadata
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def pytest_terminal_summary(terminalreporter):
    """The versions this run resolved (a fresh environment takes the newest releases),
    printed even under ``-q``, just above the final counts."""
    names = ("torch", "diffusers", "transformers", "safetensors", "optree", "pytest", "hypothesis", "ruff")
    versions = []
    for name in names:
        try:
            versions.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            versions.append(f"{name} (not installed)")
    terminalreporter.write_line("packages: " + ", ".join(versions))
