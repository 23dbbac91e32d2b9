"""The one exception family that carries a user's mistake to the CLI edge as an exit code."""


class TBlockError(Exception):
    """A problem the user can fix; `cli.py` prints its message on one line and exits `exit_code`."""

    exit_code = 2


class ConfigError(TBlockError):
    """A flag value that cannot build or run a block (bad size, unknown dtype, missing device)."""


class ResourceError(TBlockError):
    """The requested sizes would not fit in the memory the device has free."""


class LoadError(TBlockError):
    """A --block SPEC that cannot be imported, built or called."""
