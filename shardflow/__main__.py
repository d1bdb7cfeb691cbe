"""`python -m shardflow`: the same as the `shardflow` command."""

from shardflow.cli import main

main()
