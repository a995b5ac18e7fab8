"""jaxpaged's test suite, one folder per layer (docs/testing.md says which is which and how to run them)."""

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # the repository
