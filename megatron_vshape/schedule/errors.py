"""The one exception type for user configuration mistakes."""


class ConfigError(ValueError):
    """A configuration the user can fix; the message names the values and the fix.

    Raised at validation time (argument parsing, schedule generation, model
    construction), never from inside a collective.
    """
