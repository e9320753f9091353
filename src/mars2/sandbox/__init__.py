"""Running untrusted code: sandboxes (local process pool, E2B) and the grader that turns executions into per-test verdicts.

Kept import-light on purpose: sandbox workers import this package in a clean interpreter.
"""
