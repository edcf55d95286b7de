class UserError(Exception):
    """A problem with the user's input or settings: the CLI prints it as one line, without a traceback."""


class DiskFull(UserError):
    """A write that found no space left on its device (app/utils.atomic_open names the file)."""
