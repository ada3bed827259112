"""chameleond.auth: what verifies and what does not, where secrets come from, and rotation."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chameleond.auth import (
    SECRET_ENV,
    SECRET_FILE_ENV,
    SECRET_PREVIOUS_ENV,
    AuthError,
    Keyring,
    canonical,
    key_id,
    new_secret_file,
    signed_json,
)

A, B = b"a" * 32, b"b" * 32
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text() | st.floats(allow_nan=False),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(), kids, max_size=4),
    max_leaves=12,
)
EVENT = {"type": "fault", "worker": "w3", "cause": "ECC"}


def test_a_signed_event_verifies_and_any_change_breaks_it() -> None:
    ring = Keyring((A,))
    event = ring.sign_event("job", EVENT)
    ring.verify_event("job", event)
    ring.verify_event("job", {k.encode(): v.encode() for k, v in event.items()})  # as read
    for changed in (
        {**event, "worker": "w4"},
        {**event, "extra": "x"},
        {k: v for k, v in event.items() if k != "cause"},
        # Moving a byte between a key and its value is a different event too.
        {**{k: v for k, v in event.items() if k != "cause"}, "causeE": "CC"},
    ):
        with pytest.raises(AuthError, match="bad signature"):
            ring.verify_event("job", changed)
    with pytest.raises(AuthError, match="bad signature"):
        ring.verify_event("other-job", event)
    with pytest.raises(AuthError, match="unsigned"):
        ring.verify_event("job", EVENT)


def test_documents_are_bound_to_their_kind_and_job() -> None:
    ring = Keyring((A,))
    plan = json.loads(signed_json(ring, "plan", "job", {"generation": 3, "workers": ["w0"]}))
    ring.verify_doc("plan", "job", plan)
    for kind, job in (("spec", "job"), ("plan", "job2")):
        with pytest.raises(AuthError, match="bad signature"):
            ring.verify_doc(kind, job, plan)
    with pytest.raises(AuthError, match="bad signature"):
        ring.verify_doc("plan", "job", {**plan, "generation": 4})
    assert signed_json(None, "plan", "job", {"x": 1}) == '{"x":1}'


@settings(max_examples=100, deadline=None)
@given(st.dictionaries(st.text(min_size=1).filter(lambda k: k != "sig"), JSON, min_size=1),
       st.booleans())  # fmt: skip
def test_a_member_given_as_its_canonical_text_gives_the_same_document(
    doc: dict[str, Any], signed: bool
) -> None:
    """A snapshot's plan is serialised once per plan (`canonical`): the text stored is the
    text the whole document would have been, signature included."""
    ring = Keyring((A,)) if signed else None
    first = next(iter(doc))
    texted = {**doc, first: canonical(doc[first])}
    made = signed_json(ring, "state", "job", texted)
    if ring is not None:
        assert made == signed_json(ring, "state", "job", doc)
        ring.verify_doc("state", "job", json.loads(made))
    body = {k: v for k, v in json.loads(made).items() if k != "sig"}
    assert body == json.loads(signed_json(None, "state", "job", doc))


def test_rotation_the_previous_key_verifies_and_the_current_one_signs() -> None:
    old, rotated, new = Keyring((A,)), Keyring((B, A)), Keyring((B,))
    rotated.verify_event("j", old.sign_event("j", EVENT))
    assert rotated.sign_event("j", EVENT)["sig"].startswith(key_id(B) + ".")
    new.verify_event("j", rotated.sign_event("j", EVENT))
    with pytest.raises(AuthError, match="unknown key"):
        new.verify_event("j", old.sign_event("j", EVENT))


def test_secrets_come_from_a_file_or_the_environment(tmp_path: Path) -> None:
    f = tmp_path / "secret"
    f.write_text("# the job's secret\n" + B.decode() + "\n\n" + A.decode() + "\n")
    assert Keyring.configured({SECRET_FILE_ENV: str(f)}).ids == (key_id(B), key_id(A))  # type: ignore[union-attr]
    env = {SECRET_ENV: B.decode(), SECRET_PREVIOUS_ENV: A.decode()}
    assert Keyring.configured(env) == Keyring((B, A))
    assert Keyring.configured({}) is None
    with pytest.raises(AuthError, match="at least 16 bytes"):
        Keyring.configured({SECRET_ENV: "short"})
    f.write_text("\n")
    with pytest.raises(AuthError, match="no secret in it"):
        Keyring.from_file(f)
    with pytest.raises(AuthError, match=r"secret file .*missing"):
        Keyring.from_file(tmp_path / "missing")
    assert A.decode() not in repr(Keyring((A,)))


def test_a_generated_secret_file_is_private_and_kept(tmp_path: Path) -> None:
    path = new_secret_file(tmp_path / "state" / "secret")
    assert os.stat(path).st_mode & 0o777 == 0o600
    first = Keyring.from_file(path)
    assert Keyring.from_file(new_secret_file(path)) == first
