"""The entry layer: the `shardflow` command and the all-in-one `dev` process.

It sits above everything it starts (the orchestrator core, the router, the workers); nothing
under those packages imports it.
"""
