"""Evaluation results as a console table, JSON and CSV files, and MLflow metrics."""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mars2.eval.runner import Summary
from mars2.utils.atomic import atomic_write_text
from mars2.utils.tracking import metric_key


def table(summaries: Sequence[Summary], caption: str | None = None) -> str:
    """A plain-text table: one row per evaluated setting, one column per metric, under a
    `caption` saying what the numbers are of (problems, n, node budget)."""
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
    lines = [line(header), line(["-" * w for w in widths]), *(line(r) for r in rows)]
    return "\n".join([caption, *lines] if caption else lines)


def write_reports(
    summaries: Sequence[Summary], directory: str | Path, run: dict[str, Any] | None = None
) -> dict[str, Path]:
    """results.json (``{"run": what was evaluated, "settings": every setting's summary with
    breakdowns}``) and results.csv (one row per setting and group). `run` holds the weights, the
    dataset, the budget and the seed."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    json_path, csv_path = out / "results.json", out / "results.csv"
    report = {"run": dict(run or {}), "settings": [s.__dict__ for s in summaries]}
    atomic_write_text(json_path, json.dumps(report, indent=2, default=str))
    buffer = io.StringIO(newline="")
    writer = csv.writer(buffer)
    writer.writerow(["setting", "group", "metric", "value"])
    for s in summaries:
        for metric, value in s.metrics.items():
            writer.writerow([s.name, "all", metric, value])
        for group, values in s.breakdown.items():
            for metric, value in values.items():
                writer.writerow([s.name, group, metric, value])
    atomic_write_text(csv_path, buffer.getvalue())
    return {"json": json_path, "csv": csv_path}


def read_results(path: str | Path) -> list[dict[str, Any]]:
    """The settings' summaries of a results.json (also of the older form, a bare list)."""
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    return list(data["settings"] if isinstance(data, dict) else data)


def log_to_mlflow(summaries: Sequence[Summary], logger: Any, files: Sequence[Path] = ()) -> None:
    """Metrics as `<setting>/<metric>` in names MLflow accepts as they are
    (`team+tree/pass@1(mcts)` -> `team_tree/pass_at_1_mcts`), report files as artifacts."""
    metrics = {metric_key(f"{s.name}/{m}"): v for s in summaries for m, v in s.metrics.items()}
    logger.log_metrics(metrics, step=0)
    if not hasattr(logger, "run_id"):  # TensorBoard, W&B, CSV: the files stay in the run folder
        return
    for path in files:
        logger.experiment.log_artifact(logger.run_id, str(path))
