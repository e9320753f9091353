"""Deciding verdicts: the judge, output comparison, code extraction and the grader service.

Nothing here runs an answer; the judge reads the raw records an answer's process reported.
"""
