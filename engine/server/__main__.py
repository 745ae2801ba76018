"""`python -m hotswap.engine.server`: serve an Engine over HTTP."""

from hotswap.engine.server.app import main

main()
