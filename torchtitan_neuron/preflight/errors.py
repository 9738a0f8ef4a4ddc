"""What every preflight check raises, and the exit code it ends with."""

EXIT_USAGE = 2


class PreflightError(Exception):
    """A run that cannot work, with what to change."""
