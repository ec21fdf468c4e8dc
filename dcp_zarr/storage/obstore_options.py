"""Build an obstore store from a URL and the fsspec-style ``storage_options`` users already pass.

``ZarrWriter(path, storage_options=...)`` takes the option names of s3fs, gcsfs and adlfs; for obstore to serve s3://,
gs:// and az:// URLs by default, those names must keep working. Each one maps to an obstore setting, is ignored
because it only tunes fsspec's caches and file objects (an obstore store has neither), or is refused by name: a dropped
credential, endpoint or encryption setting would send requests, or store data, other than the user asked.
``client="fsspec"`` keeps the fsspec path for anything refused.

What the options leave out comes from the environment: obstore's stores read the AWS_*, GOOGLE_* and AZURE_* variables
themselves (AWS_ACCESS_KEY_ID, AWS_SESSION_TOKEN, AWS_DEFAULT_REGION, AWS_REGION, AWS_ENDPOINT_URL(_S3), ...), and the
region defaults to us-east-1, as botocore's does for a custom endpoint. obstore is an optional dependency (the ``s3``
extra): it is imported only when a store is built.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from obstore.store import AzureStore, GCSStore, S3Store

__all__ = ["SCHEMES", "obstore_store"]

S3_SCHEMES = frozenset({"s3", "s3a"})
GCS_SCHEMES = frozenset({"gs", "gcs"})
AZURE_SCHEMES = frozenset({"az", "abfs", "abfss", "azure"})
SCHEMES = S3_SCHEMES | GCS_SCHEMES | AZURE_SCHEMES  # what obstore_store serves

# fsspec's instance and listing caches, its file objects and its multipart uploads: obstore has no such caches and its
# own put, so nothing is lost by not mapping them.
_FSSPEC_ONLY = frozenset({"skip_instance_cache", "use_listings_cache", "listings_expiry_time", "max_paths",
                          "asynchronous", "loop", "default_block_size", "default_fill_cache", "default_cache_type",
                          "block_size", "blocksize", "cache_timeout", "max_concurrency", "fixed_upload_size",
                          "assume_container_exists", "check_connection"})
# Accepted at fsspec's default only, which is what obstore does; another value asks for a behaviour obstore lacks.
_DEFAULT_ONLY = {"version_aware": False, "cache_regions": False, "requester_pays": False, "access": "full_control",
                 "location_mode": "primary"}
_HINTS = {**dict.fromkeys(("region", "region_name"), "s3fs takes it as client_kwargs={'region_name': ...}"),
          "connection_string": "obstore takes none; give account_name with account_key or sas_token"}
_OBSTORE_OWN = ("config", "client_options", "retry_config")
_RETRY_KEYS = frozenset({"backoff", "max_retries", "retry_timeout"})  # obstore does not check retry_config's keys
# (obstore setting, s3fs name, botocore name in client_kwargs): s3fs lets its own name win.
_S3_CREDENTIALS = (("access_key_id", "key", "aws_access_key_id"),
                   ("secret_access_key", "secret", "aws_secret_access_key"),
                   ("session_token", "token", "aws_session_token"))
_S3_ADDITIONAL = {"ServerSideEncryption": "server_side_encryption", "SSEKMSKeyId": "sse_kms_key_id",
                  "BucketKeyEnabled": "sse_bucket_key_enabled", "RequestPayer": "request_payer"}
# fsspec's timeout names to obstore's. Both read timeouts bound the wait for each read, not the whole request.
_BOTOCORE_TIMEOUTS = {"connect_timeout": "connect_timeout", "read_timeout": "read_timeout"}
_ADLFS_TIMEOUTS = {"connection_timeout": "connect_timeout", "read_timeout": "read_timeout"}


@dataclass
class _Settings:
    """What the fsspec options became, before the user's own obstore dicts are laid over them."""

    config: dict[str, Any] = field(default_factory=dict)
    client_options: dict[str, Any] = field(default_factory=dict)
    retry_config: dict[str, Any] | None = None  # None: the user configured no retries


def obstore_store(url: str, storage_options: dict | None = None) -> S3Store | GCSStore | AzureStore:
    """The obstore store for ``url`` (``scheme://bucket/prefix``), configured from fsspec-style ``storage_options``.

    obstore's own ``config``, ``client_options`` and ``retry_config`` dicts may be given too; they win over what the
    fsspec names map to. Unless retries are configured, obstore retries nothing: dcp_zarr's retry layer (retry.py) is
    the only one, as zarr_store.py makes it for botocore.
    """
    scheme, bucket, prefix, account = _split_url(url)
    options = dict(storage_options or {})
    client = options.pop("client", "obstore")
    if client != "obstore":
        raise _refused(scheme, f"client={client!r}", "obstore_store serves client='obstore' only")
    own = {name: dict(options.pop(name, None) or {}) for name in _OBSTORE_OWN}
    _check_empty(scheme, "retry_config", {k: v for k, v in own["retry_config"].items() if k not in _RETRY_KEYS})
    settings = _fsspec_settings(scheme, options, account)
    if settings.retry_config is None and not own["retry_config"]:
        settings.retry_config = {"max_retries": 0}
    retry = {**(settings.retry_config or {}), **own["retry_config"]}
    from obstore.store import AzureStore, GCSStore, S3Store

    store_class: Any = S3Store if scheme in S3_SCHEMES else GCSStore if scheme in GCS_SCHEMES else AzureStore
    return store_class(bucket, prefix=prefix or None, config={**settings.config, **own["config"]},
                       client_options={**settings.client_options, **own["client_options"]} or None,
                       retry_config=retry)


