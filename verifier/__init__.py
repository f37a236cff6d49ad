"""The verifier service: graded trajectories, signed verdicts, a tamper-evident log (``primerl verifier``).

Layout::

    statement.py  Trajectory (canonical encoding, SHA-256 subject), Verdict -> in-toto Statement v1
    signing.py    DSSE envelopes (PAE, Ed25519) and C2SP tlog-checkpoint signed notes
    keys.py       key directory, key ids, rotation
    merkle.py     RFC 6962 tree, inclusion / consistency proofs and their RFC 9162 verification
    store.py      SQLite / PostgreSQL rows; one transaction per batch (entries + checkpoint)
    log.py        TransparencyLog: append, checkpoint, proofs, entries, keys
    service.py    Verifier: grade (threads, per-item deadline), group-commit appender
    sandboxed.py  untrusted (entry-point function) graders run in the sandbox under their declared policy
    bridge.py     score by episode id: EndEpisode on the --bridge
    app.py        HTTP JSON surface (Starlette)
    grpc_app.py   gRPC surface (primerl.v1.Verifier: Score, ScoreBatch; health, reflection)
    verify.py     offline checks (entry + proof + checkpoint, consistency, audit)
    config.py     VerifierConfig
    cli.py        primerl verifier serve | verify | audit | rotate-key

Importing this package imports neither Starlette, uvicorn nor psycopg (``app`` and ``store`` do, lazily).
"""

from verifier.config import VerifierConfig
from verifier.statement import Trajectory, VerdictSample

__all__ = ["Trajectory", "VerdictSample", "VerifierConfig"]
