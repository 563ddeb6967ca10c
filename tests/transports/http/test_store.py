"""The OAuth store on a real SQLite file: what a grant keeps as its refresh tokens rotate."""

from __future__ import annotations

from pathlib import Path

from bastion.transports.http.store import KEPT_USED_REFRESH_TOKENS, AuthStore


def test_a_grant_keeps_only_its_newest_used_refresh_tokens(tmp_path: Path) -> None:
    """Attack: an approved client rotates its refresh token over and over (slowed to 60 a minute at /token,
    still 86,400 a day). Each used token stayed in the database for the token's whole lifetime, about 330
    bytes each. Invariant: a grant keeps its KEPT_USED_REFRESH_TOKENS newest used tokens and its live
    one; the newest used one is still known (its reuse is caught), the oldest are gone."""
    store = AuthStore(tmp_path / "bastion.db")
    try:
        store.add_client("looping", {"redirect_uris": ["http://127.0.0.1/cb"]}, None, "::1")
        code = store.create_grant_with_code(
            client_id="looping",
            scopes=("workbench",),
            resource="http://127.0.0.1:8765/mcp",
            redirect_uri="http://127.0.0.1/cb",
            code_challenge="x" * 43,
            code_lifetime_s=60,
            grant_lifetime_s=86_400,
        )
        issued = store.consume_code_and_issue(code, access_lifetime_s=3600, refresh_lifetime_s=86_400)
        assert issued is not None
        spent = [issued.refresh_token]
        for _ in range(KEPT_USED_REFRESH_TOKENS + 40):
            issued = store.rotate_refresh(
                issued.refresh_token, ("workbench",), access_lifetime_s=3600, refresh_lifetime_s=86_400
            )
            assert issued is not None
            spent.append(issued.refresh_token)
        live = spent.pop()
        rows = store._db.execute("SELECT count(*) FROM oauth_tokens WHERE kind = 'refresh'").fetchone()[0]
        assert rows == KEPT_USED_REFRESH_TOKENS + 1
        newest = store.token(spent[-1], "refresh")
        assert newest is not None
        assert newest.used_at is not None
        assert store.token(spent[0], "refresh") is None
        assert store.token(live, "refresh") is not None
        assert store.grant_of_token(spent[0]) is None
    finally:
        store.close()
