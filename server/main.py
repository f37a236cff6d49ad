"""``python -m server.main [FLAGS]``: the quick start's name for ``primerl serve [FLAGS]``.

``PYTHONPATH=. python -m server.main --engine toy`` runs the bridge from a source checkout; every flag,
``@ FILE.toml`` and ``--dry-run`` of ``primerl serve`` works here too.
"""

from __future__ import annotations

import sys

from server.cli import main

if __name__ == "__main__":
    sys.exit(main(["serve", *sys.argv[1:]]))
