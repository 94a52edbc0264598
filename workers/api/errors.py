"""The one error hierarchy of the wire protocol: each ``ApiError`` carries its HTTP status and
OpenAI error type, and says whether the client or a worker is at fault. Imports no torch."""

from __future__ import annotations

from typing import Any, ClassVar


class ApiError(Exception):
    status: ClassVar[int] = 500
    error_type: ClassVar[str] = "server_error"
    client_fault: ClassVar[bool] = False

    def __init__(self, message: str, param: str | None = None, code: str | None = None,
                 retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.error_type, "param": self.param,
                          "code": self.code}}


class BadRequest(ApiError):
    status, error_type, client_fault = 400, "invalid_request_error", True


class NotFound(ApiError):
    status, error_type, client_fault = 404, "invalid_request_error", True


class MethodNotAllowed(ApiError):
    status, error_type, client_fault = 405, "invalid_request_error", True


class PayloadTooLarge(ApiError):
    status, error_type, client_fault = 413, "invalid_request_error", True


class Overloaded(ApiError):
    """Too many requests queued: retry later (Retry-After says when)."""

    status, error_type, client_fault = 429, "rate_limit_error", False


class Unavailable(ApiError):
    """No worker can take the request now."""

    status, error_type, client_fault = 503, "server_error", False


class WorkerFailed(ApiError):
    status, error_type, client_fault = 502, "server_error", False


class WorkerTimeout(ApiError):
    status, error_type, client_fault = 504, "server_error", False


class RequestTimeout(ApiError):
    """The request body did not arrive in time (the connection is closed after the answer)."""

    status, error_type, client_fault = 408, "invalid_request_error", True


class HeadersTooLarge(ApiError):
    status, error_type, client_fault = 431, "invalid_request_error", True


class ClientDisconnected(ApiError):
    """The client went away before its answer was complete; nobody reads this error.

    Counted under nginx's 499 ("client closed request") and logged at INFO: a client that
    leaves is not a server error.
    """

    status, error_type, client_fault = 499, "invalid_request_error", True
