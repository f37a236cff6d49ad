"""Connectors the environments use: read-only SQL (SQLite, PostgreSQL), SSRF-safe HTTP, a headless browser.

The code sandbox is its own package, ``sandbox/``.
"""
