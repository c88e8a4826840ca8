"""The one base class for hetu_ext's own failures (user input errors are ValueError / TypeError)."""


class HetuExtError(Exception):
    """A failure of hetu_ext itself or of the host it runs in, not of the user's input."""
