"""Standard-library-only code that runs inside a sandbox (it sees no site-packages), shipped as source."""

# Nothing is exported here: other packages import from the public modules.
__all__: list[str] = []
