# Alias: `mars2-study run` + `report` on configs/study/team_vs_alone.yaml (docs/study.md).
__import__("mars2.study.cli", fromlist=["legacy_main"]).legacy_main()
