class UserError(Exception):
    """A problem with the user's input or settings: the CLI prints it as one line, without a traceback."""
