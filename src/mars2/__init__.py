"""mars2: multi-agent reinforced tree-search scaling (MARS²) for code generation."""

__version__ = "0.1.0"

from mars2.utils.runs import register_resolver as _register_resolver

_register_resolver()  # ${mars2_run_dir:...} in configs/hydra/default.yaml, for every entry point
