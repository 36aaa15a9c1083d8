"""Configuration loading, errors as file:line: Key: what, and documentation coverage."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from migratory.config import Config, ConfigError, Endpoint, SlowConsumerPolicy, documented_keys

ROOT = Path(__file__).resolve().parent.parent


def test_defaults() -> None:
    config = Config()
    assert config.listen == (Endpoint("*", 8800),)
    assert config.publish_snapshot_message is True
    assert config.batching_time == 0


def test_parse_values_comments_and_continuation() -> None:
    text = (
        "# comment\n"
        "Listen = 127.0.0.1:9000, \\\n"
        "         [::1]:9001\n"
        "\n"
        "PublishSnapshotMessage = false\n"
        "MessageSizeLimit = 64K\n"
        "BatchingTime = 100\n"
        "BatchingSize = 8K\n"
        "SlowConsumerPolicy = drop\n"
    )
    config = Config.from_text(text, "x.conf")
    assert config.listen == (Endpoint("127.0.0.1", 9000), Endpoint("::1", 9001))
    assert config.publish_snapshot_message is False
    assert config.message_size_limit == 65536
    assert config.batching_size == 8192
    assert config.slow_consumer_policy is SlowConsumerPolicy.DROP


def test_every_error_is_reported_with_file_line_and_key() -> None:
    text = "Listen = 127.0.0.1:99999\nFoo = 1\nlisten = 1\n\nBatchingTime = soon\nListen = *:1\nNoEquals\n"
    with pytest.raises(ConfigError) as info:
        Config.from_text(text, "bad.conf")
    errors = info.value.errors
    assert errors[0].startswith("bad.conf:1: Listen: ") and "port" in errors[0]
    assert errors[1] == "bad.conf:2: Foo: unknown key"
    assert errors[2] == "bad.conf:3: listen: unknown key (did you mean Listen?)"
    assert errors[3].startswith("bad.conf:5: BatchingTime: expected a whole number")
    assert errors[4].startswith("bad.conf:6: Listen: already set on line 1")
    assert errors[5].startswith("bad.conf:7: NoEquals: expected 'Key = value'")


def test_cross_key_error_points_at_the_key_line() -> None:
    with pytest.raises(ConfigError) as info:
        Config.from_text("Listen = *:1\nBatchingSize = 1000\n", "c.conf")
    assert info.value.errors == [
        "c.conf:2: BatchingSize: needs BatchingTime too (the longest a message may wait for the batch to fill)"
    ]


def test_unreadable_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        Config.from_file(tmp_path / "missing.conf")
    assert "missing.conf:0: (file): cannot read" in info.value.errors[0]


def test_every_key_is_documented_in_conf_and_docs_with_its_default() -> None:
    conf = (ROOT / "conf" / "migratorydata.conf").read_text()
    docs = (ROOT / "docs" / "configuration.md").read_text()
    for key, default, _doc in documented_keys():
        assert f"{key} = " in conf, f"{key} missing from conf/migratorydata.conf"
        assert f"# Default: {default}" in conf.split(f"{key} = ")[0].rsplit("\n\n", 1)[-1], key
        assert f"`{key}`" in docs, f"{key} missing from docs/configuration.md"
        assert f"`{default}`" in docs.split(f"`{key}`", 1)[1].split("\n", 1)[0], f"{key} default not in docs"


def test_bundled_config_is_valid() -> None:
    Config.from_file(ROOT / "conf" / "migratorydata.conf")


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "migratory_cli.main", *args], capture_output=True, text=True, timeout=60
    )


def test_cli_config_check_ok_and_errors(tmp_path: Path) -> None:
    good = tmp_path / "good.conf"
    good.write_text("Listen = 127.0.0.1:8800\n")
    result = run_cli("config", "check", str(good))
    assert result.returncode == 0, result.stderr
    assert "OK" in result.stdout
    bad = tmp_path / "bad.conf"
    bad.write_text("Listen = 127.0.0.1:8800\nMessageSizeLimit = huge\n")
    result = run_cli("config", "check", str(bad))
    assert result.returncode == 2
    assert f"{bad}:2: MessageSizeLimit: expected a size" in result.stderr


def test_serve_refuses_broken_config_with_exit_2(tmp_path: Path) -> None:
    bad = tmp_path / "bad.conf"
    bad.write_text("Listen = nowhere\n")
    result = run_cli("serve", "-c", str(bad))
    assert result.returncode == 2
    assert f"{bad}:1: Listen:" in result.stderr


def test_example_dmz_config_is_valid() -> None:
    config = Config.from_file(ROOT / "conf" / "migratorydata-dmz.conf")
    assert config.listen_encrypted[0].port == 443 and config.entitlement == "JWT"
    assert config.publish_allow_from == ("192.168.1.0/24",)


@given(st.text(max_size=300))
def test_config_parser_raises_only_config_errors(text: str) -> None:
    try:
        Config.from_text(text, "fuzz.conf")
    except ConfigError as exc:
        assert all(line.startswith("fuzz.conf:") for line in exc.errors)


def test_two_listener_keys_on_one_address_and_port_are_refused() -> None:
    with pytest.raises(ConfigError) as info:
        Config.from_text("Listen = 127.0.0.1:8800\nListenMqtt = 127.0.0.1:8800\n", "c.conf")
    assert info.value.errors == ["c.conf:2: ListenMqtt: 127.0.0.1:8800 is also a Listen listener"]
    Config.from_text("Listen = 127.0.0.1:8800\nListenMqtt = 127.0.0.1:1883\n", "c.conf")  # distinct ports: fine
