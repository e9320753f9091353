"""Running untrusted code: sandboxes (local process pool, E2B) and the grader that turns executions into per-test verdicts."""