def _fsspec_settings(scheme: str, options: dict, account: str | None) -> _Settings:
    """Map, ignore or refuse each fsspec option; refusing what is left names it."""
    settings = _Settings(config={"account_name": account} if account else {})
    map_options = _map_s3 if scheme in S3_SCHEMES else _map_gcs if scheme in GCS_SCHEMES else _map_azure
    map_options(scheme, options, settings)
    for name in _FSSPEC_ONLY & options.keys():
        del options[name]
    for name, default in _DEFAULT_ONLY.items():
        if name in options and options.pop(name) != default:
            raise _refused(scheme, repr(name), f"obstore has a counterpart for {default!r} only")
    _check_empty(scheme, None, options)
    return settings


def _split_url(url: str) -> tuple[str, str, str, str | None]:
    """(scheme, bucket or container, prefix, Azure account named in the URL). Split by hand, not by urlsplit, so a
    ``?`` or ``#`` in a key stays in the prefix. adlfs also takes ``abfs://container@account.dfs.core.windows.net/``."""
    scheme, separator, rest = url.partition("://")
    scheme = scheme.lower()
    if not separator or scheme not in SCHEMES:
        raise ValueError(f"{url}: obstore_store serves {', '.join(sorted(SCHEMES))} URLs only")
    bucket, _, prefix = rest.partition("/")
    account = None
    if scheme in AZURE_SCHEMES and "@" in bucket:
        bucket, host = bucket.split("@", 1)
        account = host.split(".", 1)[0]
    if not bucket:
        raise ValueError(f"{url}: no bucket or container (the first path component)")
    return scheme, bucket, prefix.strip("/"), account


def _refused(scheme: str, name: str, why: str = "obstore has no counterpart") -> ValueError:
    return ValueError(f"storage option {name} for {scheme}:// URLs: {why}. Pass client='fsspec' in storage_options "
                      "to keep the fsspec path.")


def _check_empty(scheme: str, where: str | None, left: dict) -> None:
    """Refuse what no mapping took, naming it (``'anon'``, ``config_kwargs['proxies']``)."""
    if left:
        name = sorted(map(str, left))[0]
        label = f"{where}[{name!r}]" if where else repr(name)
        raise _refused(scheme, label, _HINTS.get(name, "obstore has no counterpart"))


def _pop_either(first: dict, first_name: str, second: dict, second_name: str) -> Any:
    """Pop both names; the first wins where both are set."""
    value, fallback = first.pop(first_name, None), second.pop(second_name, None)
    return fallback if value is None else value


def _set_endpoint(settings: _Settings, endpoint: str | None, *names: str) -> None:
    """obstore refuses plain http unless allowed; an endpoint that asks for it is the user's permission."""
    for name in names:
        settings.config[name] = endpoint
    if endpoint and endpoint.startswith("http://"):
        settings.client_options["allow_http"] = True


def _set_timeouts(options: dict, settings: _Settings, names: dict[str, str]) -> None:
    """fsspec's seconds (a float, as botocore and adlfs take them) to durations, which obstore takes exactly."""
    for name in names.keys() & options.keys():
        settings.client_options[names[name]] = timedelta(seconds=options.pop(name))


def _map_s3(scheme: str, options: dict, settings: _Settings) -> None:
    """s3fs's names (its own, botocore's client_kwargs and config_kwargs, s3_additional_kwargs) to S3Store's."""
    client_kwargs = dict(options.pop("client_kwargs", None) or {})
    config_kwargs = dict(options.pop("config_kwargs", None) or {})
    for alias, name in (("username", "key"), ("password", "secret")):
        if alias in options:
            options[name] = options.pop(alias)
    for setting, name, botocore_name in _S3_CREDENTIALS:
        if (value := _pop_either(options, name, client_kwargs, botocore_name)) is not None:
            settings.config[setting] = value
    if options.pop("anon", False):  # as s3fs: no credentials, nothing signed
        settings.config = {"skip_signature": True}
    if region := _pop_either(client_kwargs, "region_name", config_kwargs, "region_name"):
        settings.config["region"] = region
    if options.pop("requester_pays", False):
        settings.config["request_payer"] = True
    _map_s3_connection(scheme, options, client_kwargs, settings)
    _check_empty(scheme, "client_kwargs", client_kwargs)
    _map_botocore_config(scheme, config_kwargs, settings)
    extra = dict(options.pop("s3_additional_kwargs", None) or {})
    for name in _S3_ADDITIONAL.keys() & extra.keys():
        settings.config[_S3_ADDITIONAL[name]] = extra.pop(name)
    _check_empty(scheme, "s3_additional_kwargs", extra)


