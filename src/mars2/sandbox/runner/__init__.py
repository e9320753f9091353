"""Running answers: the harness (inside an answer's process) and the executor that forks them.

Everything here runs inside the container and never sees an expected output.
"""
