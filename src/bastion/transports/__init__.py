"""The transports: stdio and Streamable HTTP (with its OAuth 2.1 authorization server)."""
