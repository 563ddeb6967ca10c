"""Standard-library-only code that runs inside a sandbox (it sees no site-packages), shipped as source."""
