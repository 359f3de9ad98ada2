"""Errors that reach the user as one line (see `melt_eval.cli.main`)."""


class UserError(Exception):
    """Bad input from the user: the message says what was wrong and what to do."""


class SettingsChanged(UserError):
    """A results directory holds a run made with other settings; `changed` names them."""

    def __init__(self, message: str, changed: list[str]) -> None:
        super().__init__(message)
        self.changed = changed
