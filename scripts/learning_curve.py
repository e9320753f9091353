"""Alias of `mars2-study run` + `report` on configs/study/team_vs_alone.yaml (docs/study.md)."""
from mars2.study.cli import legacy_main
legacy_main()
