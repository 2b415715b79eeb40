"""Errors meant for people: each says what was wrong and what to do about it."""


class UserFacingError(Exception):
    """Base class: the CLI prints the message without a traceback."""


class CheckpointError(UserFacingError):
    """A checkpoint directory is missing, incomplete, corrupt or unsupported."""


class ConfigError(CheckpointError):
    """A config.json field is unsupported or inconsistent; the message names the field."""


class RequestError(UserFacingError, ValueError):
    """A request (prompt, sampling parameters) is invalid."""
