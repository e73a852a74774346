"""Settings base shared by every service: one pydantic-settings class per service, with an env prefix."""

from __future__ import annotations

import hashlib
import json
from typing import Annotated, Any

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict


def split_keys(value: Any) -> Any:
    """Env vars carry lists of keys as comma-separated strings ("k1,k2"); JSON lists are accepted too."""
    if not isinstance(value, str):
        return value
    text = value.strip()
    return json.loads(text) if text.startswith("[") else [p.strip() for p in text.split(",") if p.strip()]


class ServiceSettings(BaseSettings):
    """Fields every service has. Subclasses set `model_config` with their own `env_prefix`."""

    model_config = SettingsConfigDict(env_prefix="PLUGSEARCH_", env_nested_delimiter="__", extra="ignore")

    host: str = Field("127.0.0.1", description="bind address; 0.0.0.0 only inside containers")
    port: int = Field(8000, ge=1, le=65535)
    log_level: str = Field("INFO", pattern=r"^(?i)(debug|info|warning|error|critical)$")
    workers: int = Field(1, ge=1, le=64, description="worker processes on the port, each on its own SO_REUSEPORT socket")

    # Security: API keys accepted on non-health endpoints (public services), and/or a shared internal token.
    api_keys: Annotated[list[SecretStr], NoDecode] = Field(default_factory=list)
    internal_token: SecretStr | None = None

    # Limits (also enforced per field by the request schemas).
    max_body_bytes: int = Field(2 * 1024 * 1024, ge=1024)
    max_in_flight: int = Field(256, ge=1, description="ceiling of concurrent requests before 429 + Retry-After")
    adaptive_concurrency: bool = Field(True, description=(
        "admit against a limit that follows latency (plugsearch.common.admission), at most max_in_flight; "
        "false: max_in_flight alone"))
    min_in_flight: int = Field(4, ge=1, description="the adaptive limit never goes below this")
    latency_tolerance: float = Field(1.5, ge=1.0, le=10.0, description=(
        "the adaptive limit shrinks while the mean latency per cost unit is over this many times its baseline"))
    body_timeout_s: float = Field(10.0, gt=0, description=(
        "the whole request body must arrive within this (else 408); a slow body holds no in-flight slot"))
    header_timeout_s: float = Field(10.0, gt=0, description=(
        "a connection must send a request's complete headers within this, from its first byte or from "
        "connecting (else it is closed: slow or silent clients)"))
    max_header_bytes: int = Field(32 * 1024, ge=1024, le=1024 * 1024, description=(
        "request line + headers larger than this are refused with 431"))
    request_timeout_s: float = Field(120.0, gt=0, description="per-request deadline; 504 when exceeded")
    keep_alive_s: float = Field(75.0, gt=0, description="idle keep-alive of client connections; above the "
                                "idle timeout of clients and load balancers, so the server is never the one "
                                "closing a connection a client is about to reuse")
    retry_after_s: int = Field(1, ge=1, le=3600, description="Retry-After (seconds) sent with an overload 429")
    gc_threshold: int = Field(10_000, ge=0, description=(
        "the served process's young-generation garbage-collection threshold (Python's default: 700), its startup's "
        "objects frozen out of the collections once it is ready (gc.freeze): a request allocates thousands of "
        "short-lived objects, and at 700 the collections it set off walked the objects of every request in flight "
        "(~1 ms of CPU per compact search, ~10% of the searcher's); 0: Python's defaults"))

    redis_url: SecretStr | None = Field(None, description=(
        "redis://[:password@]host:port/db (a secret: it may carry the password); unset = in-process cache"))
    cache_ttl_s: int = Field(7 * 24 * 3600, ge=0)
    cache_max_items: int = Field(100_000, ge=0)

    @field_validator("api_keys", mode="before")
    @classmethod
    def _split_keys(cls, value: Any) -> Any:
        return split_keys(value)

    @field_validator("internal_token", "redis_url", mode="before")
    @classmethod
    def _empty_token_is_none(cls, value: Any) -> Any:
        return None if value == "" else value

    @model_validator(mode="after")
    def _check_keys(self) -> ServiceSettings:
        for key in self.api_keys:
            if len(key.get_secret_value()) < 8:
                raise ValueError("every API key must be at least 8 characters")
        return self

    def redis_dsn(self) -> str | None:
        return None if self.redis_url is None else self.redis_url.get_secret_value()


class AdminKeySettings(ServiceSettings):
    """A service with admin keys (`<PREFIX>_ADMIN_KEYS`): API keys that may also do what a plain key may not (the
    retriever: change documents; the searcher: read and mark every key's feedback). They are accepted wherever an
    API key is (merged into `api_keys`); `admin_ids` names them as the guard names its callers."""

    admin_keys: Annotated[list[SecretStr], NoDecode] = Field(default_factory=list, description=(
        "admin keys (comma-separated or a JSON list, as the API keys): accepted as API keys, and for the service's "
        "admin operations (retriever: changing documents; searcher: every key's marks); a plain API key never may"))

    @field_validator("admin_keys", mode="before")
    @classmethod
    def _split_admin_keys(cls, value: Any) -> Any:
        return split_keys(value)

    @model_validator(mode="after")
    def _admins_are_keys(self) -> AdminKeySettings:
        for key in self.admin_keys:
            if len(key.get_secret_value()) < 8:
                raise ValueError("every admin key must be at least 8 characters")
        have = {k.get_secret_value() for k in self.api_keys}
        self.api_keys = [*self.api_keys, *(k for k in self.admin_keys if k.get_secret_value() not in have)]
        return self

    def admin_ids(self) -> frozenset[str]:
        """The admin keys as the guard identifies callers (`Caller.id` of a key: a digest prefix, never the key)."""
        from plugsearch.common.admission import key_id

        return frozenset(key_id(hashlib.sha256(k.get_secret_value().encode()).digest()) for k in self.admin_keys)
