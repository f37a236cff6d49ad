"""HTTP session ids travel back in the X-Session-ID response header, so only printable ASCII ids are accepted
(schemathesis found a printable non-ASCII id that created a session and then failed its response with a 500)."""

from __future__ import annotations

import pytest

from core.errors import InvalidArgument
from server.http.sessions import MAX_ID_LENGTH, SessionRegistry


@pytest.mark.parametrize("bad", ["", "sess-\u00ee", "\u4f1a\u8bdd", "a\nb", "x" * (MAX_ID_LENGTH + 1)])
def test_ids_that_a_header_cannot_carry_are_refused(bad: str) -> None:
    with pytest.raises(InvalidArgument, match="printable ASCII characters"):
        SessionRegistry.check_id(bad)


def test_printable_ascii_ids_are_accepted() -> None:
    SessionRegistry.check_id("sess-0123_abc.DEF:~")
    SessionRegistry.check_id("x" * MAX_ID_LENGTH)
