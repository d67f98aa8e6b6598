"""The shardflow command line: each subcommand parses its flags and calls a stage, a task or a flow."""
