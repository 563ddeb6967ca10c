"""The OAuth store on a real SQLite file: what a grant keeps as its refresh tokens rotate."""

from __future__ import annotations

from pathlib import Path

from bastion.transports.http.store import IDS_PER_QUERY, KEPT_USED_REFRESH_TOKENS, AuthStore


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


def test_a_revoked_or_expired_grant_is_not_live_among_more_ids_than_one_query_takes(tmp_path: Path) -> None:
    """The server ends the MCP sessions of grants `live_grants` leaves out. Invariant: of more grant ids
    than one statement takes (IDS_PER_QUERY), a revoked one, an expired one and an unknown one are left out
    and every other is kept, whichever statement it falls in."""
    store = AuthStore(tmp_path / "bastion.db")
    try:
        grants = [
            store.issue_admin_token(client_id=f"cli:{n}", scopes=("workbench",), resource="r", lifetime_s=3600)[1]
            for n in range(IDS_PER_QUERY + 20)
        ]
        revoked, expired = grants[3], grants[IDS_PER_QUERY + 5]
        assert store.revoke_grant(revoked, "test")
        store._db.execute("UPDATE oauth_grants SET expires_at = 0 WHERE grant_id = ?", (expired,))
        live = store.live_grants([*grants, "no-such-grant"])
        assert live == set(grants) - {revoked, expired}
        assert store.live_grants([]) == set()
    finally:
        store.close()
