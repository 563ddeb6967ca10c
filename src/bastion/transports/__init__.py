"""The transports: stdio and Streamable HTTP (with its OAuth 2.1 authorization server)."""

# Nothing is exported here: other packages import from the public modules.
__all__: list[str] = []
