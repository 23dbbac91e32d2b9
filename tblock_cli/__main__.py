"""Entry point for `python -m tblock_cli`."""

from tblock_cli.cli import main

main()
