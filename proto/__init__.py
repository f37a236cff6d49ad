"""The wire contract: ``primerl/v1/*.proto`` (PrimeRL, Control, Verifier) and their committed generated stubs.

``make gen-proto`` regenerates the stubs; ``make check-proto`` fails on stale ones. Imports nothing of ours.
"""
