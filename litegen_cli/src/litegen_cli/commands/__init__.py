"""The `litegen` commands, one module each: it defines the command's function (a group, its
Typer) and nothing else; `litegen_cli.app` registers them, one line per command.

A command parses its options, calls the shared functions (preflight.py, launch_run.py, the
module of its concern) and turns their errors into short messages. It imports torch only
inside its function, so `litegen --help` stays fast.
"""
