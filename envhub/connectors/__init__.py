"""Connectors: read-only SQL, code sandbox, SSRF-safe HTTP, headless browser, OpenEnv client."""
