"""Render saved trees to HTML and open one (or screenshot it with headless Chromium).

python scripts/view_tree.py logs/train/runs/tiny_pair/<time>/trees/step_000003_rank0.jsonl
python scripts/view_tree.py TREES.jsonl --index 2 --screenshot tree.png --no-open

A page opens on the tree's best answer; a missing file, a bad index or a screenshot without
Chromium end with one line on stderr and exit status 1 (the pages are written first).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import webbrowser
from pathlib import Path

from mars2.eval.tree_view import write_tree_pages
from mars2.search.tree import load_trees


def screenshot(page: Path, png: Path, width: int = 1400, height: int = 900) -> Path:
    """Headless Chromium renders the page to a PNG."""
    browser = (
        shutil.which("chromium")
        or shutil.which("chromium-browser")
        or shutil.which("google-chrome")
    )
    if browser is None:
        raise ViewError(
            "--screenshot needs headless Chromium and none is installed (apt-get install "
            "chromium); the HTML pages are written and open in any browser"
        )
    with tempfile.TemporaryDirectory() as profile:
        done = subprocess.run(
            [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={profile}", f"--window-size={width},{height}", f"--screenshot={png}",
             page.resolve().as_uri()],
            check=False, capture_output=True, timeout=120,
        )  # fmt: skip
    if done.returncode != 0 or not png.exists():
        tail = done.stderr.decode(errors="replace").strip().splitlines()[-1:] or ["no output"]
        raise ViewError(f"Chromium could not screenshot {page} (exit {done.returncode}: {tail[0]})")
    return png


class ViewError(RuntimeError):
    """Something this script cannot do; the message says why."""


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("path", type=Path, help="a trees .jsonl file (training or eval output)")
    parser.add_argument("--index", type=int, default=0, help="which tree of the file to open")
    parser.add_argument("--out", type=Path, default=None, help="where to write the HTML pages")
    parser.add_argument("--screenshot", type=Path, default=None, help="also save a PNG of the page")
    parser.add_argument("--no-open", action="store_true", help="do not open a browser")
    args = parser.parse_args()
    try:
        show(args)
    except (ViewError, OSError, ValueError) as error:
        print(f"Error: {error}", file=sys.stderr)
        sys.exit(1)


def show(args: argparse.Namespace) -> None:
    if not args.path.is_file():
        raise ViewError(f"{args.path}: no such trees file (a run writes them under <run>/trees/)")
    trees = load_trees(args.path)
    if not -len(trees) <= args.index < len(trees):
        raise ViewError(f"--index {args.index}: {args.path} holds {len(trees)} trees")
    out = args.out or args.path.with_suffix("")
    pages = write_tree_pages(trees, out)
    page = pages[args.index]
    print(f"wrote {len(pages)} pages under {out}; this one: {page}")
    if args.screenshot:
        print(f"screenshot: {screenshot(page, args.screenshot)}")
    if not args.no_open:
        webbrowser.open(page.resolve().as_uri())


if __name__ == "__main__":
    main()
