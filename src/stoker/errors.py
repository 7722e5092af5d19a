"""The exceptions stoker raises for people: what was given, what was expected, the fix."""

from __future__ import annotations


class StokerError(Exception):
    """Base of every user-facing stoker error.

    The CLI prints ``str(error)`` (and the hint) without a traceback unless ``--debug``
    is given, and exits with ``exit_code``.
    """

    exit_code = 1

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        if self.hint:
            return f"{self.message}\n  fix: {self.hint}"
        return self.message


class ConfigError(StokerError):
    """The run config (file, overrides or keyword options) is invalid."""

    exit_code = 2


class DataError(StokerError):
    """A dataset, a sample or a batch is missing, malformed or does not fit the model."""


class CheckpointError(StokerError):
    """A checkpoint cannot be written, found, verified or loaded safely."""


class ModelError(StokerError):
    """The user's model failed in its forward: which module, on what input, and the fix.

    ``module`` is the failing module's qualified name (``model.encoder.0``), or None when
    it could not be found; ``field``, ``expected`` and ``got`` name the first setting of
    that module the input does not fit (``in_features``, 20, 64), so a caller that knows
    the run config can point the hint at the config key holding it.
    """

    def __init__(
        self,
        message: str,
        *,
        hint: str | None = None,
        module: str | None = None,
        field: str | None = None,
        expected: object = None,
        got: object = None,
    ) -> None:
        super().__init__(message, hint=hint)
        self.module = module
        self.field = field
        self.expected = expected
        self.got = got


class TrainingError(StokerError):
    """Training cannot continue (a non-finite loss, a diverged run)."""


class CallbackError(StokerError):
    """A user's callback raised: the run stopped, naming the callback and its hook."""


class TrainingInterrupted(StokerError):
    """A stop signal (SIGTERM, SIGINT) ended training after a checkpoint was saved."""

    exit_code = 130
