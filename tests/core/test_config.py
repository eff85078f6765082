"""Configuration: one parser in the core, reached by string or keywords."""
import pytest

import pyalloc
from pyalloc import _C

MiB = 1 << 20
GiB = 1 << 30


@pytest.mark.parametrize(
    "text,expected",
    [
        ("4096", 4096),
        ("512MiB", 512 * MiB),
        ("2GiB", 2 * GiB),
        ("2 GiB", 2 * GiB),
        ("1.5GiB", 3 * GiB // 2),
        ("64kib", 64 << 10),
        ("20MB", 20 * MiB),
        ("1T", 1 << 40),
        ("7B", 7),
    ],
)
def test_sizes_accept_bytes_and_binary_units(text, expected):
    assert _C.parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "abc", "-5", "5 parsecs", "1.2.3MiB", "0.3", "1e9"])
def test_bad_sizes_are_rejected(text):
    with pytest.raises(ValueError):
        _C.parse_size(text)


def test_string_config_sets_keys():
    cfg = pyalloc.parse_config("pool_size:2GiB, max_pool_size:40GiB")
    assert cfg["pool_size"] == 2 * GiB
    assert cfg["max_pool_size"] == 40 * GiB
    assert set(cfg) == set(pyalloc.CONFIG_KEYS)


def test_unknown_key_names_it_and_lists_valid_keys():
    with pytest.raises(ValueError) as e:
        pyalloc.parse_config("pool_size:1GiB,poolsize:2GiB")
    msg = str(e.value)
    assert "'poolsize'" in msg
    for key in pyalloc.CONFIG_KEYS:
        assert key in msg


def test_bad_value_names_the_key():
    with pytest.raises(ValueError, match="max_pool_size"):
        pyalloc.parse_config("max_pool_size:lots")


def test_item_without_colon_is_rejected():
    with pytest.raises(ValueError, match="key:value"):
        pyalloc.parse_config("pool_size=1GiB")


def test_inconsistent_values_are_rejected():
    with pytest.raises(ValueError, match="pool_size"):
        pyalloc.parse_config("pool_size:4GiB,max_pool_size:1GiB")
    with pytest.raises(ValueError, match="small_size"):
        pyalloc.parse_config("small_size:4MiB,small_chunk_size:2MiB")


def test_keywords_override_the_string(backend):
    a = pyalloc.Allocator(backend, "segment_size:64MiB,max_pool_size:1GiB", max_pool_size="2GiB")
    assert a.config["segment_size"] == 64 * MiB
    assert a.config["max_pool_size"] == 2 * GiB


def test_bad_keyword_is_a_value_error(backend):
    with pytest.raises(ValueError, match="valid keys"):
        pyalloc.Allocator(backend, pool_sise=1)
    with pytest.raises(ValueError, match="negative"):
        pyalloc.Allocator(backend, pool_size=-1)
    with pytest.raises(TypeError):
        pyalloc.Allocator(backend, pool_size=1.5)


def test_unknown_backend():
    with pytest.raises(ValueError, match="host"):
        pyalloc.Allocator("gpu")
