import pytest

from nodecomm import parse_byte_size
from nodecomm.byte_size import format_byte_size


@pytest.mark.parametrize(
    "text, expected",
    [
        ("0", 0),
        ("6291456", 6291456),
        ("24MB", 25165824),
        (" 24mB ", 25165824),
        ("24 M i B", 25165824),
        ("1k", 1024),
        ("1KB", 1024),
        ("1KiB", 1024),
        ("3kib", 3072),
        ("2M", 2 << 20),
        ("2MiB", 2 << 20),
        ("1G", 1 << 30),
        ("1gb", 1 << 30),
        ("1GiB", 1 << 30),
        ("\t512\n", 512),
        ("off", None),
        ("OFF", None),
        ("Disabled", None),
        ("none", None),
        (" None ", None),
    ],
)
def test_accepted(text, expected):
    assert parse_byte_size(text) == expected


@pytest.mark.parametrize(
    "text", ["-1", "-24MB", "1.5MB", "0.5", "24TB", "24 bytes", "", "   ", "MB", "1e6", "0x10", "on"]
)
def test_rejected_with_the_text_quoted(text):
    with pytest.raises(ValueError) as raised:
        parse_byte_size(text)
    assert repr(text) in str(raised.value)


def test_non_string_rejected():
    with pytest.raises(ValueError, match="must be a string"):
        parse_byte_size(24)  # type: ignore[arg-type]


@pytest.mark.parametrize("size", [None, 0, 1, 1023, 1024, 25165824, 6 << 20, (1 << 30) + 1, 3 << 30])
def test_format_round_trips(size):
    assert parse_byte_size(format_byte_size(size)) == size
