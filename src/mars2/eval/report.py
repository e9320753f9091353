"""Evaluation results as a console table, JSON and CSV files, and MLflow metrics."""

from __future__ import annotations

import csv
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mars2.eval.runner import Summary


def table(summaries: Sequence[Summary]) -> str:
    """A plain-text table: one row per evaluated setting, one column per metric."""
    columns = sorted(
        {key for s in summaries for key in s.metrics}, key=lambda k: (not k.startswith("pass@"), k)
    )
    header = ["setting", *columns]
    rows = [
        [s.name, *(f"{s.metrics[c]:.4f}" if c in s.metrics else "-" for c in columns)]
        for s in summaries
    ]
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    line = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths, strict=True))  # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths]), *(line(r) for r in rows)])


def write_reports(summaries: Sequence[Summary], directory: str | Path) -> dict[str, Path]:
    """results.json (everything, with breakdowns) and results.csv (one row per setting and group)."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    json_path, csv_path = out / "results.json", out / "results.csv"
    json_path.write_text(json.dumps([s.__dict__ for s in summaries], indent=2))
    with open(csv_path, "w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(["setting", "group", "metric", "value"])
        for s in summaries:
            for metric, value in s.metrics.items():
                writer.writerow([s.name, "all", metric, value])
            for group, values in s.breakdown.items():
                for metric, value in values.items():
                    writer.writerow([s.name, group, metric, value])
    return {"json": json_path, "csv": csv_path}


def log_to_mlflow(summaries: Sequence[Summary], logger: Any, files: Sequence[Path] = ()) -> None:
    """Metrics as `<setting>/<metric>` on the logger's run, report files as artifacts."""
    metrics = {}
    for s in summaries:
        for metric, value in s.metrics.items():
            metrics[
                f"{s.name}/{metric}".replace("@", "_at_").replace("(", "_").replace(")", "")
            ] = value
    logger.log_metrics(metrics, step=0)
    for path in files:
        logger.experiment.log_artifact(logger.run_id, str(path))
