import pytest

from nodecomm.service.config import load_config


def test_precedence_defaults_file_environment_flags(tmp_path):
    config_file = tmp_path / "nodecomm.toml"
    config_file.write_text(
        'socket = "/tmp/from-file.sock"\njoin_timeout_seconds = 7\ntiming_sample_period = 8\n'
        '[thresholds]\noneshot_max_bytes = "32KiB"\ndma_min_bytes = "24MB"\n'
    )
    env = {"NODECOMM_CONFIG": str(config_file), "NODECOMM_JOIN_TIMEOUT_SECONDS": "9", "NODECOMM_DMA_MIN_BYTES": "off"}
    config = load_config(["--timing-sample-period", "16"], env)
    assert config.socket == "/tmp/from-file.sock"  # file over default
    assert config.join_timeout_seconds == 9.0  # environment over file
    assert config.timing_sample_period == 16  # flag over file
    assert config.overrides == {"oneshot_max_bytes": 32 << 10, "dma_min_bytes": None}  # env "off" over file
    assert config.descriptor_socket == "/tmp/from-file.sock.fd"
    assert load_config([], {}).operation_timeout_seconds == 60.0  # built-in default


@pytest.mark.parametrize(
    "argv, env, message",
    [
        (["--tcp-address", "10.0.0.1:5000"], {}, "loopback"),
        (["--join-timeout-seconds", "0"], {}, "positive"),
        (["--metrics-address", "localhost"], {}, "ip:port"),
        ([], {"NODECOMM_ONESHOT_MAX_BYTES": "-5"}, "'-5'"),
        ([], {"NODECOMM_MAX_CAPACITY_BYTES": "lots"}, "lots"),
        (["--log-format", "xml"], {}, "log_format"),
        ([], {"NODECOMM_ALLOW_SHARED_DEVICES": "maybe"}, "expected true/false"),
        (["--cuda-service-ordering", "shm"], {}, "cuda_service_ordering: expected 'auto', 'stream-words'"),
        (["--log-level", "FOO"], {}, "log_level 'FOO': expected DEBUG, INFO, WARNING, ERROR or CRITICAL"),
    ],
)
def test_bad_values_name_the_setting(argv, env, message):
    with pytest.raises(ValueError, match=message):
        load_config(argv, env)


def test_unknown_file_setting(tmp_path):
    config_file = tmp_path / "bad.toml"
    config_file.write_text("sokcet = '/tmp/x'\n")
    with pytest.raises(ValueError, match="unknown setting 'sokcet'"):
        load_config(["--config", str(config_file)], {})


def test_loopback_tcp_allowed():
    assert load_config(["--tcp-address", "127.0.0.1:50051"], {}).tcp_address == "127.0.0.1:50051"


def test_boolean_settings():
    assert load_config([], {}).allow_shared_devices is False
    assert load_config([], {"NODECOMM_ALLOW_SHARED_DEVICES": "yes"}).allow_shared_devices is True
    assert (
        load_config(["--allow-shared-devices", "false"], {"NODECOMM_ALLOW_SHARED_DEVICES": "1"}).allow_shared_devices
        is False
    )


def test_help_gives_every_flag_a_line_and_its_default():
    from nodecomm.service.config import _FIELDS, build_parser

    text = " ".join(build_parser().format_help().split())  # as one line: argparse wraps at the terminal width
    for name in _FIELDS:
        flag = "--" + name.replace("_", "-")
        entry = text[text.index(flag + " ", text.index("options:")) :].split(" --")[0]
        assert "(default: " in entry, entry
    assert "--max-reserved-bytes SIZE" in text and "(default: 16GiB)" in text
    assert "--oneshot-max-bytes SIZE|off" in text and "--join-timeout-seconds FLOAT" in text
    assert "--max-capacity-bytes INT" not in text


def test_every_byte_size_setting_takes_a_size(tmp_path):
    """max_bytes_per_gpu and the per-caller share too, on the flag, in the environment and the file."""
    config_file = tmp_path / "nodecomm.toml"
    config_file.write_text('max_bytes_per_gpu = "2GiB"\nmax_reserved_bytes_per_caller = "3GiB"\n')
    assert load_config(["--config", str(config_file)], {}).max_bytes_per_gpu == 2 << 30
    assert load_config(["--config", str(config_file)], {}).max_reserved_bytes_per_caller == 3 << 30
    assert load_config([], {"NODECOMM_MAX_BYTES_PER_GPU": "16GiB"}).max_bytes_per_gpu == 16 << 30
    assert load_config(["--max-bytes-per-gpu", "16GiB"], {}).max_bytes_per_gpu == 16 << 30


def test_a_config_file_that_is_not_toml_is_named(tmp_path):
    config_file = tmp_path / "nodecomm.toml"
    config_file.write_text("socket = \n")
    with pytest.raises(ValueError, match=f"config file {config_file}: not valid TOML"):
        load_config(["--config", str(config_file)], {})


def test_an_unusable_state_dir_stops_the_daemon_at_start_naming_it(tmp_path):
    """A path under a regular file (or a file itself) cannot hold calibrations: the daemon refuses
    to start (exit 2) and says which setting, where it would have served without them."""
    import subprocess
    import sys

    regular = tmp_path / "a-file"
    regular.write_text("")
    with pytest.raises(ValueError, match=r"state_dir '.*a-file': is not a directory"):
        load_config(["--state-dir", str(regular)], {})
    load_config(["--state-dir", str(tmp_path / "new" / "state")], {})  # one that can be made is fine
    started = subprocess.run(
        [sys.executable, "-m", "nodecomm.service", "--socket", str(tmp_path / "d.sock"),
         "--state-dir", str(regular / "state"), "--metrics-address", "off"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert started.returncode == 2, started.stderr
    assert f"state_dir '{regular / 'state'}': is under {regular}, which is not a directory" in started.stderr
