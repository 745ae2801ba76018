"""RemoteEngine: the Engine's methods over HTTP."""
