"""Signed control messages: an HMAC-SHA256 on each event, plan and spec of a job (docs/security.md).

One shared secret per job signs what the daemon publishes (the plan and spec keys) and what the
workers send (their events); each side verifies what it reads and refuses what is unsigned or
forged. A `Keyring` holds the current secret, which signs, and optionally the previous one, which
still verifies: rotation is a restart of each process with both, then one with the new secret
alone (docs/security.md, Rotation).

A signature is `{key id}.{hex HMAC}`. The key id names the secret without revealing it (the first
8 hex digits of a SHA-256 of it), so a verifier picks the right one of its two keys and a message
signed with a key it does not hold is told apart from a forged one. The MAC covers the job name
and the kind of message, so a signed event of one job is no event of another and a signed spec is
no plan.

Events are flat fields: the MAC covers every field but `sig`, sorted, length-prefixed (so no two
field sets share an encoding). Plans and specs are JSON objects with a `sig` member: the MAC
covers the object without it, serialised canonically (sorted keys, no spaces).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

# Environment variables (names, not secrets): the current secret itself; the previous one, accepted
# during a rotation; a file holding the current secret, then optionally the previous one.
SECRET_ENV = "CHAMELEON_SECRET"  # noqa: S105 - a variable's name
SECRET_PREVIOUS_ENV = "CHAMELEON_SECRET_PREVIOUS"  # noqa: S105 - a variable's name
SECRET_FILE_ENV = "CHAMELEON_SECRET_FILE"  # noqa: S105 - a variable's name
SIG_FIELD = "sig"
MIN_SECRET_LEN = 16


class AuthError(ValueError):
    """No usable secret (a bad file, one too short), or a message that does not verify."""


def key_id(secret: bytes) -> str:
    return hashlib.sha256(b"chameleon-key-id\0" + secret).hexdigest()[:8]


@dataclass(frozen=True)
class Keyring:
    """The secrets of a job: the first signs, every one verifies."""

    secrets: tuple[bytes, ...]

    def __post_init__(self) -> None:
        if not self.secrets:
            raise AuthError("a keyring needs a secret")
        for s in self.secrets:
            if len(s) < MIN_SECRET_LEN:
                raise AuthError(f"a secret must be at least {MIN_SECRET_LEN} bytes long")

    def __repr__(self) -> str:  # never the secrets themselves
        return f"Keyring(ids={self.ids})"

    @cached_property
    def ids(self) -> tuple[str, ...]:
        return tuple(key_id(s) for s in self.secrets)

    @cached_property
    def _by_id(self) -> dict[str, bytes]:
        """The secrets by key id (the first of two with one id)."""
        return dict(reversed(list(zip(self.ids, self.secrets, strict=True))))

    @staticmethod
    def _mac(secret: bytes, payload: bytes) -> str:
        return hmac.digest(secret, payload, "sha256").hex()

    def sign(self, payload: bytes) -> str:
        return f"{self.ids[0]}.{self._mac(self.secrets[0], payload)}"

    def verify(self, payload: bytes, sig: str) -> None:
        """Raises AuthError(reason) unless `sig` is a signature of `payload` by one of the keys."""
        if not sig:
            raise AuthError("unsigned")
        kid, _, mac = sig.partition(".")
        secret = self._by_id.get(kid)
        if secret is None:
            raise AuthError(f"signed with an unknown key ({kid[:8]!r}; this one holds {self.ids})")
        if not hmac.compare_digest(self._mac(secret, payload), mac):
            raise AuthError(f"bad signature (key {kid[:8]})")

    # ---- events: flat fields -------------------------------------------------------------------

    def sign_event(self, job: str, fields: Mapping[Any, Any]) -> dict[str, str]:
        """`fields` (str values) with their `sig` added."""
        out = {str(k): str(v) for k, v in fields.items() if str(k) != SIG_FIELD}
        return {**out, SIG_FIELD: self.sign(event_payload(job, out))}

    def verify_event(self, job: str, fields: Mapping[Any, Any]) -> None:
        raw = fields.get(SIG_FIELD.encode(), fields.get(SIG_FIELD, b""))
        sig = raw.decode("ascii", "replace") if isinstance(raw, bytes) else str(raw)
        self.verify(event_payload(job, fields), sig)

    # ---- documents: plans, specs ---------------------------------------------------------------

    def verify_doc(self, kind: str, job: str, doc: Mapping[str, Any]) -> None:
        sig = doc.get(SIG_FIELD)
        body = {k: v for k, v in doc.items() if k != SIG_FIELD}
        self.verify(doc_payload(kind, job, body), sig if isinstance(sig, str) else "")

    # ---- where the secret comes from -----------------------------------------------------------

    @classmethod
    def from_file(cls, path: str | Path) -> Keyring:
        """A secret file: the current secret on its first line, optionally the previous one on
        the second (blank lines and lines starting with # are skipped)."""
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise AuthError(f"secret file {path}: {type(e).__name__}: {e.args[-1]}") from None
        lines = [x.strip() for x in text.splitlines()]
        found = [x.encode() for x in lines if x and not x.startswith("#")]
        if not found:
            raise AuthError(f"secret file {path}: no secret in it")
        if len(found) > 2:
            raise AuthError(f"secret file {path}: at most two secrets (current, previous)")
        try:
            return cls(tuple(found))
        except AuthError as e:
            raise AuthError(f"secret file {path}: {e}") from None

    @classmethod
    def configured(cls, env: Mapping[str, str], secret_file: str = "") -> Keyring | None:
        """The keyring from `secret_file` (a flag), else $CHAMELEON_SECRET_FILE, else
        $CHAMELEON_SECRET (+ $CHAMELEON_SECRET_PREVIOUS); None when none is set."""
        path = secret_file or env.get(SECRET_FILE_ENV, "")
        if path:
            return cls.from_file(path)
        current = env.get(SECRET_ENV, "")
        if not current:
            return None
        previous = env.get(SECRET_PREVIOUS_ENV, "")
        try:
            return cls((current.encode(), *([previous.encode()] if previous else [])))
        except AuthError as e:
            raise AuthError(f"${SECRET_ENV}: {e}") from None


def event_payload(job: str, fields: Mapping[Any, Any]) -> bytes:
    items = [
        (k if isinstance(k, bytes) else _bytes(k), v if isinstance(v, bytes) else _bytes(v))
        for k, v in fields.items()
    ]
    items.sort()
    fields_text = [b"%d:%b\0%d:%b" % (len(k), k, len(v), v) for k, v in items if k != _SIG]
    return b"\0".join([b"chameleon-event", job.encode(), *fields_text])


_SIG = SIG_FIELD.encode()


def doc_payload(kind: str, job: str, body: Mapping[str, Any]) -> bytes:
    return _payload_of_text(kind, job, _canonical(body))


def _canonical(body: Mapping[str, Any]) -> str:
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def _payload_of_text(kind: str, job: str, text: str) -> bytes:
    return b"\0".join([b"chameleon-" + kind.encode(), job.encode(), text.encode()])


def _bytes(x: Any) -> bytes:
    return x if isinstance(x, bytes) else str(x).encode("utf-8", "surrogatepass")


class JsonText(str):
    """A top-level member of a document given to `signed_json` already as its canonical text
    (`canonical`): put in verbatim, not serialised again. A member that is the same object from
    one document to the next (the current plan in every snapshot) is serialised once."""


def canonical(value: Any) -> JsonText:
    """`value` as canonical JSON text (sorted keys, no spaces, ASCII): the text signatures are
    made over."""
    return JsonText(_canonical(value))


def signed_json(keyring: Keyring | None, kind: str, job: str, doc: Mapping[str, Any]) -> str:
    """`doc` as the JSON text stored under its key: with its signature when there is a keyring.
    The text signed (sorted keys) is the text stored, the signature added as its last member: a
    large document (a job's snapshot is megabytes) is serialised once, and its JsonText members
    not at all."""
    if not any(isinstance(v, JsonText) for v in doc.values()):
        return signed_document(keyring, kind, job, doc)[0]
    members = sorted((k, v) for k, v in doc.items() if k != SIG_FIELD)
    text = "{" + ",".join(
        f"{json.dumps(k)}:{v if isinstance(v, JsonText) else _canonical(v)}" for k, v in members
    ) + "}"  # fmt: skip
    return text if keyring is None else _with_signature(keyring, kind, job, text)


def _with_signature(keyring: Keyring, kind: str, job: str, text: str) -> str:
    """The canonical text of a non-empty JSON object with its signature as its last member."""
    return _appended(text, keyring.sign(_payload_of_text(kind, job, text)))


def _appended(text: str, sig: str) -> str:
    return f'{text[:-1]}{"," if text != "{}" else ""}"{SIG_FIELD}":{json.dumps(sig)}}}'


def signed_canonical(
    keyring: Keyring | None, kind: str, job: str, body: Mapping[str, Any], text: str
) -> tuple[str, dict[str, Any]]:
    """`signed_document` of `body` whose canonical text (`canonical(body)`) is `text`, already
    made: the text stored, and the document a reader parses from it."""
    if keyring is None:
        return text, dict(body)
    sig = keyring.sign(_payload_of_text(kind, job, text))
    return _appended(text, sig), {**body, SIG_FIELD: sig}


def signed_document(
    keyring: Keyring | None, kind: str, job: str, doc: Mapping[str, Any]
) -> tuple[str, dict[str, Any]]:
    """`doc` as `signed_json` stores it, and as a reader parses that text back."""
    body = {k: v for k, v in doc.items() if k != SIG_FIELD}
    if keyring is None:
        return json.dumps(body, separators=(",", ":")), body
    return signed_canonical(keyring, kind, job, body, _canonical(body))


def new_secret_file(path: Path) -> Path:
    """Write a fresh random secret to `path` (mode 0600) unless it holds one already."""
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:  # written by a process beside this one
        return path
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32) + "\n")
    return path
