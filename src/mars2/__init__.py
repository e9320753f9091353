"""mars2: multi-agent reinforced tree-search scaling (MARS²) for code generation.

Kept import-free on purpose: sandbox executors start as ``python -m mars2.sandbox.runner.executor``
and every job's process is forked from them, so whatever this file imports is copied into every
fork.
"""

__version__ = "0.1.0"
