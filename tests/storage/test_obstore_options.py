"""fsspec-style storage_options (s3fs, gcsfs, adlfs names) become obstore stores: each name is mapped, ignored as
fsspec-only, or refused by name. Checked through the stores' own ``config``, ``client_options``, ``retry_config`` and
``prefix``; what obstore takes from the environment is checked on the wire, against a local recording server."""

import http.server
import json
import os
import threading

import pytest

pytest.importorskip("obstore")

import obstore  # noqa: E402

from dcp_zarr.storage.obstore_options import SCHEMES, obstore_store  # noqa: E402

# A service-account key that obstore accepts without a real private key (the fake-gcs-server form): no OAuth at all.
FAKE_GCS_KEY = {"disable_oauth": True, "client_email": "", "private_key": "", "private_key_id": "",
                "gcs_base_url": "http://127.0.0.1:4443"}


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch):
    """The developer's own cloud settings must not decide a test: obstore reads these variables itself."""
    for name in list(os.environ):
        if name.startswith(("AWS_", "GOOGLE_", "AZURE_")):
            monkeypatch.delenv(name)


@pytest.fixture
def recording_server():
    """An HTTP endpoint that answers 404 to everything and keeps each request's path and headers."""
    requests: list[tuple[str, dict]] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802  (http.server's name)
            requests.append((self.path, {k.lower(): v for k, v in self.headers.items()}))
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()

        do_HEAD = do_GET  # noqa: N815

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", requests
    server.shutdown()
    server.server_close()


def one_request(store, requests) -> tuple[str, dict]:
    with pytest.raises(FileNotFoundError):
        obstore.head(store, "key")
    assert len(requests) == 1  # also: obstore did not retry the 404 (it never does) nor anything else
    return requests[0]


# -- S3 ---------------------------------------------------------------------------------------------------------------


def test_schemes_are_the_object_stores_obstore_serves_by_default():
    assert SCHEMES == {"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "azure"}


def test_the_bucket_is_the_first_path_component_and_the_rest_the_prefix():
    store = obstore_store("s3://ckpts/runs/7/step-100.zarr/", None)
    assert (store.config["bucket"], store.prefix) == ("ckpts", "runs/7/step-100.zarr")
    assert obstore_store("s3://ckpts", None).prefix is None


def test_s3fs_credentials_become_s3store_credentials():
    config = obstore_store("s3://b/p", {"key": "AK", "secret": "SK", "token": "TOK"}).config
    assert (config["access_key_id"], config["secret_access_key"], config["session_token"]) == ("AK", "SK", "TOK")


def test_botocore_names_in_client_kwargs_are_taken_and_s3fs_names_win_over_them():
    client_kwargs = {"aws_access_key_id": "BOTO", "aws_secret_access_key": "BS", "region_name": "eu-west-3"}
    config = obstore_store("s3://b", {"key": "S3FS", "client_kwargs": client_kwargs}).config
    assert (config["access_key_id"], config["secret_access_key"], config["region"]) == ("S3FS", "BS", "eu-west-3")


def test_s3fs_username_and_password_are_key_and_secret():
    config = obstore_store("s3://b", {"username": "AK", "password": "SK"}).config
    assert (config["access_key_id"], config["secret_access_key"]) == ("AK", "SK")


def test_anon_signs_nothing_and_drops_the_credentials():
    config = obstore_store("s3://b", {"anon": True, "key": "AK", "secret": "SK"}).config
    assert config["skip_signature"] == "true"
    assert "access_key_id" not in config and "secret_access_key" not in config


@pytest.mark.parametrize("options", [{"endpoint_url": "https://minio.example:9000"},
                                     {"client_kwargs": {"endpoint_url": "https://minio.example:9000"}}])
def test_a_custom_endpoint_is_addressed_path_style_over_https(options):
    store = obstore_store("s3://b", options)
    assert store.config["endpoint"] == "https://minio.example:9000"
    assert store.config["virtual_hosted_style_request"] == "false"
    assert "allow_http" not in (store.client_options or {})


def test_an_http_endpoint_is_allowed_plain_http():
    assert obstore_store("s3://b", {"endpoint_url": "http://127.0.0.1:9000"}).client_options["allow_http"] == "true"


def test_an_http_endpoint_from_the_environment_is_allowed_plain_http(monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9000")
    assert obstore_store("s3://b", None).client_options["allow_http"] == "true"


def test_the_endpoint_option_wins_over_the_environments_s3_endpoint(monkeypatch, recording_server):
    endpoint, requests = recording_server
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://127.0.0.1:9")  # discard: nothing would be recorded there
    path, _ = one_request(obstore_store("s3://b/p", {"endpoint_url": endpoint, "anon": True}), requests)
    assert path == "/b/p/key"  # path style: the bucket in the path, not the host


def test_credentials_and_region_left_out_come_from_the_environment(monkeypatch, recording_server):
    endpoint, requests = recording_server
    for name, value in {"AWS_ACCESS_KEY_ID": "ENVKEY", "AWS_SECRET_ACCESS_KEY": "ENVSECRET",
                        "AWS_SESSION_TOKEN": "ENVTOKEN", "AWS_DEFAULT_REGION": "eu-central-1"}.items():
        monkeypatch.setenv(name, value)
    _, headers = one_request(obstore_store("s3://b", {"endpoint_url": endpoint}), requests)
    assert "Credential=ENVKEY/" in headers["authorization"] and "/eu-central-1/s3/" in headers["authorization"]
    assert headers["x-amz-security-token"] == "ENVTOKEN"


def test_a_custom_endpoint_without_a_region_signs_for_us_east_1_as_botocore(recording_server):
    endpoint, requests = recording_server
    _, headers = one_request(obstore_store("s3://b", {"endpoint_url": endpoint, "key": "AK", "secret": "SK"}),
                             requests)
    assert "Credential=AK/" in headers["authorization"] and "/us-east-1/s3/" in headers["authorization"]


def test_use_ssl_false_without_an_endpoint_is_refused():
    with pytest.raises(ValueError, match=r"'use_ssl'.*s3://.*client='fsspec'"):
        obstore_store("s3://b", {"use_ssl": False})
    assert obstore_store("s3://b", {"use_ssl": False, "endpoint_url": "http://127.0.0.1:9000"}).client_options


def test_botocore_timeouts_become_obstore_durations():
    config_kwargs = {"connect_timeout": 1.5, "read_timeout": 60}
    client_options = obstore_store("s3://b", {"config_kwargs": config_kwargs}).client_options
    assert (client_options["connect_timeout"], client_options["read_timeout"]) == ("1s 500ms", "1m")


def test_without_timeouts_obstores_defaults_stay():
    assert obstore_store("s3://b", None).client_options is None


def test_without_retry_settings_obstore_does_not_retry():
    assert obstore_store("s3://b", None).retry_config["max_retries"] == 0


@pytest.mark.parametrize(("retries", "max_retries"), [
    ({"total_max_attempts": 1, "mode": "standard"}, 0),
    ({"max_attempts": 3}, 3),
    ({"total_max_attempts": 2, "max_attempts": 7}, 1),
    ({"mode": "standard"}, 2),
    ({"mode": "legacy"}, 4),
])
def test_botocore_retries_become_obstores_retry_count(retries, max_retries):
    store = obstore_store("s3://b", {"config_kwargs": {"retries": retries}})
    assert store.retry_config["max_retries"] == max_retries


def test_max_pool_connections_is_accepted_and_sets_nothing():
    store = obstore_store("s3://b", {"config_kwargs": {"max_pool_connections": 64}})
    assert store.client_options is None


def test_encryption_and_requester_pays_reach_the_config():
    extra = {"ServerSideEncryption": "aws:kms", "SSEKMSKeyId": "key-1", "BucketKeyEnabled": True}
    config = obstore_store("s3://b", {"s3_additional_kwargs": extra, "requester_pays": True}).config
    assert config["server_side_encryption"] == "aws:kms" and config["sse_kms_key_id"] == "key-1"
    assert config["sse_bucket_key_enabled"] == "true" and config["request_payer"] == "true"


def test_verify_false_allows_invalid_certificates_and_a_path_is_a_ca_bundle():
    certifi = pytest.importorskip("certifi")
    loose = obstore_store("s3://b", {"client_kwargs": {"verify": False}}).client_options
    assert loose["allow_invalid_certificates"] == "true"
    bundle = obstore_store("s3://b", {"client_kwargs": {"verify": certifi.where()}}).client_options
    with open(certifi.where(), "rb") as pem:
        assert bytes(bundle["root_certificate"]) == pem.read()


def test_obstores_own_dicts_pass_through_and_win():
    options = {"client_kwargs": {"region_name": "eu-west-1"}, "config_kwargs": {"connect_timeout": 5},
               "config": {"region": "us-west-2", "unsigned_payload": True},
               "client_options": {"connect_timeout": "9s", "timeout": "120s"}, "retry_config": {"max_retries": 5}}
    store = obstore_store("s3://b", options)
    assert store.config["region"] == "us-west-2" and store.config["unsigned_payload"] == "true"
    assert store.client_options["connect_timeout"] == "9s" and store.client_options["timeout"] == "120s"
    assert store.retry_config["max_retries"] == 5


def test_an_obstore_retry_config_key_obstore_would_ignore_is_refused():
    with pytest.raises(ValueError, match=r"retry_config\['max_retry'\]"):
        obstore_store("s3://b", {"retry_config": {"max_retry": 5}})


def test_client_obstore_is_accepted_and_any_other_client_refused_by_name():
    assert obstore_store("s3://b", {"client": "obstore"}).config["bucket"] == "b"
    with pytest.raises(ValueError, match="client='boto3'"):
        obstore_store("s3://b", {"client": "boto3"})


def test_fsspec_cache_options_are_ignored():
    options = {"skip_instance_cache": True, "use_listings_cache": False, "default_block_size": 2**20}
    assert obstore_store("s3://b", options).config == {"bucket": "b"}


def test_an_option_obstore_lacks_is_taken_at_fsspecs_default_only():
    assert obstore_store("s3://b", {"version_aware": False}).config == {"bucket": "b"}
    with pytest.raises(ValueError, match="'version_aware'"):
        obstore_store("s3://b", {"version_aware": True})


@pytest.mark.parametrize(("url", "options", "name"), [
    ("s3://b", {"profile": "dev"}, "'profile'"),
    ("s3://b", {"region": "eu-west-1"}, "'region'"),
    ("s3://b", {"client_kwargs": {"proxies": {}}}, r"client_kwargs\['proxies'\]"),
    ("s3://b", {"config_kwargs": {"signature_version": "s3"}}, r"config_kwargs\['signature_version'\]"),
    ("s3://b", {"config_kwargs": {"retries": {"max_attempts": 2, "jitter": 1}}}, r"\['retries'\]\['jitter'\]"),
    ("s3://b", {"s3_additional_kwargs": {"ACL": "private"}}, r"s3_additional_kwargs\['ACL'\]"),
    ("gs://b", {"requester_pays": True}, "'requester_pays'"),
    ("gs://b", {"token": "browser"}, "token='browser'"),
    ("az://c", {"account_name": "a", "credential": object()}, "'credential'"),
])
def test_an_option_without_a_counterpart_is_refused_naming_it_the_scheme_and_the_escape_hatch(url, options, name):
    scheme = url.split(":")[0]
    with pytest.raises(ValueError, match=rf"{name} for {scheme}://.*client='fsspec'"):
        obstore_store(url, options)


@pytest.mark.parametrize("url", ["file:///tmp/x", "memory://x", "s3://", "s3:///prefix"])
def test_a_url_without_a_served_scheme_or_a_bucket_is_refused(url):
    with pytest.raises(ValueError, match="obstore_store|bucket"):
        obstore_store(url, None)


# -- GCS --------------------------------------------------------------------------------------------------------------


def test_a_gcsfs_token_path_is_a_service_account_file(tmp_path):
    path = tmp_path / "key.json"
    path.write_text(json.dumps(FAKE_GCS_KEY))
    store = obstore_store("gs://b/run", {"token": str(path), "project": "ignored"})
    assert (store.config["service_account"], store.config["bucket"], store.prefix) == (str(path), "b", "run")


def test_a_gcsfs_token_dict_is_a_service_account_key():
    config = obstore_store("gcs://b", {"token": FAKE_GCS_KEY}).config
    assert json.loads(config["service_account_key"]) == FAKE_GCS_KEY


@pytest.mark.parametrize("token", [None, "google_default", "cloud"])
def test_gcsfs_default_credentials_are_obstores_own_chain(token):
    assert obstore_store("gs://b", {"token": token}).config == {"bucket": "b"}


def test_a_gcsfs_anon_token_signs_nothing():
    assert obstore_store("gs://b", {"token": "anon"}).config["skip_signature"] == "true"


@pytest.mark.parametrize("name", ["endpoint_url", "endpoint"])
def test_a_gcs_endpoint_is_the_base_url(name):
    store = obstore_store("gs://b", {name: "http://127.0.0.1:4443", "token": "anon"})
    assert store.config["base_url"] == "http://127.0.0.1:4443" and store.client_options["allow_http"] == "true"


# -- Azure ------------------------------------------------------------------------------------------------------------


def test_adlfs_credentials_become_azurestore_config():
    options = {"account_name": "acct", "account_key": "a2V5", "tenant_id": "t", "client_id": "c",
               "client_secret": "s"}
    store = obstore_store("abfs://container/run/7", options)
    assert {k: store.config[k] for k in options} == options
    assert (store.config["container_name"], store.prefix) == ("container", "run/7")


def test_an_adlfs_sas_token_loses_its_question_mark():
    assert obstore_store("az://c", {"account_name": "a", "sas_token": "?sv=1&sig=x"}).config["sas_key"] == "sv=1&sig=x"


def test_adlfs_anon_signs_nothing():
    assert obstore_store("azure://c", {"account_name": "a", "anon": True}).config["skip_signature"] == "true"


def test_the_account_in_an_abfss_url_is_taken_and_the_option_wins_over_it():
    assert obstore_store("abfss://c@acct.dfs.core.windows.net/p", None).config["account_name"] == "acct"
    config = obstore_store("abfss://c@acct.dfs.core.windows.net/p", {"account_name": "other"}).config
    assert (config["account_name"], config["container_name"]) == ("other", "c")


def test_an_account_host_is_the_endpoint():
    store = obstore_store("az://c", {"account_name": "a", "account_host": "a.blob.core.usgovcloudapi.net"})
    assert store.config["endpoint"] == "https://a.blob.core.usgovcloudapi.net"
    local = obstore_store("az://c", {"account_name": "a", "account_host": "http://127.0.0.1:10000/a"})
    assert local.client_options["allow_http"] == "true"


def test_adlfs_timeouts_become_obstore_durations():
    options = {"account_name": "a", "connection_timeout": 10, "read_timeout": 90}
    client_options = obstore_store("az://c", options).client_options
    assert (client_options["connect_timeout"], client_options["read_timeout"]) == ("10s", "1m 30s")


def test_a_connection_string_is_refused_with_what_to_give_instead():
    with pytest.raises(ValueError, match=r"'connection_string' for az://.*account_key or sas_token.*client='fsspec'"):
        obstore_store("az://c", {"connection_string": "AccountName=a;AccountKey=a2V5"})


@pytest.mark.parametrize(("url", "options"), [("az://c", {"account_name": "a"}), ("gs://b", {"token": "anon"})])
def test_gcs_and_azure_stores_do_not_retry_either(url, options):
    assert obstore_store(url, options).retry_config["max_retries"] == 0
