"""Helpers shared by the tests and their subprocess workers (tests/ is on sys.path)."""
