"""Evaluation: pass@k estimators, Pass@1 / Pass@1(MCTS) / Pass@N runs and tree visualisation."""
