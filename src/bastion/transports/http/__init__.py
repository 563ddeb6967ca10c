"""Streamable HTTP serving and the built-in OAuth 2.1 authorization server for one administrator.

Modules: app (assembly), provider (registration policy, transactions, tokens), store (SQLite),
flow (authorize, login, consent), endpoints (token, revoke, register, metadata), scopes (401/403 and
tool filtering), pages and admin_pages (HTML), password (argon2id), ratelimit, redirects, admin_cli.
Nothing is imported here, so `bastion admin ...` starts without loading the web stack.
"""

# Nothing is exported here: other packages import from the public modules.
__all__: list[str] = []
