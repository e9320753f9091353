"""Build the tiny heterogeneous agents (offline, seeded, idempotent).

python scripts/make_tiny_models.py --out .cache/tiny_models
"""

from __future__ import annotations

import argparse
import json

from mars2.models.tiny import make_tiny_models


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--out", default=".cache/tiny_models", help="directory to write the agents to"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--force", action="store_true", help="rebuild even if present")
    args = parser.parse_args()
    paths = make_tiny_models(args.out, seed=args.seed, force=args.force)
    for name, path in paths.items():
        info = json.loads((path / "mars2_tiny.json").read_text())
        print(f"{name}: {path} ({info['params']:,} parameters)")


if __name__ == "__main__":
    main()
