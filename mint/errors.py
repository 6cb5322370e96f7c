"""The one root error type of the `mint` package.

Errors cross Ray boundaries, so every subclass must pickle: keep constructor arguments equal to `args`.
"""


class MintError(Exception):
    """Root of every error Mint raises on purpose. Its message is one line meant for the user."""


class ConfigError(MintError):
    """A recipe or override is invalid: unknown key, wrong type, or value out of range."""


class DataError(MintError):
    """A dataset cannot be read, or a record lacks a required field."""


class RewardError(MintError):
    """A reward function cannot be resolved by name."""
