"""mars2: multi-agent reinforced tree-search scaling (MARS²) for code generation."""

__version__ = "0.1.0"
