"""`--s3-url` is checked the way S3 will check it, in the process that parses the arguments (`strata serve`,
the worker CLIs, `ServeConfig`), with a message naming the option, the URL and what is allowed."""
from __future__ import annotations

import argparse

import pytest

from strata.launcher import ServeConfig
from worker_common.cli import s3_url
from worker_common.store_setup import s3_config


@pytest.mark.parametrize("url, bucket, prefix, endpoint", [
    ("s3://strata-kv", "strata-kv", "strata/kv/", ""),
    ("s3://my.bucket/team/kv", "my.bucket", "team/kv/", ""),
    ("http://127.0.0.1:9000/strata-kv", "strata-kv", "strata/kv/", "http://127.0.0.1:9000"),
    ("https://minio.local/kv1/a", "kv1", "a/", "https://minio.local"),
])
def test_valid_urls_give_the_bucket_prefix_and_endpoint(url, bucket, prefix, endpoint):
    config = s3_config(url)
    assert (config.bucket, config.prefix, config.endpoint_url, config.create_bucket) == (
        bucket, prefix, endpoint, bool(endpoint))


@pytest.mark.parametrize("url, says", [
    ("http://127.0.0.1:9000/kv", "names bucket 'kv', but an S3 bucket name is 3 to 63 characters"),
    ("s3://" + "b" * 64, "3 to 63 characters"),
    ("s3://Strata_KV", "names bucket 'Strata_KV'"),
    ("s3://-strata", "starting and ending with a letter or digit"),
    ("http://127.0.0.1:9000/", "must name a bucket"),
    ("s3://", "must name a bucket"),
    ("ftp://host/bucket", "must be s3://BUCKET[/PREFIX] or http(s)://HOST:PORT/BUCKET[/PREFIX]"),
    ("127.0.0.1:9000/strata-kv", "must be s3://BUCKET"),
])
def test_bad_urls_are_refused_naming_the_option_and_what_is_allowed(url, says):
    with pytest.raises(ValueError) as err:
        s3_config(url)
    assert str(err.value).startswith("--s3-url ") and says in str(err.value) and repr(url) in str(err.value)


def test_the_example_the_readme_gives_is_valid():
    assert s3_config("http://127.0.0.1:9000/strata-kv").bucket == "strata-kv"


def test_serve_config_refuses_a_bad_url_before_anything_starts():
    with pytest.raises(ValueError, match="--s3-url names bucket 'kv'"):
        ServeConfig(s3_url="http://127.0.0.1:9000/kv")
    assert ServeConfig(s3_url="http://127.0.0.1:9000/strata-kv").s3_url.endswith("/strata-kv")


def test_the_worker_cli_type_refuses_a_bad_url_as_an_argparse_error():
    assert s3_url("") == "" and s3_url("s3://strata-kv") == "s3://strata-kv"
    with pytest.raises(argparse.ArgumentTypeError, match="^names bucket 'kv'"):
        s3_url("http://127.0.0.1:9000/kv")
