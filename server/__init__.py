"""The gRPC bridge server: RPC handlers, episode store, admission, errors, CLI ``primerl``.

Library packages never import ``server`` (import-linter contracts in pyproject.toml); the error tree they
raise is ``core.errors``, and ``server.errors`` maps it to gRPC status codes.
"""