def _map_s3_connection(scheme: str, options: dict, client_kwargs: dict, settings: _Settings) -> None:
    """Endpoint, plain http and certificates, from s3fs's and botocore's names."""
    use_ssl = client_kwargs.pop("use_ssl", options.pop("use_ssl", True))  # s3fs lets client_kwargs win here
    if endpoint := _pop_either(options, "endpoint_url", client_kwargs, "endpoint_url"):
        # Both names: obstore lets AWS_ENDPOINT_URL_S3 beat a configured ``endpoint``; botocore lets the option win.
        _set_endpoint(settings, endpoint, "endpoint", "aws_endpoint_url_s3")
        settings.config["virtual_hosted_style_request"] = False  # path style, as botocore for a custom endpoint
    else:  # obstore reads these itself; only its permission for plain http is missing
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        _set_endpoint(settings, endpoint)
    if not use_ssl and not endpoint:  # with an endpoint, botocore follows the endpoint's scheme, as obstore does
        raise _refused(scheme, "'use_ssl'", "obstore reaches AWS over https only; give an http:// endpoint_url")
    verify = client_kwargs.pop("verify", None)
    if verify is False:
        settings.client_options["allow_invalid_certificates"] = True
    elif isinstance(verify, str):  # a CA bundle's path; obstore takes the PEM text
        settings.client_options["root_certificate"] = Path(verify).read_bytes()


def _map_botocore_config(scheme: str, config_kwargs: dict, settings: _Settings) -> None:
    """botocore's ``Config`` entries (timeouts, retries) to obstore's client and retry options."""
    _set_timeouts(config_kwargs, settings, _BOTOCORE_TIMEOUTS)
    # botocore caps the connections in flight at max_pool_connections (zarr_store.py raises it for dcp_zarr's
    # concurrency). reqwest, under obstore, has no cap, and pool_max_idle_per_host is not one: it only closes idle
    # connections beyond it, which the unbounded default would have reused. So there is nothing to set.
    config_kwargs.pop("max_pool_connections", None)
    if "retries" in config_kwargs:
        retries = dict(config_kwargs.pop("retries"))
        mode = retries.pop("mode", "legacy")  # obstore has one policy: exponential backoff with jitter
        total, retries_only = retries.pop("total_max_attempts", None), retries.pop("max_attempts", None)
        _check_empty(scheme, "config_kwargs['retries']", retries)
        # botocore: total_max_attempts counts the first attempt and wins; max_attempts counts the retries only.
        if total is None:
            total = retries_only + 1 if retries_only is not None else 5 if mode == "legacy" else 3
        settings.retry_config = {"max_retries": max(total - 1, 0)}
    _check_empty(scheme, "config_kwargs", config_kwargs)


def _map_gcs(scheme: str, options: dict, settings: _Settings) -> None:
    """gcsfs's names to GCSStore's."""
    token = options.pop("token", None)
    if token == "anon":
        settings.config["skip_signature"] = True
    elif isinstance(token, dict):
        settings.config["service_account_key"] = json.dumps(token)
    elif isinstance(token, str) and token not in ("google_default", "cloud", "browser", "cache"):
        settings.config["service_account"] = token  # a path to the key file
    elif token not in (None, "google_default", "cloud"):  # those two: obstore's own ADC file, then metadata server
        raise _refused(scheme, f"token={token!r}", "obstore takes a key file's path, a key dict, 'anon', "
                       "'google_default' or 'cloud'")
    # gcsfs uses the project only to create and list buckets; obstore does neither, so there is nothing to pass on.
    options.pop("project", None)
    if endpoint := _pop_either(options, "endpoint_url", options, "endpoint"):
        _set_endpoint(settings, endpoint, "base_url")


def _map_azure(scheme: str, options: dict, settings: _Settings) -> None:
    """adlfs's names to AzureStore's. A connection string is refused (see _HINTS): obstore takes none."""
    for name in ("account_name", "account_key", "tenant_id", "client_id", "client_secret"):
        if (value := options.pop(name, None)) is not None:
            settings.config[name] = value
    if sas_token := options.pop("sas_token", None):
        settings.config["sas_key"] = sas_token.lstrip("?")  # adlfs takes it with or without the URL's "?"
    if options.pop("anon", None):
        settings.config["skip_signature"] = True
    if host := options.pop("account_host", None):  # adlfs: the account's whole host name
        _set_endpoint(settings, host if "://" in host else f"https://{host}", "endpoint")
    _set_timeouts(options, settings, _ADLFS_TIMEOUTS)
