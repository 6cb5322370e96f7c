"""The one root error type of the `longstraw` package (picklable: constructor arguments equal `args`)."""


class LongStrawError(Exception):
    """Root of every error LongStraw raises on purpose."""
