"""Bad input: the one exception the scripts raise for it, printed as one line, no traceback."""


class UserError(SystemExit):
    """Wrong input or environment that the user can fix.

    A SystemExit subclass, so an uncaught one prints only ``error: <message>`` on stderr and
    exits with status 1; the message says what was wrong and what to do, in one line.
    """

    def __init__(self, message: str):
        super().__init__(f"error: {message}")
        self.message = message


def first_line(error: BaseException) -> str:
    """An exception as one line for a message: its type and the first line of its text."""
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0] if text else ''}".rstrip(": ")
