"""``python src/mars2/train.py experiment=tiny_pair`` from a checkout: the same as ``mars2-train``."""

from __future__ import annotations

from mars2.cli.train import main

if __name__ == "__main__":
    main()
