"""`--start-redis`: a redis-server started with the server, on the --store address, and stopped with it."""

import pytest

from irminsul.errors import UserFacingError
from irminsul.server.local_redis import LocalRedis
from tests.support.services import free_port


def test_it_starts_on_the_store_address_evicts_instead_of_refusing_and_stops():
    import redis

    port = free_port()
    server = LocalRedis(f"redis://127.0.0.1:{port}/0")
    try:
        client = redis.Redis(port=port)
        assert client.ping()
        config = client.config_get("maxmemory-policy")
        assert config["maxmemory-policy"] == "allkeys-lru" and client.config_get("save")["save"] == ""
        with pytest.raises(UserFacingError, match="already listens"):
            LocalRedis(f"redis://127.0.0.1:{port}/0")  # never a second server on a taken port
    finally:
        server.stop()
    with pytest.raises(redis.ConnectionError):
        redis.Redis(port=port, socket_connect_timeout=0.5).ping()


@pytest.mark.parametrize(
    "url, message", [("redis://10.1.2.3:6379/0", "not a loopback"), ("rediss://127.0.0.1:6379/0", "redis://")]
)
def test_only_a_plain_redis_on_this_host(url, message):
    with pytest.raises(UserFacingError, match=message):
        LocalRedis(url)


def test_the_cli_says_what_it_needs_in_one_line(capsys):
    from irminsul.cli import main

    assert main(["serve", "--start-redis"]) == 2
    assert capsys.readouterr().err.strip() == (
        "irminsul: error: --start-redis needs the address to start it at: --store redis://127.0.0.1:PORT/0"
    )
