"""Every public exception of hotswap.engine; bad input is a ValueError (docs/api.md#errors)."""

from __future__ import annotations

from hotswap.weight_sync.group import WeightSyncError

__all__ = ["DownloadError", "FetchError", "RemoteEngineError", "WeightSyncError",
           "WeightsIncompleteError", "WorkerDiedError"]


class WeightsIncompleteError(RuntimeError):
    """Generation refused: an update failed after it had started overwriting weights."""


class WorkerDiedError(RuntimeError):
    """A tensor-parallel worker process died: the engine refuses work until it is restarted."""


class RemoteEngineError(RuntimeError):
    """A server answered with an error other than bad input (400) or a refused key (401)."""

    def __init__(self, status: int, message: str):
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


class FetchError(RuntimeError):
    """Provisioning the model failed; the message says what failed and what to do."""


class DownloadError(FetchError):
    """The GGUF could not be obtained (no PyPI access, or a bad package)."""
