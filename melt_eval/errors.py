"""Errors that reach the user as one line (see `melt_eval.cli.main`)."""


class UserError(Exception):
    """Bad input from the user: the message says what was wrong and what to do."""
