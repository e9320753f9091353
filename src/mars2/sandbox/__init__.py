"""Running untrusted code: sandboxes (local process pool, E2B) and the grader that turns executions
into per-test verdicts.

Laid out by trust boundary: `verdict/` decides (judge, comparison, extraction, the grader) and
never runs an answer; `runner/` runs answers (the harness and the executor that forks them);
`container/` builds the boundary around the runner (bubblewrap, libseccomp); `pool/` starts and
drives workers (local, E2B). `base` is the interface, `protocol` what pool, worker and executor
say to each other, `records` the grades the search keeps.

Kept import-light on purpose: sandbox workers and executors import this package in a clean
interpreter.
"""
