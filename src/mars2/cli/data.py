"""``mars2-data livecodebench --release v6`` and ``mars2-data deepcoder``: fetch the public
datasets and write the files the data configs read (see `mars2.data.fetch`)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from mars2.cli import default_root
from mars2.cli.errors import fail


def _parser() -> argparse.ArgumentParser:
    from mars2.data.fetch import DEEPCODER_SUBSETS, DEEPCODER_TRAIN, LCB_RELEASES

    parser = argparse.ArgumentParser(
        prog="mars2-data",
        description="Fetch a public dataset from the Hugging Face hub (needs network) and write "
        "it where the data configs read it; prints counts per platform and difficulty.",
        epilog="examples:\n"
        "  mars2-data livecodebench --release v6    # data/livecodebench/release_v6.jsonl\n"
        "  mars2-data deepcoder                     # data/deepcoder/train.jsonl\n"
        "  mars2-data --data-dir /scratch/data deepcoder --split test\n\n"
        "The data configs that read these files live in the package (mars2.configs, the "
        "checkout's configs/data/): data=livecodebench, data=deepcoder. See docs/data.md.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    where = "where to write (default: paths.data_dir, i.e. $MARS2_ROOT/data or ./data)"
    parser.add_argument("--data-dir", type=Path, default=None, help=where)
    # Also after the dataset's name (SUPPRESS: an absent one keeps the value given before it).
    after = argparse.ArgumentParser(add_help=False)
    after.add_argument("--data-dir", type=Path, default=argparse.SUPPRESS, help=where)
    sub = parser.add_subparsers(dest="dataset", required=True)
    lcb = sub.add_parser(
        "livecodebench",
        parents=[after],
        help="LiveCodeBench code generation -> livecodebench/release_vN.jsonl (data=livecodebench)",
    )
    lcb.add_argument(
        "--release", default=f"v{LCB_RELEASES}",
        help=f"v1 ... v{LCB_RELEASES}: every problem up to that release (default v{LCB_RELEASES})",
    )  # fmt: skip
    deep = sub.add_parser(
        "deepcoder",
        parents=[after],
        help="DeepCoder-Preview -> deepcoder/<split>.jsonl (data=deepcoder training)",
    )
    deep.add_argument(
        "--subsets", default=",".join(DEEPCODER_TRAIN),
        help=f"comma-separated, of {', '.join(DEEPCODER_SUBSETS)} (default: DeepCoder's mix)",
    )  # fmt: skip
    deep.add_argument("--split", default="train", choices=["train", "test"])
    return parser


def main(argv: list[str] | None = None) -> None:
    """Fetch one dataset (command line)."""
    default_root()
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    from mars2.data.fetch import FetchError, fetch_deepcoder, fetch_livecodebench
    from mars2.data.problem import ProblemFormatError

    data_dir = args.data_dir or Path(os.environ.get("MARS2_ROOT", ".")) / "data"
    try:
        if args.dataset == "livecodebench":
            written = fetch_livecodebench(args.release, data_dir)
        else:
            subsets = [s.strip() for s in args.subsets.split(",") if s.strip()]
            written = fetch_deepcoder(subsets, args.split, data_dir)
    except (FetchError, ProblemFormatError, OSError) as error:
        fail(str(error))
    print(written.summary())


if __name__ == "__main__":
    main()
