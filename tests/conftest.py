import importlib.metadata
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def pytest_report_header(config):
    """The versions this run resolved (a fresh environment takes the newest releases)."""
    names = ("torch", "diffusers", "transformers", "safetensors", "optree", "pytest", "hypothesis", "ruff")
    versions = []
    for name in names:
        try:
            versions.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            versions.append(f"{name} (not installed)")
    return "packages: " + ", ".join(versions)
