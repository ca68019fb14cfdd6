"""Helpers the tests share, by concern; tests/conftest.py holds the fixtures and pytest hooks."""
