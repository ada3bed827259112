"""Redis URLs as every process of a job reads them (chameleond/redisurl.py): plain ones pass to
redis-py, `redis+sentinel://` ones name the sentinels, the service and the database, with the
master's credentials apart from the sentinels' own; a bad one is refused without its password."""

from __future__ import annotations

import pytest

from chameleond.protocol import redact_url, scrub_url, url_error
from chameleond.redisurl import (
    SENTINEL_PORT,
    connect,
    fails_over,
    is_sentinel_url,
    parse_sentinel_url,
)


def test_a_sentinel_url_names_sentinels_service_database_and_credentials() -> None:
    url = (
        "redis+sentinel://job:p%40ss@s1:26380,s2,[::1]:26381/trainer/3"
        "?sentinel_password=spw&socket_timeout=1.5&health_check_interval=10"
    )
    t = parse_sentinel_url(url)
    assert t.sentinels == (("s1", 26380), ("s2", SENTINEL_PORT), ("::1", 26381))
    assert (t.service, t.db, t.tls) == ("trainer", 3, False)
    assert (t.username, t.password, t.sentinel_username, t.sentinel_password) == (
        "job", "p@ss", None, "spw",
    )  # fmt: skip
    assert t.options == {"socket_timeout": 1.5, "health_check_interval": 10}
    # The credentials in the URL are the master's; the sentinels get only their own.
    assert t.master_kwargs() == {
        "socket_timeout": 1.5, "health_check_interval": 10, "db": 3,
        "username": "job", "password": "p@ss",
    }  # fmt: skip
    assert t.sentinel_kwargs({"socket_timeout": 5}) == {"socket_timeout": 5, "password": "spw"}


def test_tls_reaches_the_master_and_the_sentinels() -> None:
    t = parse_sentinel_url("rediss+sentinel://h:1/m?ssl_ca_certs=/ca.pem&ssl_cert_reqs=required")
    assert t.tls and t.db == 0
    assert t.master_kwargs()["ssl"] is True
    assert t.sentinel_kwargs({}) == {
        "ssl": True, "ssl_ca_certs": "/ca.pem", "ssl_cert_reqs": "required",
    }  # fmt: skip


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("redis+sentinel://h1:1", "no service name"),
        ("redis+sentinel://h1:1/", "no service name"),
        ("redis+sentinel://h1:1/m/x", "database 'x'"),
        ("redis+sentinel://h1:1/m/0/extra", "/SERVICE or /SERVICE/DB"),
        ("redis+sentinel://h1:port/m", "is not a port number"),
        ("redis+sentinel://h1:1,,h2:2/m", "empty sentinel address"),
        ("redis+sentinel://h1:1/m?socket_timeout=soon", "invalid value for 'socket_timeout'"),
    ],
)
def test_a_bad_sentinel_url_is_refused_with_the_reason_and_no_password(url: str, why: str) -> None:
    with_password = url.replace("://", "://job:pw-123456@", 1)
    with pytest.raises(ValueError, match=why):
        parse_sentinel_url(with_password)
    said = url_error(with_password)
    assert said is not None and why in said and "pw-123456" not in said


def test_plain_urls_pass_through_and_unknown_schemes_are_named() -> None:
    assert url_error("redis://h:6379/0") is None
    assert url_error("redis+sentinel://h:26379/m/0") is None
    said = url_error("sentinel://job:pw-123456@h/m")
    assert said is not None and "redis+sentinel://" in said and "pw-123456" not in said
    assert not is_sentinel_url("redis://h/0") and is_sentinel_url("REDIS+SENTINEL://h/m")


def test_logged_sentinel_urls_hide_every_password() -> None:
    url = "redis+sentinel://job:pw1@h1:1,h2:2/m/0?sentinel_password=pw2&socket_timeout=2"
    assert redact_url(url) == (
        "redis+sentinel://***@h1:1,h2:2/m/0?sentinel_password=***&socket_timeout=2"
    )
    assert scrub_url(f"auth failed with pw1 / pw2 for {url}", url).count("***") >= 3
    assert "pw" not in scrub_url("pw1 pw2", url).replace("***", "")


def test_a_sentinel_url_makes_a_client_of_the_master_that_fails_over() -> None:
    # Nothing is contacted until a command runs.
    client = connect("redis+sentinel://127.0.0.1:1/m/2", socket_timeout=1, client_name="w")
    plain = connect("redis://127.0.0.1:1/0")
    try:
        assert fails_over(client) and not fails_over(plain)
        kwargs = client.connection_pool.connection_kwargs
        assert kwargs["db"] == 2 and kwargs["client_name"] == "w"
        assert kwargs["retry"].get_retries() > 0  # master_for gives none by itself
    finally:
        client.close()
        plain.close()
