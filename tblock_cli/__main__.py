"""Entry point for `python -m tblock_cli` and the `tblock` script: SIGINT handled before the first import."""

from tblock_cli.errors import on_interrupt


def main():
    on_interrupt()
    from tblock_cli.cli import main as cli_main

    cli_main()


if __name__ == "__main__":
    main()
