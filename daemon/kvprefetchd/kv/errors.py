"""The kv package's errors: every one carries a message that names the field at fault."""

from __future__ import annotations


class KVError(ValueError):
    """Base of every error the kv package raises on purpose.

    `code` is the protocol error code the supervisor should answer with.
    """

    code = "bad_request"

    def __init__(self, message: str, *, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code


class KVRequestError(KVError):
    """A KV request (or its inline profile) that cannot be served as sent."""


class ProfileError(KVRequestError):
    """A model profile (configured `[models.NAME]` table or inline hash/layout) that is invalid."""


class DiscoveryError(KVError):
    """The fingerprint folder could not be chosen on disk: none, or more than one, matches."""
