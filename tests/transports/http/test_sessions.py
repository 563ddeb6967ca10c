"""What bastion's checks read of a POST body to /mcp (`body_facts`): parsed once, as the SDK parses it."""

from __future__ import annotations

from typing import Any

import pydantic_core

from bastion.transports.http.sessions import BodyFacts, body_facts
from tests.helpers import least_cpu_s


def test_a_huge_body_is_parsed_once_for_every_check_of_its_request() -> None:
    """Found by review: the session's id check parsed each POST on a session with `json.loads`: 125 ms of the event
    loop for a 4 MiB array of zeros, beside the scope check's own `json.loads` of a tools/call and the SDK's parse.
    Invariant: every check of one request shares one parse, at the SDK parser's cost (52 ms for that body), keeping
    only what the checks need; a new body is parsed anew."""
    body = b'{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"name":"x","a":[' + b"0," * (2 << 20) + b"0]}}"
    scope: dict[str, Any] = {}
    assert body_facts(scope, body) == BodyFacts(True, "7", ("x",))
    assert body_facts(scope, b'{"jsonrpc":"2.0","id":"8","method":"ping"}') == BodyFacts(True, "8", ())

    def three_checks() -> None:
        fresh: dict[str, Any] = {}
        for _ in range(3):
            body_facts(fresh, body)

    assert least_cpu_s(three_checks) < 1.5 * least_cpu_s(lambda: pydantic_core.from_json(body)) + 0.005


def test_the_facts_are_those_the_sdk_keys_by() -> None:
    cases = {
        b'{"jsonrpc":"2.0","id":7,"method":"ping"}': BodyFacts(True, "7", ()),
        b'{"jsonrpc":"2.0","\\u0069d":7,"id":9,"method":"ping"}': BodyFacts(True, "9", ()),  # the last key wins
        b'{"jsonrpc":"2.0","id":7.0,"method":"ping"}': BodyFacts(True, None, ()),  # a notification to the SDK
        b'{"jsonrpc":"2.0","id":true,"method":"ping"}': BodyFacts(True, None, ()),
        b'{"jsonrpc":"2.0","id":7,"result":{}}': BodyFacts(True, None, ()),  # a response
        b'[{"method":"tools/call","params":{"name":"a"}},{"method":"tools/call"}]': BodyFacts(True, None, ("a", "")),
        b"{bad": BodyFacts(False, None, ()),
        b"[" * 100_000 + b"]" * 100_000: BodyFacts(False, None, ()),
    }
    for body, facts in cases.items():
        assert body_facts({}, body) == facts, body[:60]
