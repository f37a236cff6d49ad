"""The gRPC bridge server: RPC handlers, episode store, admission, errors, CLI ``primerl``.

Kept import-light on purpose: ``server.errors`` is imported by every other package.
"""
