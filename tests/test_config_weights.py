"""`model.weights` (where nodes fetch the weights from) and `bareMetal.weightsCache` (where a host
keeps them): every rule has a failing example whose message is asserted."""

from __future__ import annotations

import copy

import pytest

from qwen_cluster import config
from qwen_cluster.config import ConfigError, validate
from tests.helpers.configs import BASE_AWS, BASE_BARE_METAL

PREFIX = "s3://qwen-weights-example/Qwen/Qwen3-32B/"


def with_weights(base: dict, weights: dict) -> dict:
    raw = copy.deepcopy(base)
    raw["model"] = {"weights": weights}
    return raw


def with_cache(path: str) -> dict:
    raw = copy.deepcopy(BASE_BARE_METAL)
    raw["bareMetal"]["weightsCache"] = path
    return raw


def errors_of(raw: dict) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        validate(raw)
    return caught.value.errors


def test_weights_come_from_the_hub_by_default():
    weights = validate(BASE_AWS).model.weights
    assert (weights.source, weights.uri) == ("hub", None)


def test_an_s3_prefix_on_aws_names_its_bucket_and_key_prefix():
    weights = validate(with_weights(BASE_AWS, {"source": "s3", "uri": PREFIX})).model.weights
    assert (weights.s3_bucket, weights.s3_prefix) == ("qwen-weights-example", "Qwen/Qwen3-32B")


def test_a_mirror_on_bare_metal_is_an_http_endpoint():
    raw = with_weights(BASE_BARE_METAL, {"source": "mirror", "uri": "https://hf-mirror.internal:8443/hf"})
    assert validate(raw).model.weights.uri == "https://hf-mirror.internal:8443/hf"


def test_s3_is_refused_on_bare_metal_naming_the_key_and_the_alternatives():
    (error,) = errors_of(with_weights(BASE_BARE_METAL, {"source": "s3", "uri": PREFIX}))
    assert error.startswith(f"model.weights.source s3 ({PREFIX}) applies to target aws only")
    assert "source mirror" in error and "bareMetal.weightsCache" in error


@pytest.mark.parametrize("source", ["s3", "mirror"])
def test_a_source_other_than_the_hub_needs_a_uri(source):
    (error,) = errors_of(with_weights(BASE_AWS, {"source": source}))
    assert error.startswith(f"model.weights source {source} needs a uri (e.g. ")


def test_a_uri_with_the_hub_is_refused():
    assert errors_of(with_weights(BASE_AWS, {"uri": PREFIX})) == [
        f"model.weights.uri {PREFIX!r} is given but source is hub (remove it, or say which source it is)"
    ]


@pytest.mark.parametrize(
    "uri",
    ["s3://Upper/prefix/", "s3://bucket", "s3://bucket/", "https://bucket/prefix", "s3://b/prefix/"],
)
def test_an_s3_uri_must_be_a_bucket_and_a_prefix(uri):
    (error,) = errors_of(with_weights(BASE_AWS, {"source": "s3", "uri": uri}))
    assert error.startswith(f"model.weights.uri {uri!r} is not an S3 prefix s3://bucket/prefix/")


@pytest.mark.parametrize("uri", ["ftp://mirror", "hf-mirror.internal", "https://mirror/ space"])
def test_a_mirror_must_be_an_http_url(uri):
    assert errors_of(with_weights(BASE_AWS, {"source": "mirror", "uri": uri})) == [
        f"model.weights.uri {uri!r} is not the http(s) URL of a mirror"
    ]


def test_an_unknown_source_is_refused_naming_the_key():
    (error,) = errors_of(with_weights(BASE_AWS, {"source": "nfs"}))
    assert error.startswith("model.weights.source 'nfs'")


def test_the_host_cache_defaults_under_var_cache():
    assert validate(BASE_BARE_METAL).bare_metal.weights_cache == config.DEFAULT_WEIGHTS_CACHE
    assert validate(with_cache("/srv/models/hf")).bare_metal.weights_cache == "/srv/models/hf"


@pytest.mark.parametrize("path", ["models/hf", "/srv/../etc", "/srv/models/", "/srv/.hidden", "/srv/a b"])
def test_the_host_cache_is_a_plain_absolute_path(path):
    (error,) = errors_of(with_cache(path))
    assert error.startswith(f"bareMetal.weightsCache {path!r}")
